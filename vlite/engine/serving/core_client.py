"""The two ways to reach an engine loop: ``InprocClient`` (a thread here) and ``MPClient`` (an
engine core process), after vLLM V1's ``core_client.py``.

Both carry the commands of ``vlite.engine.serving.protocol`` to one ``EngineLoop`` and hand its
event batches, with the stats taken after them, to ``on_events(events, stats)``; when the loop
has ended they call ``on_exit(reason)`` once (``reason``: why the engine died, or None). The
async client above them (``async_engine``) is the same for both.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from vlite.engine.census import API_SERVER_MODULES
from vlite.engine.config import EngineConfig
from vlite.engine.metrics import EngineStats
from vlite.engine.serving.engine_core import run_engine_core
from vlite.engine.serving.engine_loop import EngineLoop
from vlite.engine.serving.protocol import Command, EngineCoreStartError, Event

OnEvents = Callable[[list[Event], EngineStats], None]
OnExit = Callable[[str | None], None]

logger = logging.getLogger("vlite.core_client")
loop_logger = logging.getLogger("vlite.async_engine")


class InprocClient:
    """The engine loop in one background thread of this process; commands go through a queue.

    Args:
        engine: a loaded LLMEngine; after ``start()`` only the engine thread touches it.
        log_stats, log_stats_interval: the ``--log-stats`` line every ``log_stats_interval`` s.
    """

    def __init__(self, engine, *, log_stats: bool = False, log_stats_interval: float = 10.0) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._on_events: OnEvents | None = None
        # one process: the API server's census walks the serving and server modules (census.py)
        self.loop = EngineLoop(engine, self, log_stats=log_stats, log_stats_interval=log_stats_interval,
                               census_exclude_modules=API_SERVER_MODULES)
        self._thread: threading.Thread | None = None

    # ---- the loop's transport (engine thread) -------------------------------------------------
    def receive(self, timeout: float) -> list[Command]:
        """Every queued command, waiting up to ``timeout`` s for the first."""
        commands = []
        if timeout > 0:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def send(self, events: list[Event], stats: Callable[[], EngineStats]) -> None:
        """Hand the batch to the client on the engine thread (stats refreshed every iteration)."""
        self._on_events(events, stats())

    # ---- the client's side --------------------------------------------------------------------
    def start(self, on_events: OnEvents, on_exit: OnExit) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._on_events = on_events

        def run() -> None:
            loop_logger.info("engine loop started")
            self.loop.run()
            loop_logger.info("engine loop stopped")
            on_exit(getattr(self.engine, "dead_error", None))

        self._thread = threading.Thread(target=run, name="vlite-engine-loop", daemon=True)
        self._thread.start()

    def put(self, command: Command) -> None:
        """Queue one command (thread-safe, never blocks)."""
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pid(self) -> int | None:
        """This process's id (the engine steps in one of its threads)."""
        return os.getpid()

    def stop(self, timeout: float) -> None:
        """Send "stop", wait for the thread (up to ``timeout`` s), then stop the tensor-parallel ranks."""
        if self._thread is None:
            return
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            loop_logger.error("engine loop did not stop within %.0f s", timeout)
        stop_ranks = getattr(self.engine, "shutdown", None)
        if stop_ranks is not None:
            stop_ranks()  # the tensor-parallel ranks, if any

    def close(self) -> None:
        """Nothing to release before ``start()``."""

    def exit_message(self) -> str:
        return "the engine loop stopped"


class MPClient:
    """The engine loop in an engine core process (``engine_core.EngineCoreProc``).

    Two helper threads move the pickled messages: a sender drains a queue into the input pipe
    (so the event loop never blocks on a full pipe while the core is inside a step) and a
    receiver hands each event batch to ``on_events``.

    Args:
        config: the engine configuration; the core process builds ``LLMEngine(config)``.
        log_stats, log_stats_interval: the core logs the ``--log-stats`` line.
    """

    def __init__(self, config: EngineConfig, *, log_stats: bool = False, log_stats_interval: float = 10.0) -> None:
        self.config = config
        self.log_stats = log_stats
        self.log_stats_interval = log_stats_interval
        self.info: dict[str, Any] = {}
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._in = self._out = None
        self._sendq: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._join_lock = threading.Lock()
        self._launch_cancelled = False

    def cancel_launch(self) -> None:
        """Stop a ``launch()`` under way from another thread (the server stopped while the model
        loaded): the core process is killed, and ``launch()`` raises EngineCoreStartError."""
        self._launch_cancelled = True
        if self._proc is not None and self._proc.is_alive():
            self._kill()

    def launch(self, timeout: float | None = None) -> dict[str, Any]:
        """Spawn the core process and wait for its "ready" (blocking); returns its info.

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
        if self._launch_cancelled:  # cancelled while the process started
            self._kill()
            raise EngineCoreStartError("the model load was stopped")
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
        logger.info("engine core process %d ready", payload["pid"])
        return payload

    def start(self, on_events: OnEvents, on_exit: OnExit) -> None:
        """Start the sender and receiver threads (after ``launch()``)."""

        def recv_loop() -> None:
            while True:
                try:
                    msg = self._out.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "events":
                    on_events(msg[1], msg[2])
            self._join(5)  # its output pipe closed: the process is exiting
            self._sendq.put(None)
            on_exit(None)

        self._threads = [threading.Thread(target=self._send_loop, name="vlite-core-send", daemon=True),
                         threading.Thread(target=recv_loop, name="vlite-core-recv", daemon=True)]
        for t in self._threads:
            t.start()

    def _send_loop(self) -> None:
        while True:
            cmd = self._sendq.get()
            if cmd is None:
                return
            try:
                self._in.send(cmd)
            except (OSError, ValueError):  # the core is gone; the receiver reports it
                return

    def put(self, command: Command) -> None:
        """Queue one command for the sender thread (thread-safe, never blocks)."""
        self._sendq.put(command)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        """The core process's id (None before ``launch()``)."""
        return self._proc.pid if self._proc is not None else None

    def stop(self, timeout: float) -> None:
        """Send "stop" and wait for the process (killed after ``timeout`` s) and the threads."""
        if self._proc is None:
            return
        self._sendq.put(("stop", None))
        self._sendq.put(None)
        self._join(timeout)
        if self._proc.is_alive():
            logger.error("engine core did not stop within %.0f s; killing it", timeout)
            self._kill()
        for t in self._threads:
            t.join(5)

    def close(self) -> None:
        """Kill a launched core that was never started (shutdown began while loading)."""
        if self._proc is not None:
            self._kill()

    def exit_message(self) -> str:
        return f"the engine core process exited unexpectedly (exit code {self._proc.exitcode})"

    def _join(self, timeout: float) -> None:
        """Wait for the process, one thread at a time: two threads waiting at once (the receiver
        seeing the pipe close, ``stop()``) race to reap it, and the loser's ``is_alive()`` then
        reads True for a process that is gone (a false "did not stop" and a kill)."""
        deadline = time.monotonic() + timeout
        if self._join_lock.acquire(timeout=timeout):
            try:
                self._proc.join(max(0.0, deadline - time.monotonic()))
            finally:
                self._join_lock.release()

    def _atexit(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._kill()

    def _kill(self) -> None:
        self._proc.terminate()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
