"""The async client: ``AsyncLLMEngine`` (engine loop in a thread) and ``MPAsyncLLMEngine``
(engine loop in an engine core process), one class of code over two core clients.

Both implement ``AsyncEngineClient`` (``vlite.engine.serving.protocol``). Requests go to the
engine loop as commands through the core client (``core_client.InprocClient`` or
``core_client.MPClient``); each event batch comes back on the core client's thread, where
``on_output`` (metrics) sees every output and the deliveries to the request streams
(``RequestStreamGroup``), adds and queries are handed to the event loop in one
``loop.call_soon_threadsafe`` call.

If the engine loop ends unexpectedly (the core process died, or a tensor-parallel rank
failed), every request in flight gets a RuntimeError, new requests get EngineNotRunningError,
and ``on_death(message)`` is called on the event loop (``vlite serve`` exits non-zero).

The client keeps the ids of the last ``census.ENDED_HISTORY`` requests that ended in its view (a final
output, an error, a refused add, the loop's end): what the API server's request-id census
(``vlite.entrypoints.census``) looks for in this process at its idle points.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any, Self

from vlite.engine.census import EndedRequests
from vlite.engine.config import EngineConfig
from vlite.engine.core.structured_output import StructuredOutputManager
from vlite.engine.metrics import EngineStats
from vlite.engine.outputs import RequestOutput
from vlite.engine.serving.core_client import InprocClient, MPClient
from vlite.engine.serving.protocol import EngineNotRunningError, EngineRequest, Event
from vlite.engine.serving.streams import RequestStreamGroup

logger = logging.getLogger("vlite.core_client")

STOP_TIMEOUT_S = 30.0

Call = tuple[Callable[..., None], tuple]


class _AsyncClient:
    """What both async engines share: request streams, adds and queries over a core client."""

    def __init__(self, core: InprocClient | MPClient, *, on_output: Callable[[RequestOutput], None] | None,
                 on_death: Callable[[str], None] | None) -> None:
        self.core = core
        self.on_output = on_output
        self.on_death = on_death
        self.latest_stats: EngineStats | None = None
        self._groups: dict[str, RequestStreamGroup] = {}  # request id -> its stream group
        self._pending: dict[int, asyncio.Future] = {}  # add and query ids -> their futures
        self._adding: dict[int, RequestStreamGroup] = {}  # add id -> the group it adds
        self._ids = itertools.count()
        # requests that ended in this client's view: the API server's census looks for them
        self.ended = EndedRequests()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._stopping = False
        self._dead = False

    # ---- life cycle (event loop side) ---------------------------------------------------------
    def start(self) -> None:
        """Start the core client's thread(s); call it from the running event loop."""
        if self._loop is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self.core.start(self._handle_events, self._on_exit)

    @property
    def pid(self) -> int | None:
        """The id of the process that steps the engine."""
        return self.core.pid

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self.core.is_alive() and not self._dead

    def census_skip(self) -> tuple[object, ...]:
        """What the API server's request-id census must not enter from this client: its own
        record of ended ids; the event loop (its ready queue, timers and selector reach the
        server's connections, which are uvicorn's: a keep-alive connection keeps its last
        request's scope until the next request); and what the engine loop's census walks already
        (``AsyncLLMEngine``: the engine and the in-process core client with its loop; one
        process, walked once)."""
        return (self.ended, self._loop)

    def begin_shutdown(self) -> None:
        """Stop accepting requests and abort every request in flight (signal-safe: only queues)."""
        self._accepting = False
        self.core.put(("abort_all", None))

    async def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Abort all requests, stop the engine loop and wait for it (up to ``timeout`` s)."""
        self._accepting = False
        self._stopping = True
        if self._loop is None:  # never started (shutdown began while loading)
            await asyncio.to_thread(self.core.close)
            return
        await asyncio.to_thread(self.core.stop, timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ---- requests (event loop side) -----------------------------------------------------------
    async def add_requests(self, requests: list[EngineRequest]) -> RequestStreamGroup:
        """Add requests atomically; returns their group once the engine loop has queued them all.

        Raises:
            RequestRejectedError: the engine rejected one of them (nothing stays queued).
            EngineNotRunningError: the engine is shutting down, stopped or dead.
        """
        if not self._accepting or not self.is_running:
            raise EngineNotRunningError("the engine is not accepting requests (shutting down)")
        group = RequestStreamGroup(self, [r.request_id for r in requests])
        add_id = next(self._ids)
        done = self._loop.create_future()
        self._adding[add_id] = group  # routed once the loop has added them
        self._pending[add_id] = done
        self.core.put(("add", (add_id, requests)))
        try:
            await done
        except asyncio.CancelledError:
            group.abort()  # the add may still be applied; the abort queued behind it undoes it
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Queue an abort of ``request_ids``; it is applied before the next step (thread-safe, never
        blocks). Each stream still open ends with the request's final "abort" output."""
        self.core.put(("abort", list(request_ids)))

    async def query(self, name: str) -> Any:
        """Run the engine loop's read-only query ``name`` (``engine_loop.QUERIES``) between two steps.

        Raises whatever the query raised, or EngineNotRunningError.
        """
        return await self._call(name)

    async def _call(self, query: str | Callable[[Any], Any]) -> Any:
        if not self.is_running:
            raise EngineNotRunningError("the engine loop is not running")
        call_id = next(self._ids)
        done = self._loop.create_future()
        self._pending[call_id] = done
        self.core.put(("call", (call_id, query)))
        return await done

    async def blocks_snapshot(self) -> dict:
        """The /debug/blocks document (``vlite.engine.introspection.blocks_document``), taken between two steps."""
        return await self.query("blocks_snapshot")

    # ---- events (the core client's thread) ----------------------------------------------------
    def _handle_events(self, events: list[Event], stats: EngineStats) -> None:
        self.latest_stats = stats
        calls: list[Call] = []
        for ev in events:
            kind = ev[0]
            if kind == "out":
                out, deliver = ev[1], ev[2]
                self._notify(out)
                group = self._groups.get(out.request_id) if deliver else None
                if out.finished:
                    self.ended.record(out.request_id)
                if group is not None:
                    if out.finished:
                        self._groups.pop(out.request_id, None)
                    calls.append((group._deliver, (out.request_id, out)))
            elif kind == "error":  # its final "out" (not delivered) came first and was recorded
                group = self._groups.pop(ev[1], None)
                if group is not None:
                    calls.append((group._deliver, (ev[1], RuntimeError(ev[2]))))
            elif kind in ("added", "result"):
                group = self._adding.pop(ev[1], None)
                if group is not None and ev[2] is None:  # added: route its outputs (they follow this event)
                    for rid in group.request_ids:
                        self._groups[rid] = group
                elif group is not None:  # refused: those the loop had added sent a final "out" already
                    for rid in group.request_ids:
                        if rid not in self.ended:
                            self.ended.record(rid)
                fut = self._pending.pop(ev[1], None)
                if fut is not None:
                    value, exc = (None, ev[2]) if kind == "added" else (ev[2], ev[3])
                    calls.append((_set_future, (fut, value, exc)))
        self._post_all(calls)

    def _notify(self, out: RequestOutput) -> None:
        """Hand ``out`` to ``on_output`` (metrics); a failing callback is logged, never fatal."""
        if self.on_output is None:
            return
        try:
            self.on_output(out)
        except Exception:
            logger.exception("on_output callback failed")

    def _post_all(self, calls: list[Call]) -> None:
        if not calls:
            return
        try:
            self._loop.call_soon_threadsafe(_run_all, calls)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _on_exit(self, reason: str | None) -> None:
        self._post_all([(self._loop_exited, (reason,))])

    def _loop_exited(self, reason: str | None) -> None:
        """On the event loop, once the engine loop has ended: a stop, or the engine's death."""
        self._accepting = False
        died = not self._stopping
        self._dead = True
        message = reason or self.core.exit_message()
        if died:
            logger.error("%s; failing %d request(s) in flight", message, len(self._groups))
        for rid, group in list(self._groups.items()):
            self.ended.record(rid)
            group._deliver(rid, RuntimeError(message) if died else EngineNotRunningError("the engine has stopped"))
        self._groups.clear()
        for fut in list(self._pending.values()):
            _set_future(fut, None, EngineNotRunningError(message if died else "the engine has stopped"))
        self._pending.clear()
        self._adding.clear()
        if died and self.on_death is not None:
            try:
                self.on_death(message)
            except Exception:
                logger.exception("on_death callback failed")


