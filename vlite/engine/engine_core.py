"""EngineCoreProc: the LLMEngine step loop in a process of its own (vLLM V1's engine core).

``vlite serve --frontend-multiprocessing`` spawns this process (``multiprocessing`` "spawn" context) so that the model's
steps never share a GIL with uvicorn, JSON encoding, tokenization and the SSE streams of the
API process. The API side is ``vlite.engine.core_client.MPAsyncLLMEngine``. The two talk over
two one-way ``multiprocessing`` pipes carrying pickled tuples:

API -> core (``inputs``), applied between two steps, in order:
    ("add", (add_id, [EngineRequest, ...]))   added atomically; answered by an "added" event
    ("abort", [request_id, ...])              answered by each request's final "abort" output
    ("abort_all", None)                       graceful shutdown: abort everything in flight
    ("call", (call_id, name))                 a read-only query by name (``QUERIES``); "result" event
    ("stop", None)                            abort everything, answer what is queued, exit 0

core -> API (``outputs``): ("ready", info) once the model is loaded (info: tokenizer, hf_config,
model_name, model_root, max_model_len, block_size, stats) or ("failed", message) if it did not
load; then one ("events", [event, ...], EngineStats) message per loop iteration that produced
something, stats taken after the events, so a client that sees a request end also sees the
blocks it freed. Events:
    ("out", RequestOutput, deliver)   deliver False: for metrics only (the stream got an error instead)
    ("error", request_id, message)    the step failed; the request is gone
    ("added", add_id, exception | None)
    ("result", call_id, value, exception | None)

Detokenization, stop strings and RequestOutput assembly stay in this process, inside
``LLMEngine.step`` (the W1 profile puts them at 0.8% of a step; docs/architecture.md): a stop
string ends a request where it is detected, with no extra round trip.

The process ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the API
process decides when the core stops) and exits when its input pipe closes, so it never
outlives the API process.
"""

from __future__ import annotations

import copyreg
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import Any

from vlite.engine.async_engine import abort_all, abort_live, add_all, apply_commands
from vlite.engine.config import EngineConfig
from vlite.engine.metrics import StatsLogger
from vlite.engine.outputs import RequestOutput

logger = logging.getLogger("vlite.async_engine")  # the --log-stats line keeps its logger name

def _mappingproxy(d: dict) -> MappingProxyType:
    return MappingProxyType(d)


# EngineStats.coverage holds read-only mappings; they cross the pipe as copies.
copyreg.pickle(MappingProxyType, lambda m: (_mappingproxy, (dict(m),)))

IDLE_POLL_S = 1.0


def _blocks(engine, core) -> dict:
    from vlite.entrypoints.debug import blocks_snapshot

    return blocks_snapshot(engine, core)


def _stats(engine, core):
    return engine.stats()


def _live_request_ids(engine, core) -> list[str]:
    return engine.live_state()["live_request_ids"]


# Read-only queries the API process may ask by name: fn(engine, core) -> a picklable value.
QUERIES = {"blocks_snapshot": _blocks, "stats": _stats, "live_request_ids": _live_request_ids}


