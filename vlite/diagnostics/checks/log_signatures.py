"""Servers' own log lines that tell of aborts, zombies and leaked KV (``--from-log``, ``--watch --server-log``).

Each signature is a server's message, matched wherever the line's prefix (timestamp, logger,
process) puts it. The texts come from the servers' sources:

* vLLM ``Aborted request cmpl-1.`` / ``Aborted request(s) cmpl-1,cmpl-2.`` (``AsyncLLM.abort``,
  ``vllm/v1/engine/async_llm.py``, with request logging on): an abort that reached the engine.
  Counted, per request id: a client that left early with no such line is an abort lost on the way.
* SGLang ``Received output for rid=... but the state was deleted in TokenizerManager.``
  (``TokenizerManager._handle_batch_output``): the scheduler still decodes a request the API
  side has forgotten; repeated, the zombies of SGLang #36333.
* TensorRT-LLM ``Timed out waiting for context KV cache transfer after N milliseconds.``
  (``cacheTransceiver.cpp``): a context request's KV is held past its transfer; repeating, the
  leak that wedged the prefill worker in TensorRT-LLM PR #12313.
* TensorRT-LLM ``[kv cache manager] storeContextBlocks: Can not find sequence for request N``
  (``kvCacheManager.cpp``): a request was terminated before its context blocks were stored
  (PR #12945); harmless once at warm-up (the dummy request), a sign of early termination after.
* llama.cpp ``cache size limit reached, removing oldest entry (size = X MiB)`` and ``cache
  token limit (N, est: M) reached, removing oldest entry`` (``server_prompt_cache::update``):
  the host-RAM prompt cache is at its ``--cache-ram`` limit. Host memory that grew up to that
  limit is the cache, not a leak.

``kind`` says what a hit means for the verdict: ``abort`` and ``cache-limit`` are evidence
only; ``zombie`` and ``leak`` are symptoms that make the verdict (ZOMBIE, LEAK) of a log with no
stats line to judge the KV cache by, and a note beside any other verdict.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from vlite.diagnostics.checks.verdict import Verdict


@dataclass(frozen=True)
class Signature:
    """One server message: ``name``, the ``server`` that logs it, its ``pattern`` (a regex with
    an optional ``ids`` group: comma-separated request ids counted one by one), its ``kind``
    (abort, zombie, leak, warning or cache-limit), what it ``means`` and the ``source`` of the text."""

    name: str
    server: str
    pattern: re.Pattern
    kind: str
    means: str
    source: str


SIGNATURES: tuple[Signature, ...] = (
    Signature("vllm-aborted-request", "vllm", re.compile(r"Aborted request(?:\(s\))? (?P<ids>[^\s]+?)\.?\s*$"),
              "abort", "the engine aborted these requests (their clients left or were cancelled)",
              "vllm/v1/engine/async_llm.py AsyncLLM.abort"),
    Signature("sglang-state-deleted", "sglang",
              re.compile(r"Received output for rid=\S+ but the state was deleted in TokenizerManager"),
              "zombie", "the scheduler still produces output for a request the API side has dropped "
                        "(SGLang #36333: abandoned requests decoding on)",
              "sglang/srt/managers/tokenizer_manager.py _handle_batch_output"),
    Signature("trtllm-kv-transfer-timeout", "trtllm",
              re.compile(r"[Tt]imed out waiting for context KV cache transfer after \d+"),
              "leak", "a context request's KV cache is held past its transfer timeout; repeating, the leak that "
                      "exhausted the pool and wedged the server (TensorRT-LLM PR #12313)",
              "cpp/tensorrt_llm/batch_manager/cacheTransceiver.cpp"),
    Signature("trtllm-store-context-blocks", "trtllm",
              re.compile(r"storeContextBlocks: Can not find sequence for request (?P<ids>\d+)"),
              "warning", "a request was terminated before its context blocks were stored (TensorRT-LLM PR #12945); "
                         "once at warm-up it is the dummy request",
              "cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp"),
    Signature("llamacpp-prompt-cache-limit", "llamacpp",
              re.compile(r"cache (?:size limit|token limit \(\d+, est: \d+\)) reached, removing oldest entry"),
              "cache-limit", "the host-RAM prompt cache is full (--cache-ram) and evicts: host memory that grew up "
                             "to this limit is the cache, not a leak",
              "llama.cpp tools/server, server_prompt_cache::update"),
)
BY_NAME = {s.name: s for s in SIGNATURES}
VERDICT_OF_KIND = {"leak": Verdict.LEAK, "zombie": Verdict.ZOMBIE}


def match(line: str) -> list[tuple[Signature, int]]:
    """The signatures ``line`` carries, each with its count (request ids named, else 1)."""
    out = []
    for sig in SIGNATURES:
        m = sig.pattern.search(line)
        if m:
            ids = m.groupdict().get("ids")
            out.append((sig, len([i for i in ids.split(",") if i]) if ids else 1))
    return out


class SignatureCounter:
    """Counts signature hits over lines fed in order (a whole log, or a followed one).

    ``hits``: name -> ``{"signature", "server", "kind", "means", "count", "lines", "first_line",
    "last_line", "example"}`` (``count``: request ids or lines; ``lines``: matching lines).
    """

    def __init__(self) -> None:
        self.hits: dict[str, dict] = {}
        self.lines_read = 0

    def feed(self, lines: Iterable[str]) -> list[str]:
        """Scan ``lines``; returns the names of signatures seen for the first time."""
        new = []
        for line in lines:
            self.lines_read += 1
            for sig, n in match(line):
                h = self.hits.get(sig.name)
                if h is None:
                    h = self.hits[sig.name] = {"signature": sig.name, "server": sig.server, "kind": sig.kind,
                                               "means": sig.means, "count": 0, "lines": 0,
                                               "first_line": self.lines_read, "example": line.strip()[:300]}
                    new.append(sig.name)
                h["count"] += n
                h["lines"] += 1
                h["last_line"] = self.lines_read
        return new

    def summary(self) -> list[dict]:
        """The hits, in ``SIGNATURES`` order."""
        return [self.hits[s.name] for s in SIGNATURES if s.name in self.hits]


def describe(h: dict) -> str:
    """One line for a hit: the server's message, how often, where, and what it means."""
    what = "request ids" if BY_NAME[h["signature"]].pattern.groupindex.get("ids") else "lines"
    where = (f"line {h['first_line']}" if h["lines"] == 1 else f"lines {h['first_line']}-{h['last_line']}")
    return f"{h['server']} '{h['signature']}': {h['count']} {what} ({where}): {h['means']}"


def symptom_verdict(hits: list[dict]) -> str | None:
    """LEAK when a leak signature was seen, else ZOMBIE for a zombie one, else None."""
    kinds = {h["kind"] for h in hits}
    return Verdict.LEAK if "leak" in kinds else Verdict.ZOMBIE if "zombie" in kinds else None
