"""Per-request output streams on the event loop.

A ``RequestStreamGroup`` is what ``AsyncEngineClient.add_requests`` returns: the streams of the
requests one HTTP request added. The async client delivers outputs into it on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, Self

from vlite.engine.outputs import RequestOutput


class _Aborts(Protocol):
    def abort(self, request_ids: list[str]) -> None: ...


class RequestStreamGroup:
    """The streams of requests added together (one HTTP request: one engine request per
    prompt; the n choices of a prompt are sequences of its one request, sharing its blocks).

    Iterate it on the event loop to get ``(index, RequestOutput)`` pairs, index being the
    request's position in the group, until every request has finished. Outputs are cumulative
    (vLLM's RequestOutput). A request the engine aborted ends with finish_reason "abort".

    ``abort()`` aborts every request not finished yet; it is idempotent and never blocks.
    Use ``async with group:`` (or call ``abort()`` in a ``finally``) so that a handler that
    is cancelled, e.g. because its client disconnected, frees its requests' KV blocks.
    """

    def __init__(self, engine: _Aborts, request_ids: list[str]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.finished = [False] * len(request_ids)

    @property
    def all_finished(self) -> bool:
        return all(self.finished)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """On the event loop: queue one output (or an exception) for the consumer."""
        i = self._index[request_id]
        if self.finished[i]:
            return
        if isinstance(item, BaseException) or item.finished:
            self.finished[i] = True
        self._queue.put_nowait((i, item))

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while not (self.all_finished and self._queue.empty()):
            i, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item

    def abort(self) -> None:
        """Abort every request of the group that has not finished (thread-safe, non-blocking)."""
        live = [rid for rid, done in zip(self.request_ids, self.finished) if not done]
        self.finished[:] = [True] * len(self.finished)
        if live:
            self._engine.abort(live)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()
