"""EngineCoreProc: the engine loop in a process of its own (vLLM V1's engine core).

``vlite serve --frontend-multiprocessing`` (the default) spawns this process (``multiprocessing``
"spawn" context) so that the model's steps never share a GIL with uvicorn, JSON encoding,
tokenization and the SSE streams of the API process. The API side is
``core_client.MPClient`` under ``async_engine.MPAsyncLLMEngine``. The two talk over two one-way
``multiprocessing`` pipes carrying pickled tuples: the commands and events of
``vlite.engine.serving.protocol``, plus, first of all, ("ready", info) once the model is loaded
(info: tokenizer, hf_config, model_name, model_root, max_model_len, block_size, eos_token_ids,
stats, pid) or ("failed", message) if it did not load. After that each loop iteration that
produced something sends one ("events", [event, ...], EngineStats) message.

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
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import MappingProxyType

from vlite.engine.config import EngineConfig
from vlite.engine.metrics import EngineStats
from vlite.engine.serving.engine_loop import EngineLoop, TransportClosed
from vlite.engine.serving.protocol import Command, Event

logger = logging.getLogger("vlite.async_engine")  # the --log-stats line keeps its logger name


def _mappingproxy(d: dict) -> MappingProxyType:
    return MappingProxyType(d)


# EngineStats.coverage holds read-only mappings; they cross the pipe as copies.
copyreg.pickle(MappingProxyType, lambda m: (_mappingproxy, (dict(m),)))


def portable_exception(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _portable(event: Event) -> Event:
    """``event`` with its exception (if any) made picklable."""
    if event[0] == "added" and event[2] is not None:
        return ("added", event[1], portable_exception(event[2]))
    if event[0] == "result" and event[3] is not None:
        return ("result", event[1], event[2], portable_exception(event[3]))
    return event


class EngineCoreProc:
    """The engine loop's pipe transport, in the engine core process.

    Args:
        inputs / outputs: the pipe ends (receive commands / send messages).
    """

    def __init__(self, inputs: Connection, outputs: Connection) -> None:
        self.inputs = inputs
        self.outputs = outputs

    def receive(self, timeout: float) -> list[Command]:
        """Every command in the input pipe, waiting up to ``timeout`` s for the first."""
        try:
            commands = []
            if self.inputs.poll(timeout):
                commands.append(self.inputs.recv())
                while self.inputs.poll(0):
                    commands.append(self.inputs.recv())
            return commands
        except (EOFError, OSError) as exc:  # the API process is gone: nobody to serve
            raise TransportClosed from exc

    def send(self, events: list[Event], stats: Callable[[], EngineStats]) -> None:
        """One ("events", events, stats) message, when there are events."""
        if not events:
            return
        try:
            self.outputs.send(("events", [_portable(ev) for ev in events], stats()))
        except (EOFError, OSError) as exc:
            raise TransportClosed from exc

    def serve(self, engine, *, log_stats: bool, log_stats_interval: float) -> None:
        """Run the engine loop until "stop", the input pipe closes, or the engine dies."""
        logger.info("engine loop started (engine core process %d)", os.getpid())
        EngineLoop(engine, self, log_stats=log_stats, log_stats_interval=log_stats_interval).run()
        logger.info("engine loop stopped (engine core process)")


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
    EngineCoreProc(inputs, outputs).serve(engine, log_stats=log_stats, log_stats_interval=log_stats_interval)
    if engine.dead_error is not None:
        engine.shutdown()  # stop the ranks still alive
        sys.exit(1)
