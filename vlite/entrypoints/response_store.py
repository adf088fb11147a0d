"""The Responses API's store (``store: true``): responses by id, with the conversation that led to
each, for ``previous_response_id`` and ``GET /v1/responses/{id}``. Bounded by construction: at
most ``max_entries`` responses, each kept at most ``ttl_s`` seconds, the oldest dropped first
(vLLM's store keeps every response for ever when enabled: vllm#48275)."""

from __future__ import annotations

import time
from collections import OrderedDict

STORE_MAX_ENTRIES = 1024
STORE_TTL_S = 3600.0


class ResponseStore:
    """Stored responses by id, with the conversation that led to each (for
    ``previous_response_id``): at most ``max_entries``, each kept ``ttl_s`` seconds at most."""

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES, ttl_s: float = STORE_TTL_S) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._entries: OrderedDict[str, tuple[float, list[dict], dict]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep ``response`` with ``conversation`` (its messages, its answer last), dropping expired
        entries and then the oldest beyond ``max_entries``."""
        now = time.monotonic()
        self._expire(now)
        self._entries[response["id"]] = (now, conversation, response)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict] | None:
        """(conversation, response) of a stored, unexpired response, or None."""
        self._expire(time.monotonic())
        entry = self._entries.get(response_id)
        return None if entry is None else (entry[1], entry[2])

    def _expire(self, now: float) -> None:
        while self._entries:
            first = next(iter(self._entries.values()))
            if now - first[0] <= self.ttl_s:
                return
            self._entries.popitem(last=False)