class AsyncLLMEngine(_AsyncClient):
    """Runs ``engine`` in one background thread (``InprocClient``) and serves it to asyncio code.

    Args:
        engine: a loaded LLMEngine; after ``start()`` only the engine thread touches it.
        on_output: called on the engine thread with every RequestOutput, including the final
            "abort" output the loop makes for an aborted request (used for Prometheus metrics).
            Its exceptions are logged and ignored.
        log_stats: log one stats line (vLLM's shape) every ``log_stats_interval`` seconds.
        on_fatal: called once, on the event loop, with the reason when the engine dies (a
            tensor-parallel rank failed); the loop then stops (``vlite serve`` exits non-zero).

    ``latest_stats`` is an EngineStats snapshot refreshed after every loop iteration (after the
    queued commands and after each step); reading it never waits for the engine.
    """

    def __init__(self, engine, *, on_output: Callable[[RequestOutput], None] | None = None,
                 log_stats: bool = False, log_stats_interval: float = 10.0,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        super().__init__(InprocClient(engine, log_stats=log_stats, log_stats_interval=log_stats_interval),
                         on_output=on_output, on_death=on_fatal)
        self.engine = engine
        self.latest_stats = engine.stats()

    @property
    def block_size(self) -> int:
        """Tokens per KV block (fixed once the engine is built); the block count is ``latest_stats.num_total_blocks``."""
        return self.engine.block_size

    @property
    def tokenizer(self):
        """The engine's Hugging Face tokenizer (the API process tokenizes and detokenizes with it)."""
        return self.engine.tokenizer

    @property
    def hf_config(self):
        """The model's Hugging Face config (``vocab_size`` bounds token ids)."""
        return self.engine.hf_config

    @property
    def structured_output_compiler(self) -> StructuredOutputManager:
        """The engine's grammar compiler cache (thread-safe): the server compiles a request's
        constraint in it before queueing."""
        return self.engine.structured_output

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_root(self) -> str:
        return str(self.engine.config.model)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def census_skip(self) -> tuple[object, ...]:
        """The ended-id record, the engine and the core client (whose loop's census walks them)."""
        return (*super().census_skip(), self.engine, self.core)

    async def run_on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result
        (in process only: ``fn`` need not be picklable).

        For read-only views (tests, debugging); ``fn`` must not change the engine's state.
        Raises whatever ``fn`` raises, or EngineNotRunningError.
        """
        return await self._call(fn)


class MPAsyncLLMEngine(_AsyncClient):
    """Serves an engine core process (``MPClient``) to asyncio code, with AsyncLLMEngine's methods.

    Args:
        config: the engine configuration; the core process builds ``LLMEngine(config)``.
        on_output: called on the receiver thread with every RequestOutput (metrics); exceptions are logged.
        on_death: called on the event loop with a message if the core process exits unexpectedly.
        log_stats, log_stats_interval: the core logs the ``--log-stats`` line.

    Call ``launch()`` (blocking: spawns the process and waits until the model is loaded; raises
    EngineCoreStartError) in a worker thread, then ``start()`` on the event loop.
    """

    def __init__(self, config: EngineConfig, *, on_output: Callable[[RequestOutput], None] | None = None,
                 on_death: Callable[[str], None] | None = None, log_stats: bool = False,
                 log_stats_interval: float = 10.0) -> None:
        super().__init__(MPClient(config, log_stats=log_stats, log_stats_interval=log_stats_interval),
                         on_output=on_output, on_death=on_death)
        self.config = config
        self.info: dict[str, Any] = {}
        self._compiler: StructuredOutputManager | None = None  # built on first use

    def launch(self, timeout: float | None = None) -> None:
        """Spawn the core process and wait for its "ready" (blocking; call it off the event loop).

        Raises:
            EngineCoreStartError: the model failed to load, or the process died before it was ready.
        """
        self.info = self.core.launch(timeout)
        self.latest_stats = self.info["stats"]

    # ---- the engine's description (from the core's "ready") --------------------------------
    @property
    def tokenizer(self):
        """The engine's tokenizer, a copy received from the core (the API process tokenizes)."""
        return self.info["tokenizer"]

    @property
    def hf_config(self):
        return self.info["hf_config"]

    @property
    def structured_output_compiler(self) -> StructuredOutputManager:
        """A grammar compiler in the API process, over the core's tokenizer: it validates a
        request's constraint (a 400 before queueing) off the event loop; the core compiles the
        grammar again into its own cache when the request arrives (one compile per distinct
        constraint, cached there afterwards)."""
        if self._compiler is None:
            self._compiler = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size,
                                                     self.info.get("eos_token_ids", ()))
        return self._compiler

    @property
    def model_name(self) -> str:
        return self.info["model_name"]

    @property
    def model_root(self) -> str:
        return self.info["model_root"]

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def block_size(self) -> int:
        return self.info["block_size"]

    async def blocks_snapshot(self) -> dict:
        """The /debug/blocks document, taken in the core between two steps, plus this client's registry."""
        doc = await super().blocks_snapshot()
        doc["view"]["registries"]["core_client.streams"] = len(self._groups)
        return doc


def _run_all(calls: list[Call]) -> None:
    for fn, args in calls:
        fn(*args)


def _set_future(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the waiter was cancelled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
