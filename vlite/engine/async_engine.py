"""AsyncLLMEngine: one background thread steps the LLMEngine; asyncio handlers get per-request streams.

The model forward is blocking CPU/GPU work, so the engine runs in a single dedicated thread
(the *engine loop*). Nothing else touches the LLMEngine: adds, aborts and read-only queries
are queued as commands and applied between steps, so an abort lands within one engine step.
Outputs go back to the asyncio event loop with ``loop.call_soon_threadsafe``.

An exception from one command (a rejected request, a planted fault in abort) or from one
step is logged and handed to the affected requests; the loop itself keeps running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Self

from vlite.engine.llm_engine import LLMEngine
from vlite.engine.metrics import EngineStats, StatsLogger
from vlite.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.sequence import FinishReason, RequestOrigin

logger = logging.getLogger("vlite.async_engine")


class EngineNotRunningError(RuntimeError):
    """The engine loop is stopping or stopped; no new request is accepted."""


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

    def __init__(self, engine: AsyncLLMEngine, request_ids: list[str]) -> None:
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


@dataclass
class _Live:
    group: RequestStreamGroup
    request: EngineRequest
    last: RequestOutput | None = None


def notify_output(on_output: Callable[[RequestOutput], None] | None, out: RequestOutput) -> None:
    """Hand ``out`` to the server's ``on_output`` callback (metrics); a failing callback is logged,
    never allowed to stop an engine loop."""
    if on_output is None:
        return
    try:
        on_output(out)
    except Exception:
        logger.exception("on_output callback failed")


def abort_live(engine: LLMEngine, live: dict[str, Any], request_id: str) -> RequestOutput | None:
    """Abort one request of an engine loop's ``live`` map (its entries have ``request`` and
    ``last``): drop it, free it through the engine's one abort path, and return its final
    "abort" output; None if it already finished. A failing abort (the planted fault
    skip-free-on-abort) is logged; the loop keeps serving."""
    entry = live.pop(request_id, None)
    if entry is None:
        return None  # already finished (or never added): nothing to free
    try:
        engine.abort(request_id)
    except Exception:
        logger.exception("abort of request %r failed", request_id)
    return aborted_output(entry.request, entry.last)


def add_all(loop, requests: list[EngineRequest], make_live: Callable[[EngineRequest], Any]) -> Exception | None:
    """Add ``requests`` to an engine loop's engine all or none (``loop.engine``, ``loop._live``,
    ``loop._abort``): each added request gets ``loop._live[id] = make_live(request)``; on the
    first failure those already added are aborted without delivering an output, and the
    exception is returned for the caller to raise. Returns None when all were added."""
    added: list[str] = []
    try:
        for r in requests:
            loop.engine.add_request(r.prompt, r.sampling_params, prompt_token_ids=r.prompt_token_ids,
                                    request_id=r.request_id, origin=r.origin)
            added.append(r.request_id)
            loop._live[r.request_id] = make_live(r)
    except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
        for rid in added:
            loop._abort(rid, deliver=False)
        return exc
    return None


def abort_all(loop) -> None:
    """Abort every request in flight of an engine loop (``loop._live``, ``loop._abort``)."""
    if loop._live:
        logger.info("aborting %d request(s) in flight", len(loop._live))
    for rid in list(loop._live):
        loop._abort(rid)


def apply_commands(loop, commands: list[tuple[str, Any]]) -> bool:
    """Apply queued ``(kind, arg)`` commands, in order, to an engine loop (``AsyncLLMEngine`` in
    a thread, ``EngineCore`` in its own process): "add", "abort" (request ids), "abort_all",
    "call" and "stop" (which also aborts everything). Returns True when a "stop" came."""
    stop = False
    for kind, arg in commands:
        if kind == "add":
            loop._add(*arg)
        elif kind == "abort":
            for rid in arg:
                loop._abort(rid)
        elif kind == "abort_all":
            loop._abort_all()
        elif kind == "call":
            loop._call(*arg)
        elif kind == "stop":
            stop = True
    if stop:
        loop._abort_all()
    return stop


class AsyncLLMEngine:
    """Runs ``engine`` in one background thread and serves it to asyncio code.

    Args:
        engine: a loaded LLMEngine; after ``start()`` only the engine thread touches it.
        on_output: called on the engine thread with every RequestOutput, including the final
            "abort" output the loop makes for an aborted request (used for Prometheus metrics).
            Its exceptions are logged and ignored.
        log_stats: log one stats line (vLLM's shape) every ``log_stats_interval`` seconds.
        on_fatal: called once, on the engine thread, with the reason when the engine dies (a
            tensor-parallel rank failed); the loop then stops (``vlite serve`` exits non-zero).

    ``latest_stats`` is an EngineStats snapshot refreshed after every loop iteration (after the
    queued commands and after each step); reading it never waits for the engine.
    """

    def __init__(self, engine: LLMEngine, *, on_output: Callable[[RequestOutput], None] | None = None,
                 log_stats: bool = False, log_stats_interval: float = 10.0,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self.on_output = on_output
        self.log_stats = log_stats
        self.log_stats_interval = log_stats_interval
        self.latest_stats: EngineStats = engine.stats()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._outbox: list[tuple[Callable[..., None], tuple]] = []  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stats_logger = StatsLogger(logger, log_stats_interval) if log_stats else None

    # ---- life cycle (event loop side) -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; must be called from the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="vlite-engine-loop", daemon=True)
        self._thread.start()

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
    def structured_output_compiler(self):
        """The engine's grammar compiler cache (``StructuredOutputManager``; thread-safe): the
        server compiles a request's constraint in it before queueing."""
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

    async def blocks_snapshot(self) -> dict:
        """The /debug/blocks document (vlite.entrypoints.debug), taken between two steps."""
        from vlite.entrypoints.debug import blocks_snapshot

        return await self.run_on_engine(lambda engine: blocks_snapshot(engine, self))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin_shutdown(self) -> None:
        """Stop accepting requests and abort every request in flight (thread- and signal-safe)."""
        self._accepting = False
        self._commands.put(("abort_all", None))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort all requests, stop the engine thread and wait for it (up to ``timeout`` s)."""
        self._accepting = False
        if self._thread is None:
            return
        self._commands.put(("stop", None))
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.error("engine loop did not stop within %.0f s", timeout)
        stop_ranks = getattr(self.engine, "shutdown", None)
        if stop_ranks is not None:
            stop_ranks()  # the tensor-parallel ranks, if any

    # ---- requests (event loop side) ---------------------------------------------------------
    async def add_requests(self, requests: list[EngineRequest]) -> RequestStreamGroup:
        """Add requests atomically; returns their group once the engine has queued them all.

        Raises:
            RequestRejectedError: the engine rejected one of them (nothing stays queued).
            EngineNotRunningError: the engine is shutting down or not started.
        """
        if not self._accepting or not self.is_running:
            raise EngineNotRunningError("the engine is not accepting requests (shutting down)")
        group = RequestStreamGroup(self, [r.request_id for r in requests])
        done = self._loop.create_future()
        self._commands.put(("add", (group, requests, done)))
        try:
            await done
        except asyncio.CancelledError:
            # The add may still be applied after us; the abort queued behind it undoes it.
            group.abort()
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Queue an abort of ``request_ids``; it is applied before the next step (thread-safe)."""
        self._commands.put(("abort", list(request_ids)))

    async def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result.

        For read-only views (debug endpoints); ``fn`` must not change the engine's state.
        Raises whatever ``fn`` raises, or EngineNotRunningError.
        """
        if not self.is_running:
            raise EngineNotRunningError("the engine loop is not running")
        done = self._loop.create_future()
        self._commands.put(("call", (fn, done)))
        return await done

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine loop started")
        stopping = False
        while not stopping:
            try:
                stopping = self._apply_commands(block=not self.engine.has_unfinished_requests())
                self._publish()
                if not stopping and self.engine.has_unfinished_requests():
                    self._step()
                    self._publish()
                    stopping = self._engine_died()
                self._maybe_log_stats()
            except Exception:  # never let the loop die: log it and go on
                logger.exception("engine loop iteration failed")
                self._publish()
        self._refuse_pending()
        self._publish()
        logger.info("engine loop stopped")

    def _engine_died(self) -> bool:
        """True (after telling ``on_fatal``) when the engine can run nothing more."""
        reason = getattr(self.engine, "dead_error", None)
        if reason is None:
            return False
        logger.error("the engine died: %s", reason)
        self._abort_all()
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:
                logger.exception("on_fatal callback failed")
        return True

    def _refuse_pending(self) -> None:
        """Answer commands that raced with "stop", so that no caller waits forever."""
        refused = EngineNotRunningError("the engine loop has stopped")
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._post(_set_future, arg[2], None, refused)
            elif kind == "call":
                self._post(_set_future, arg[1], None, refused)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; wait for one first when idle. Returns True on "stop"."""
        commands = []
        if block:
            timeout = self.log_stats_interval if self.log_stats else 1.0
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return False
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        return apply_commands(self, commands)

    def _add(self, group: RequestStreamGroup, requests: list[EngineRequest], done: asyncio.Future) -> None:
        self._post(_set_future, done, None, add_all(self, requests, lambda r: _Live(group, r)))

    def _abort(self, request_id: str, deliver: bool = True) -> None:
        live = self._live.get(request_id)
        final = abort_live(self.engine, self._live, request_id)
        if final is None:
            return
        self._notify(final)
        if deliver:
            self._post(live.group._deliver, request_id, final)

    def _abort_all(self) -> None:
        abort_all(self)

    def _call(self, fn: Callable[[LLMEngine], Any], done: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
            self._post(_set_future, done, None, exc)
        else:
            self._post(_set_future, done, result, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # step() already turns model errors into per-request "error" outputs; anything that
            # escapes it leaves the batch in an unknown state, so end every request in flight.
            logger.exception("engine step failed; aborting the requests in flight")
            for rid, live in list(self._live.items()):
                self._abort(rid, deliver=False)
                self._post(live.group._deliver, rid, RuntimeError(f"engine step failed: {exc}"))
            return
        for out in outputs:
            live = self._live.get(out.request_id)
            self._notify(out)
            if live is None:
                continue
            live.last = out
            if out.finished:
                del self._live[out.request_id]
            self._post(live.group._deliver, out.request_id, out)

    def _notify(self, out: RequestOutput) -> None:
        notify_output(self.on_output, out)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` for the event loop; sent by ``_publish``."""
        self._outbox.append((fn, args))

    def _publish(self) -> None:
        """Refresh ``latest_stats``, then hand the queued deliveries to the event loop in one call,
        so a client that sees its request end also sees the blocks it freed."""
        self.latest_stats = self.engine.stats()
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(_run_all, outbox)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _maybe_log_stats(self) -> None:
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(lambda: self.latest_stats)


def _run_all(calls: list[tuple[Callable[..., None], tuple]]) -> None:
    for fn, args in calls:
        fn(*args)


def _set_future(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the waiter was cancelled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def aborted_output(r: EngineRequest, last: RequestOutput | None) -> RequestOutput:
    """The final output of an aborted request ``r``: its last output ``last``, marked finished.

    It has one CompletionOutput per choice (``sampling_params.n``): a choice that had already
    finished keeps its finish_reason, every other one gets "abort" (a choice not seen yet, or a
    beam search that had not finished, gets an empty one), so a stream can end every choice.
    """
    now = time.time()
    abort = FinishReason.ABORT.value
    n = r.sampling_params.n
    if last is not None:
        by_index = {c.index: dataclasses.replace(c, finish_reason=c.finish_reason or abort) for c in last.outputs}
        completions = [by_index.get(i) or CompletionOutput(i, "", [], finish_reason=abort) for i in range(n)]
        metrics = dataclasses.replace(last.metrics, finished_time=now)
        return dataclasses.replace(last, outputs=completions, finished=True, metrics=metrics,
                                   stream_holdback=0, new_token_ids=[])
    return RequestOutput(r.request_id, r.prompt, list(r.prompt_token_ids or []),
                         [CompletionOutput(i, "", [], finish_reason=abort) for i in range(n)], True,
                         r.origin, RequestMetrics(r.origin.arrival_time, finished_time=now))
