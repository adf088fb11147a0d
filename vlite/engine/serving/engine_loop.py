"""EngineLoop: the serving step loop, written once (vLLM V1's ``EngineCore`` busy loop).

Nothing else touches the ``LLMEngine`` while it serves: adds, aborts and read-only queries
arrive as commands and are applied between two steps, so an abort lands within one engine
step. The loop runs in one of two places, and only the *transport* differs:

- in a thread of the API process (``core_client.InprocClient``; ``vlite serve
  --disable-frontend-multiprocessing``): commands come through a queue, events go straight to
  the async client, which hands them to the event loop;
- in an engine core process of its own (``engine_core.EngineCoreProc``, the default): commands
  and events cross two pipes, pickled.

The commands and events are listed in ``vlite.engine.serving.protocol``. An exception from one
command (a rejected request, a planted fault in abort) or from one step is logged and handed to
the affected requests; the loop itself keeps running. It stops on "stop", when its transport
closes (the client is gone), or when the engine dies (a tensor-parallel rank failed).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vlite.engine.census import EndedRequests, IdleCensus
from vlite.engine.core.sequence import FinishReason
from vlite.engine.introspection import blocks_document
from vlite.engine.metrics import EngineStats, StatsLogger
from vlite.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vlite.engine.serving.protocol import Command, EngineNotRunningError, EngineRequest, Event

logger = logging.getLogger("vlite.async_engine")  # the --log-stats line keeps its logger name

IDLE_POLL_S = 1.0


class TransportClosed(Exception):
    """The client end of the transport is gone (its pipe closed): nobody is left to serve."""


class LoopTransport(Protocol):
    """How commands reach an ``EngineLoop`` and its events leave it."""

    def receive(self, timeout: float) -> list[Command]:
        """Every queued command, waiting up to ``timeout`` s for the first (0: do not wait).
        Raises TransportClosed when the client is gone."""
        ...

    def send(self, events: list[Event], stats: Callable[[], EngineStats]) -> None:
        """Hand one batch of events (maybe empty) and the engine's stats (``stats()``, taken
        after the events) to the client."""
        ...


def _stats(engine, loop: EngineLoop) -> EngineStats:
    return loop.stats_with_census()


def _census(engine, loop: EngineLoop) -> dict:
    return loop.census_document()


def _live_request_ids(engine, loop: EngineLoop) -> list[str]:
    return engine.live_state()["live_request_ids"]


def _gpu_allocations(engine, loop: EngineLoop) -> dict:
    from vlite.engine.worker import cuda_alloc_sites

    return cuda_alloc_sites.document()


def _gpu_allocations_start(engine, loop: EngineLoop) -> dict:
    from vlite.engine.worker import cuda_alloc_sites

    if not cuda_alloc_sites.is_recording():
        cuda_alloc_sites.start_recording()
    return {**cuda_alloc_sites.document(), "sites": {}}


def _gpu_allocations_stop(engine, loop: EngineLoop) -> dict:
    from vlite.engine.worker import cuda_alloc_sites

    cuda_alloc_sites.stop_recording()
    return {**cuda_alloc_sites.document(), "sites": {}}


# Read-only queries a client may ask by name: fn(engine, loop) -> a picklable value. The
# gpu_allocations_start/stop pair switches the CUDA allocator's history of this process on and
# off (vLLM's /start_profile and /stop_profile do the same for its profiler); the engine's own
# state is read, never changed.
QUERIES: dict[str, Callable[[Any, EngineLoop], Any]] = {
    "blocks_snapshot": blocks_document, "stats": _stats, "live_request_ids": _live_request_ids,
    "census": _census, "gpu_allocations": _gpu_allocations, "gpu_allocations_start": _gpu_allocations_start,
    "gpu_allocations_stop": _gpu_allocations_stop}


@dataclass
class _LiveRequest:
    """A request the loop has added: its EngineRequest and the last output sent for it."""

    request: EngineRequest
    last: RequestOutput | None = None


class EngineLoop:
    """Apply the queued commands, step while requests are unfinished, send the events.

    Args:
        engine: the LLMEngine; while the loop runs only the loop touches it.
        transport: where commands come from and events go (``LoopTransport``).
        log_stats, log_stats_interval: log one stats line (vLLM's shape) every ``log_stats_interval`` s.
        census_exclude_modules: packages whose module-level containers the census leaves to the
            API server's own census (``census.API_SERVER_MODULES`` when the loop runs in a thread
            of the API server: one process, walked once).
    """

    def __init__(self, engine, transport: LoopTransport, *, log_stats: bool = False,
                 log_stats_interval: float = 10.0, census_exclude_modules: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.transport = transport
        self.idle_timeout = log_stats_interval if log_stats else IDLE_POLL_S
        self._live: dict[str, _LiveRequest] = {}
        self._events: list[Event] = []
        self._stats_logger = StatsLogger(logger, log_stats_interval) if log_stats else None
        # the requests that ended here, and the census that looks for them at idle points
        self._ended = EndedRequests()
        self.census = IdleCensus("engine", self._ended)
        self.census_exclude_modules = census_exclude_modules
        self._last_step = self._last_add = time.monotonic()  # the census's quiet and new-work clocks

    @property
    def num_live(self) -> int:
        """Requests in flight (entries; ``async.live`` in ``EngineView.registries``)."""
        return len(self._live)

    def run(self) -> None:
        """Serve until "stop", until the transport closes, or until the engine dies."""
        stopping = False
        while not stopping:
            try:
                idle = not self.engine.has_unfinished_requests()
                stopping = self._apply(self.transport.receive(self._idle_wait() if idle else 0))
                self._publish()  # adds, aborts and their stats go out before the step
                if not stopping and self.engine.has_unfinished_requests():
                    self._step()
                    self._publish()
                    stopping = self._engine_died()
                self._maybe_log_stats()
                self._maybe_census()
            except TransportClosed:
                logger.info("engine loop: its client is gone, exiting")
                return
            except Exception:  # never let the loop die: log it and go on
                logger.exception("engine loop iteration failed")
                self._publish()
        self._refuse_pending()
        self._publish()

    # ---- commands -----------------------------------------------------------------------------
    def _apply(self, commands: list[Command]) -> bool:
        """Apply ``commands`` in order; True when a "stop" came (everything is aborted then)."""
        stop = False
        for kind, arg in commands:
            if kind == "add":
                self._last_add = time.monotonic()
                self._add(*arg)
            elif kind == "abort":
                for rid in arg:
                    self._abort(rid)
            elif kind == "abort_all":
                self._abort_all()
            elif kind == "call":
                self._call(*arg)
            elif kind == "stop":
                stop = True
        if stop:
            self._abort_all()
        return stop

    def _refuse_pending(self) -> None:
        """Answer commands that raced with "stop", so that no caller waits forever."""
        refused = EngineNotRunningError("the engine loop has stopped")
        try:
            commands = self.transport.receive(0)
        except TransportClosed:
            return
        for kind, arg in commands:
            if kind == "add":
                self._events.append(("added", arg[0], refused))
            elif kind == "call":
                self._events.append(("result", arg[0], None, refused))

    def _add(self, add_id: int, requests: list[EngineRequest]) -> None:
        """Add ``requests`` all or none (``LLMEngine.add_requests``: on a refusal the engine
        aborts those it had admitted, with no output); the exception goes back in the "added"
        event, and the census looks for every request of a refused group."""
        exc: Exception | None = None
        try:
            self.engine.add_requests(requests)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
            for r in requests:
                self._ended.record(r.request_id)
            exc = e
        else:
            for r in requests:
                self._live[r.request_id] = _LiveRequest(r)
        self._events.append(("added", add_id, exc))

    def _abort(self, request_id: str, deliver: bool = True) -> None:
        """Free one request through the engine's one abort path and send its final "abort"
        output; nothing if it already finished. A failing abort (the planted fault
        skip-free-on-abort) is logged; the loop keeps serving."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            return  # already finished (or never added): nothing to free
        self._ended.record(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of request %r failed", request_id)
        self._events.append(("out", aborted_output(entry.request, entry.last), deliver))

    def _abort_all(self) -> None:
        if self._live:
            logger.info("aborting %d request(s) in flight", len(self._live))
        for rid in list(self._live):
            self._abort(rid)

    def _call(self, call_id: int, query: str | Callable[[Any], Any]) -> None:
        try:
            value = query(self.engine) if callable(query) else QUERIES[query](self.engine, self)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
            self._events.append(("result", call_id, None, exc))
        else:
            self._events.append(("result", call_id, value, None))

    # ---- steps --------------------------------------------------------------------------------
    def _step(self) -> None:
        self._last_step = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # step() turns model errors into per-request "error" outputs; anything that escapes
            # leaves the batch in an unknown state, so end every request in flight.
            logger.exception("engine step failed; aborting the requests in flight")
            for rid in list(self._live):
                self._abort(rid, deliver=False)
                self._events.append(("error", rid, f"engine step failed: {exc}"))
            return
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is not None:
                live.last = out
                if out.finished:
                    del self._live[out.request_id]
                    self._ended.record(out.request_id)
            self._events.append(("out", out, live is not None))

    def _engine_died(self) -> bool:
        """True (after aborting everything in flight) when the engine can run nothing more."""
        reason = getattr(self.engine, "dead_error", None)
        if reason is None:
            return False
        logger.error("the engine died: %s", reason)
        self._abort_all()
        return True

    def _publish(self) -> None:
        events, self._events = self._events, []
        self.transport.send(events, self.stats_with_census)

    def stats_with_census(self) -> EngineStats:
        """The engine's stats with the last census's counts (``EngineStats.ended_requests_held``)."""
        stats = self.engine.stats()
        held, pending, overdue = self.census.held_counts, self.census.pending, self.census.overdue
        if not isinstance(stats, EngineStats) or not (held or pending):
            return stats  # nothing to add (or a test double's stats): no copy on every publish
        return dataclasses.replace(stats, ended_requests_held=held, census_pending=pending, census_overdue=overdue)

    # ---- the request-id census ----------------------------------------------------------------
    def _idle_wait(self) -> float:
        """How long an idle loop waits for a command: ``idle_timeout``, or less when a census is
        pending, so that it runs once the engine has been quiet long enough (``IdleCensus.wait_s``)."""
        wait = self.census.wait_s(self._last_step)
        return self.idle_timeout if wait is None else min(self.idle_timeout, wait)

    def _census_blockers(self) -> dict[str, int]:
        """What keeps the engine from an idle point: its scheduler's running and waiting
        sequences (by the names the census and ``EngineView.registries`` give them)."""
        if not self.engine.has_unfinished_requests():
            return {}
        s = self.engine.stats()
        busy = {"scheduler.running": getattr(s, "num_running", 0), "scheduler.waiting": getattr(s, "num_waiting", 0)}
        return {k: v for k, v in busy.items() if v} or {"scheduler.unfinished": 1}

    def _maybe_census(self) -> None:
        """At the engine's own idle point (no running or waiting sequence and no step for
        ``CENSUS_QUIET_S``, whatever this loop's live map holds: a leaked entry there must not
        switch the census off), when the census is due (``IdleCensus.tick``): walk the engine
        and this loop for containers that still hold ended requests
        (``EngineView.request_census``), and publish the counts at once with the stats, in a
        batch of its own (a "census" event: an idle engine core sends no empty batch), so
        ``vlite:ended_requests_held`` in /metrics is current within the interval. A census kept
        from its idle point by a scheduler that never empties, while no request is added, is
        published as overdue (``vlite:census_overdue_seconds``). Costs ms; never inside a step."""
        if not self.census.pending and self.census.overdue is None:
            return  # the common case, every step: nothing ended since the last census
        if self.census.tick(self._census_blockers, self._last_step, self._last_add, self._walk):
            self._events.append(("census",))  # the counts go out now, with the stats of this batch
            self._publish()

    def _walk(self, ended: set[str], skip: list[object]):
        from vlite.engine.introspection import EngineView

        return EngineView(self.engine, self).request_census(ended, skip=skip,
                                                            exclude_modules=self.census_exclude_modules)

    def census_document(self) -> dict:
        """The last census for ``/debug/census`` (``IdleCensus.document``, process "engine")."""
        return self.census.document()

    def _maybe_log_stats(self) -> None:
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.engine.stats)


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