def portable_exception(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@dataclass
class _CoreLiveRequest:
    """A request the core has added: its EngineRequest and the last output sent for it."""

    request: Any  # EngineRequest
    last: RequestOutput | None = None


class EngineCore:
    """The loop: apply the queued commands, step while requests are unfinished, send events.

    Args:
        engine: the LLMEngine (built in this process).
        inputs / outputs: the pipe ends (receive commands / send messages).
        log_stats, log_stats_interval: the ``--log-stats`` line every ``log_stats_interval`` s.
    """

    def __init__(self, engine, inputs: Connection, outputs: Connection, *, log_stats: bool = False,
                 log_stats_interval: float = 10.0) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.log_stats = log_stats
        self.log_stats_interval = log_stats_interval
        self._live: dict[str, _CoreLiveRequest] = {}  # EngineView reads its size ("async.live")
        self._events: list[tuple] = []
        self._stats_logger = StatsLogger(logger, log_stats_interval) if log_stats else None

    def run(self) -> None:
        """Serve until "stop" (or until the API process closes the input pipe)."""
        logger.info("engine loop started (engine core process %d)", os.getpid())
        stopping = False
        while not stopping:
            try:
                stopping = self._apply_commands(block=not self.engine.has_unfinished_requests())
                if not stopping and self.engine.has_unfinished_requests():
                    self._publish()  # adds, aborts and their stats go out before the step's wait
                    self._step()
                    if self.engine.dead_error is not None:  # a tensor-parallel rank failed
                        logger.error("the engine died: %s", self.engine.dead_error)
                        self._abort_all()
                        self._publish()
                        return  # the process exits; the API process sees its pipe close
                self._publish()
                self._maybe_log_stats()
            except (EOFError, OSError):  # the API process is gone: nobody to serve
                logger.info("engine core: input pipe closed, exiting")
                return
            except Exception:  # never let the loop die: log it and go on
                logger.exception("engine core loop iteration failed")
                self._publish()
        self._refuse_pending()
        self._publish()
        logger.info("engine loop stopped (engine core process)")

    # ---- commands -----------------------------------------------------------------------------
    def _apply_commands(self, block: bool) -> bool:
        commands = []
        timeout = (self.log_stats_interval if self.log_stats else IDLE_POLL_S) if block else 0
        if self.inputs.poll(timeout):
            commands.append(self.inputs.recv())
            while self.inputs.poll(0):
                commands.append(self.inputs.recv())
        return apply_commands(self, commands)

    def _refuse_pending(self) -> None:
        from vlite.engine.async_engine import EngineNotRunningError

        refused = EngineNotRunningError("the engine loop has stopped")
        while self.inputs.poll(0):
            kind, arg = self.inputs.recv()
            if kind == "add":
                self._events.append(("added", arg[0], refused))
            elif kind == "call":
                self._events.append(("result", arg[0], None, refused))

    def _add(self, add_id: int, requests: list) -> None:
        exc = add_all(self, requests, _CoreLiveRequest)
        self._events.append(("added", add_id, None if exc is None else portable_exception(exc)))

    def _abort(self, request_id: str, deliver: bool = True) -> None:
        final = abort_live(self.engine, self._live, request_id)
        if final is not None:
            self._events.append(("out", final, deliver))

    def _abort_all(self) -> None:
        abort_all(self)

    def _call(self, call_id: int, name: str) -> None:
        try:
            value = QUERIES[name](self.engine, self)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
            self._events.append(("result", call_id, None, portable_exception(exc)))
        else:
            self._events.append(("result", call_id, value, None))

    # ---- steps --------------------------------------------------------------------------------
    def _step(self) -> None:
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
            self._events.append(("out", out, live is not None))

    def _publish(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        self.outputs.send(("events", events, self.engine.stats()))

    def _maybe_log_stats(self) -> None:
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.engine.stats)


def run_engine_core(config: EngineConfig, inputs: Connection, outputs: Connection, log_level: int,
                    log_stats: bool, log_stats_interval: float) -> None:
    """The spawned process's entry point: load the model, say "ready" (or "failed"), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        from vlite.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits with it
        outputs.send(("failed", f"{type(exc).__name__}: {exc}"))
        logger.debug("%s", traceback.format_exc())
        return
    outputs.send(("ready", {"tokenizer": engine.tokenizer, "hf_config": engine.hf_config,
                            "model_name": engine.model_name, "model_root": str(engine.config.model),
                            "max_model_len": engine.max_model_len, "block_size": engine.block_size,
                            "eos_token_ids": list(engine.eos_token_ids), "stats": engine.stats(), "pid": os.getpid()}))
    EngineCore(engine, inputs, outputs, log_stats=log_stats, log_stats_interval=log_stats_interval).run()
    if engine.dead_error is not None:
        engine.shutdown()  # stop the ranks still alive
        sys.exit(1)
