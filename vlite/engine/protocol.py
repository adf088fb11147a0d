"""``EngineClient``: the narrow interface a client drives an engine through (vLLM's
``vllm/engine/protocol.py`` ``EngineClient``, here synchronous).

The leak checker's in-process client (``vlite/diagnostics``) uses only these members plus the
read-only ``EngineView`` (``vlite.engine.introspection``); ``tests/test_architecture.py``
checks that it touches nothing else on the engine. ``LLMEngine`` satisfies it structurally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from vlite.engine.core.sequence import RequestOrigin
    from vlite.engine.outputs import RequestOutput
    from vlite.engine.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """Add, step, abort, and ask whether work is left; plus the tokenizer that renders prompts
    (vLLM's ``EngineClient.get_tokenizer``)."""

    tokenizer: Any  # a transformers tokenizer (PreTrainedTokenizerBase)

    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    origin: RequestOrigin | None = None) -> str:
        """Queue one request; returns its id. Raises ``RequestRejectedError`` (a ValueError)
        for a request the engine will never run; nothing is allocated then."""
        ...

    def add_requests(self, requests: list) -> list[str]:
        """Queue ``EngineRequest``-like items all or none (a multi-prompt completion); returns
        their ids. On a refusal the ones admitted before it are aborted, then the
        ``RequestRejectedError`` is raised."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; an output for every request that advanced or ended."""
        ...

    def abort(self, request_id: str) -> bool:
        """Abort a live request (its blocks go back to the free list); False if none is live."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        ...


#: The member names of ``EngineClient`` (what diagnostics may touch on an engine).
ENGINE_CLIENT_MEMBERS = frozenset({"tokenizer", "add_request", "add_requests", "step", "abort",
                                   "has_unfinished_requests"})
