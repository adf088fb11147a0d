"""The serving layer's words: the async client Protocol, a request to add, and the messages of
the engine loop.

``AsyncEngineClient`` is what the OpenAI server drives (vLLM's async ``EngineClient``);
``AsyncLLMEngine`` (engine loop in a thread) and ``MPAsyncLLMEngine`` (engine loop in an engine
core process) both implement it.

The engine loop (``vlite.engine.serving.engine_loop.EngineLoop``) takes *commands* and gives
back *events*, the same tuples whichever transport carries them (a thread's queue, or a pipe
to the engine core process, where they are pickled):

Commands (client -> loop), applied between two steps, in order:
    ("add", (add_id, [EngineRequest, ...]))   added atomically; answered by an "added" event
    ("abort", [request_id, ...])              answered by each request's final "abort" output
    ("abort_all", None)                       graceful shutdown: abort everything in flight
    ("call", (call_id, query))                a read-only query: a name in ``engine_loop.QUERIES``
                                              (in process also a callable ``fn(engine)``); "result"
    ("stop", None)                            abort everything, answer what is queued, stop

Events (loop -> client), sent in one batch per loop iteration with the engine's stats taken
after them, so a client that sees a request end also sees the blocks it freed:
    ("out", RequestOutput, deliver)   deliver False: for metrics only (the stream got an error instead)
    ("error", request_id, message)    the step failed; the request is gone
    ("added", add_id, exception | None)
    ("result", call_id, value, exception | None)
    ("census",)                       a request-id census ran at an idle point: its counts are in the
                                      stats of this batch (without it an idle core would send nothing)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vlite.engine.core.sequence import RequestOrigin
from vlite.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlite.engine.metrics import EngineStats
    from vlite.engine.serving.streams import RequestStreamGroup

Command = tuple[str, Any]
Event = tuple


class EngineNotRunningError(RuntimeError):
    """The engine loop is stopping or stopped; no new request is accepted."""


class EngineCoreStartError(RuntimeError):
    """The engine core process failed to load the model (the message says why) or died while loading."""


@dataclass(frozen=True)
class EngineRequest:
    """One request to add: a prompt (text and/or token ids), its sampling params and origin.

    ``origin.request_id`` is the engine request id.
    """

    prompt: str | None
    sampling_params: SamplingParams
    origin: RequestOrigin
    prompt_token_ids: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.origin.request_id


@runtime_checkable
class AsyncEngineClient(Protocol):
    """What asyncio code (the OpenAI server) drives a served engine through.

    ``latest_stats`` is an ``EngineStats`` snapshot refreshed by the engine loop; reading it
    never waits for the engine. The descriptive members (``tokenizer`` ... ``block_size``) are
    fixed once the model is loaded.
    """

    latest_stats: EngineStats | None

    @property
    def tokenizer(self) -> Any:
        """The engine's Hugging Face tokenizer (the API process tokenizes and detokenizes with it)."""
        ...

    @property
    def hf_config(self) -> Any:
        """The model's Hugging Face config (``vocab_size`` bounds token ids)."""
        ...

    @property
    def structured_output_compiler(self) -> Any:
        """A ``StructuredOutputManager`` the server compiles a request's constraint in before queueing."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def model_root(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    @property
    def pid(self) -> int | None:
        """The process that steps the engine (this one for the in-process loop)."""
        ...

    @property
    def is_running(self) -> bool: ...

    def start(self) -> None:
        """Start serving; call it from the running event loop."""
        ...

    def begin_shutdown(self) -> None:
        """Stop accepting requests and abort every request in flight (signal-safe: only queues)."""
        ...

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort all requests, stop the engine loop and wait for it."""
        ...

    async def add_requests(self, requests: list[EngineRequest]) -> RequestStreamGroup:
        """Add requests atomically; raises ``RequestRejectedError`` or ``EngineNotRunningError``."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Queue an abort of ``request_ids`` (thread-safe, never blocks)."""
        ...

    async def query(self, name: str) -> Any:
        """Run the read-only query ``name`` (``engine_loop.QUERIES``) between two steps."""
        ...

    async def blocks_snapshot(self) -> dict:
        """The /debug/blocks document (``vlite.engine.introspection.blocks_document``)."""
        ...
