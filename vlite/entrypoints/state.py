"""The server's settings and its mutable state (loading -> ready -> shutting_down)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from vlite.entrypoints.response_store import ResponseStore

if TYPE_CHECKING:
    from vlite.engine import AsyncLLMEngine, MPAsyncLLMEngine
    from vlite.entrypoints.census import ApiServerCensus
    from vlite.entrypoints.metrics import ServerMetrics

Status = Literal["loading", "ready", "shutting_down", "failed"]

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_MAX_N = 128  # OpenAI's documented upper bound of n for completions
TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class ServerSettings:
    """What ``vlite serve`` was asked for (flags named as vLLM's).

    served_model_names: names clients may put in ``model``; empty = the engine's model name.
    max_request_body_bytes: larger bodies get 413.
    log_stats_interval: seconds between ``--log-stats`` lines.
    max_n: most choices one request may ask for (``n``, ``best_of``, and prompts x n).
    """

    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    enable_debug_endpoints: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    log_stats: bool = False
    log_stats_interval: float = 10.0
    max_n: int = DEFAULT_MAX_N


@dataclass
class ServerState:
    """Shared by the routes and middleware; ``engine`` is set once the model is loaded.

    requests_in_flight: HTTP requests being served now, the observers' (/metrics, /health,
    /version, /debug/*) not counted (``middleware.InFlightMiddleware``); last_request_start,
    last_request_end: ``time.monotonic()`` when a counted request last started and last ended
    (the census's new-work and quiet clocks); census: this process's request-id census
    (``vlite.entrypoints.census``), run at its idle points.
    """

    settings: ServerSettings
    status: Status = "loading"
    engine: AsyncLLMEngine | MPAsyncLLMEngine | None = None
    metrics: ServerMetrics | None = None
    model_names: tuple[str, ...] = ()
    model_root: str | None = None
    max_model_len: int | None = None
    load_error: str | None = None
    load_abandoned: bool = False  # shutdown began while the model loaded (Ctrl-C): the load was left
    max_prompt_chars: int | None = None  # set on first use (vlite.entrypoints.serving.max_prompt_chars)
    requests_in_flight: int = 0
    last_request_start: float = 0.0
    last_request_end: float = 0.0
    census: ApiServerCensus | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's store (bounded)
    _tokenizer_pool: ThreadPoolExecutor | None = None

    def tokenizer_pool(self) -> ThreadPoolExecutor:
        """The threads that tokenize, render chat templates and detokenize, off the event loop."""
        if self._tokenizer_pool is None:
            self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="vlite-tokenizer")
        return self._tokenizer_pool

    @property
    def model_name(self) -> str:
        """The first served name: what responses report in ``model``."""
        return self.model_names[0]

    def begin_shutdown(self) -> None:
        """Refuse new requests (503) and abort those in flight; safe in a signal handler."""
        if self.status != "failed":
            self.status = "shutting_down"
        if self.engine is not None:
            self.engine.begin_shutdown()
