"""MPAsyncLLMEngine: AsyncLLMEngine's interface, with the engine core in its own process.

vLLM V1's split (``AsyncLLM`` in the API process, ``EngineCoreProc`` behind ZeroMQ): here the
core is ``vlite.engine.engine_core`` in a spawned process, and this client lives in the API
process. Two helper threads move the pickled messages (``vlite.engine.engine_core`` describes
them): a sender drains a queue into the input pipe (so the event loop never blocks on a full
pipe while the core is inside a step) and a receiver turns each event batch into one
``loop.call_soon_threadsafe`` call that delivers outputs to the request streams (the same
``RequestStreamGroup`` objects the in-process engine uses), resolves adds and queries, and
calls ``on_output`` (metrics) for every output.

If the core process dies, every request in flight gets a RuntimeError, new requests get
EngineNotRunningError, and ``on_death(message)`` is called (``vlite serve`` exits non-zero).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from typing import Any, Self

from vlite.engine.async_engine import (
    EngineNotRunningError,
    EngineRequest,
    RequestStreamGroup,
    _run_all,
    _set_future,
    notify_output,
)
from vlite.engine.config import EngineConfig
from vlite.engine.engine_core import run_engine_core
from vlite.engine.metrics import EngineStats
from vlite.engine.outputs import RequestOutput
from vlite.engine.structured_output import StructuredOutputManager

logger = logging.getLogger("vlite.core_client")

STOP_TIMEOUT_S = 30.0


class EngineCoreStartError(RuntimeError):
    """The engine core process failed to load the model (the message says why) or died while loading."""


class MPAsyncLLMEngine:
    """Serves an engine core process to asyncio code, with AsyncLLMEngine's methods.

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
        self.config = config
        self.on_output = on_output
        self.on_death = on_death
        self._compiler: StructuredOutputManager | None = None  # built on first use
        self.log_stats = log_stats
        self.log_stats_interval = log_stats_interval
        self.latest_stats: EngineStats | None = None
        self.info: dict[str, Any] = {}
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._in = self._out = None
        self._sendq: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._groups: dict[str, RequestStreamGroup] = {}  # request id -> its stream group
        self._pending: dict[int, asyncio.Future] = {}  # add and query ids -> their futures
        self._adding: dict[int, RequestStreamGroup] = {}  # add id -> the group it adds
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._accepting = False
        self._stopping = False
        self._dead = False

    # ---- life cycle ---------------------------------------------------------------------------
    def launch(self, timeout: float | None = None) -> None:
        """Spawn the core process and wait for its "ready" (blocking; call it off the event loop).

        Raises:
            EngineCoreStartError: the model failed to load, or the process died before it was ready.
        """
        ctx = multiprocessing.get_context("spawn")
        in_recv, in_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        # Not daemonic: the core may start processes of its own (tensor-parallel workers). It exits
        # when its input pipe closes; the atexit hook (run before multiprocessing's own, which joins
        # children) makes sure of it on an exit that skipped shutdown(), e.g. a forced second Ctrl-C.
        self._proc = ctx.Process(target=run_engine_core, name="vlite-engine-core", daemon=False,
                                 args=(self.config, in_recv, out_send, logging.getLogger().getEffectiveLevel(),
                                       self.log_stats, self.log_stats_interval))
        self._proc.start()
        atexit.register(self._atexit)
        in_recv.close()  # the child's ends: closed here, so either side sees EOF when the other exits
        out_send.close()
        self._in, self._out = in_send, out_recv
        if not self._out.poll(timeout):
            self._kill()
            raise EngineCoreStartError(f"the engine core did not load the model within {timeout} s")
        try:
            kind, payload = self._out.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise EngineCoreStartError(f"the engine core process died while loading the model "
                                       f"(exit code {self._proc.exitcode})") from None
        if kind == "failed":
            self._proc.join(5)
            raise EngineCoreStartError(payload)
        self.info = payload
        self.latest_stats = payload["stats"]
        logger.info("engine core process %d ready", payload["pid"])

    def start(self) -> None:
        """Start the sender and receiver threads; call it from the running event loop after ``launch()``."""
        if self._loop is not None:
            raise RuntimeError("MPAsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._threads = [threading.Thread(target=self._send_loop, name="vlite-core-send", daemon=True),
                         threading.Thread(target=self._recv_loop, name="vlite-core-recv", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int | None:
        """The core process's id (None before ``launch()``)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and not self._dead and self._loop is not None

    def begin_shutdown(self) -> None:
        """Stop accepting requests and abort every request in flight (signal-safe: only queues)."""
        self._accepting = False
        self._sendq.put(("abort_all", None))

    async def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Abort all requests, stop the core process and wait for it (killed after ``timeout`` s)."""
        self._accepting = False
        self._stopping = True
        if self._proc is None:
            return
        if self._loop is None:  # launched but never started (shutdown began while loading)
            await asyncio.to_thread(self._kill)
            return
        self._sendq.put(("stop", None))
        self._sendq.put(None)
        await asyncio.to_thread(self._proc.join, timeout)
        if self._proc.is_alive():
            logger.error("engine core did not stop within %.0f s; killing it", timeout)
            self._kill()
        for t in self._threads:
            await asyncio.to_thread(t.join, 5)

    def _atexit(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._kill()

    def _kill(self) -> None:
        self._proc.terminate()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

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

    # ---- requests (event loop side) ---------------------------------------------------------
    async def add_requests(self, requests: list[EngineRequest]) -> RequestStreamGroup:
        """Add requests atomically; returns their group once the core has queued them all.

        Raises:
            RequestRejectedError: the engine rejected one of them (nothing stays queued).
            EngineNotRunningError: the engine is shutting down, stopped or dead.
        """
        if not self._accepting or not self.is_running:
            raise EngineNotRunningError("the engine is not accepting requests (shutting down)")
        group = RequestStreamGroup(self, [r.request_id for r in requests])
        add_id = next(self._ids)
        done = self._loop.create_future()
        self._adding[add_id] = group  # routed by the receiver once the core has added them
        self._pending[add_id] = done
        self._sendq.put(("add", (add_id, requests)))
        try:
            await done
        except asyncio.CancelledError:
            group.abort()  # the add may still be applied; the abort queued behind it undoes it
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Queue an abort of ``request_ids`` (thread-safe, never blocks); their streams get nothing more."""
        for rid in request_ids:
            self._groups.pop(rid, None)
        self._sendq.put(("abort", list(request_ids)))

    async def query(self, name: str) -> Any:
        """Run the core's read-only query ``name`` (``engine_core.QUERIES``) between two steps.

        Raises whatever the query raised, or EngineNotRunningError.
        """
        if not self.is_running:
            raise EngineNotRunningError("the engine core is not running")
        call_id = next(self._ids)
        done = self._loop.create_future()
        self._pending[call_id] = done
        self._sendq.put(("call", (call_id, name)))
        return await done

    async def blocks_snapshot(self) -> dict:
        """The /debug/blocks document, taken in the core between two steps, plus this client's registry."""
        doc = await self.query("blocks_snapshot")
        doc["view"]["registries"]["core_client.streams"] = len(self._groups)
        return doc

    # ---- threads ------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            cmd = self._sendq.get()
            if cmd is None:
                return
            try:
                self._in.send(cmd)
            except (OSError, ValueError):  # the core is gone; the receiver reports it
                return

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._out.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "events":
                self._handle_events(msg[1], msg[2])
        self._proc.join(5)  # its output pipe closed: the process is exiting
        self._post_all([(self._core_exited, ())])

    def _handle_events(self, events: list[tuple], stats: EngineStats) -> None:
        self.latest_stats = stats
        calls: list[tuple[Callable[..., None], tuple]] = []
        for ev in events:
            kind = ev[0]
            if kind == "out":
                out, deliver = ev[1], ev[2]
                self._notify(out)
                group = self._groups.get(out.request_id) if deliver else None
                if group is not None:
                    if out.finished:
                        self._groups.pop(out.request_id, None)
                    calls.append((group._deliver, (out.request_id, out)))
            elif kind == "error":
                group = self._groups.pop(ev[1], None)
                if group is not None:
                    calls.append((group._deliver, (ev[1], RuntimeError(ev[2]))))
            elif kind in ("added", "result"):
                group = self._adding.pop(ev[1], None)
                if group is not None and ev[2] is None:  # added: route its outputs (they follow this event)
                    for rid in group.request_ids:
                        self._groups[rid] = group
                fut = self._pending.pop(ev[1], None)
                if fut is not None:
                    value, exc = (None, ev[2]) if kind == "added" else (ev[2], ev[3])
                    calls.append((_set_future, (fut, value, exc)))
        self._post_all(calls)

    def _post_all(self, calls: list[tuple[Callable[..., None], tuple]]) -> None:
        if not calls:
            return
        try:
            self._loop.call_soon_threadsafe(_run_all, calls)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _notify(self, out: RequestOutput) -> None:
        notify_output(self.on_output, out)

    def _core_exited(self) -> None:
        """On the event loop, once the output pipe closed: a stop, or the core process's death."""
        self._accepting = False
        self._sendq.put(None)
        died = not self._stopping
        self._dead = True
        message = f"the engine core process exited unexpectedly (exit code {self._proc.exitcode})"
        if died:
            logger.error("%s; failing %d request(s) in flight", message, len(self._groups))
        for rid, group in list(self._groups.items()):
            group._deliver(rid, RuntimeError(message) if died else EngineNotRunningError("the engine has stopped"))
        self._groups.clear()
        for fut in list(self._pending.values()):
            _set_future(fut, None, EngineNotRunningError(message if died else "the engine has stopped"))
        self._pending.clear()
        self._adding.clear()
        if died and self.on_death is not None:
            self.on_death(message)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()
