"""Executors: where the model runs (vLLM's ``Executor`` classes).

* ``UniProcExecutor``: the model in the engine's own process (tensor_parallel_size 1, the default).
* ``MultiprocExecutor``: one spawned worker process per tensor-parallel rank on this host.
* ``RayExecutor``: one Ray actor per rank, across the hosts of a Ray cluster
  (``pip install 'vlite[ray]'``).

The scheduler and the block manager stay in the engine process. Each step the engine packs the
scheduler's output (tokens, positions, slot mapping, block tables, copy-on-write pairs) into one
``StepInput``, serializes it once and sends it to every rank (``collective_rpc``); the ranks run
the forward in lockstep (their all-reduces pair up), rank 0 gathers the logits and returns them,
and the engine samples. A rank that dies or raises ends the executor: every rank is stopped and
``WorkerFailedError`` names the rank; the engine then ends its requests with that error.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import time
import weakref
from abc import ABC, abstractmethod
from multiprocessing import connection
from typing import Any

import numpy as np
import torch

from vlite.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, EngineConfig
from vlite.engine.core.faults import FaultSet
from vlite.engine.core.sched_output import SchedulerOutput, StepResult
from vlite.engine.worker.loader import LoadedCheckpoint
from vlite.engine.worker.model_runner import ModelRunner, SequenceError, prepare_input, sample_step
from vlite.engine.worker.worker import WorkerSpec

logger = logging.getLogger("vlite.executor")

# seconds: a rank's start-up (process group, shard load), and one call (a step) before it counts as hung
START_TIMEOUT_S = float(os.environ.get("VLITE_WORKER_START_TIMEOUT", "600"))
CALL_TIMEOUT_S = float(os.environ.get("VLITE_WORKER_CALL_TIMEOUT", "600"))


class ExecutorError(RuntimeError):
    """The executor cannot run (start-up failed, or a rank failed earlier)."""


class ExecutorStartupError(ExecutorError):
    """A rank could not start: the rendezvous port is in use, its shard cannot load, ... (one line)."""


class WorkerFailedError(ExecutorError):
    """A rank died or raised; the executor has stopped every rank.

    Attributes: rank (int), pid (int | None), detail (what happened, without the rank).
    """

    def __init__(self, rank: int, pid: int | None, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.detail = detail or message


class Executor(ABC):
    """Runs the model for the engine. The engine calls, in order: ``kv_cache_bytes_per_block``,
    ``determine_num_blocks``, ``initialize_kv_cache``, then ``execute`` once per step, and
    ``shutdown`` at the end.

    Attributes:
        generator: the engine-side sampling generator (shared with the scheduler's forks).
        cpu_gemm: the CPU GEMM the linear layers use (None on CUDA).
        tensor_parallel_size: ranks.
        weight_bytes: bytes of model weights each rank holds, rank order.
    """

    generator: torch.Generator
    cpu_gemm: str | None
    tensor_parallel_size: int = 1
    weight_bytes: list[int]

    @abstractmethod
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one physical block takes across all layers' K and V of every rank together."""

    @abstractmethod
    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> int:
        """Blocks of the KV cache (the same number on every rank)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, block_size: int, *, max_num_seqs: int,
                            enforce_eager: bool = False) -> None:
        """Allocate every rank's KV cache (its own KV heads)."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one step on every rank and sample.

        Raises:
            SequenceError: a failure tied to specific sequences (the engine continues).
            WorkerFailedError: a rank died or raised (the executor is dead).
        """

    def worker_pids(self) -> list[int]:
        """PIDs of the worker processes on this host (empty in-process and for remote actors)."""
        return []

    def worker_census(self, ended_request_ids: list[str], seq_names: dict[int, str],
                      live_seq_ids: list[int]) -> list[dict]:
        """Each worker process's request-id census and host-memory readings (``Worker.census``),
        rank order; empty where the model runs in the engine's process (its census covers it).

        Raises:
            WorkerFailedError: a rank died or raised (multi-rank executors).
        """
        return []

    def shutdown(self) -> None:  # noqa: B027 - in-process: nothing to stop
        """Stop every rank (idempotent)."""


class UniProcExecutor(Executor):
    """The model in the engine's process: today's path, a ``ModelRunner`` called directly."""

    def __init__(self, checkpoint: LoadedCheckpoint, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 config: EngineConfig, faults: FaultSet) -> None:
        self.model_runner = ModelRunner(checkpoint, max_model_len, device, dtype, cpu_gemm=config.cpu_gemm,
                                        faults=faults, seed=config.seed)
        self.generator = self.model_runner.generator
        self.cpu_gemm = self.model_runner.cpu_gemm
        self.weight_bytes = [self.model_runner.weight_bytes]

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.model_runner.kv_cache_bytes_per_block(block_size)

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> int:
        return self.model_runner.determine_num_blocks(cache, max_num_batched_tokens)

    def initialize_kv_cache(self, num_blocks: int, block_size: int, *, max_num_seqs: int,
                            enforce_eager: bool = False) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, block_size, max_num_seqs=max_num_seqs,
                                              enforce_eager=enforce_eager)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        return self.model_runner.execute(sched)


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """``$VLITE_DIST_PORT`` if set (checked free), else a free port.

    Raises:
        ExecutorStartupError: the port in ``$VLITE_DIST_PORT`` is not a number or is in use.
    """
    asked = os.environ.get("VLITE_DIST_PORT")
    if not asked:
        return free_loopback_port()
    if not asked.isdigit() or not 0 < int(asked) < 65536:
        raise ExecutorStartupError(f"VLITE_DIST_PORT must be a TCP port number (1-65535), got {asked!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(asked)))
        except OSError as exc:
            raise ExecutorStartupError(
                f"tensor-parallel rendezvous port {host}:{asked} (VLITE_DIST_PORT) is not free: "
                f"{exc.strerror or exc}; pick another port or unset VLITE_DIST_PORT") from exc
    return int(asked)


class DistributedExecutor(Executor):
    """The shared half of the multi-rank executors: the engine-side step (pack, send, sample)
    over a ``collective_rpc`` that subclasses implement."""

    def __init__(self, config: EngineConfig, faults: FaultSet) -> None:
        self.config = config
        self.faults = faults
        self.tensor_parallel_size = config.parallel.tensor_parallel_size
        self.generator = torch.Generator().manual_seed(config.seed)
        self.block_size = 0
        self.infos: list[dict] = []
        self.failure: WorkerFailedError | None = None

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank (arguments serialized once); results in
        rank order.

        Raises:
            WorkerFailedError: a rank died, raised, or did not answer within the call timeout.
        """

    def _started(self, infos: list[dict]) -> None:
        self.infos = infos
        self.cpu_gemm = infos[0]["cpu_gemm"]
        self.weight_bytes = [i["weight_bytes"] for i in infos]
        logger.info("tensor parallel: %d ranks (%s), weights per rank %s MiB", len(infos),
                    type(self).__name__, ", ".join(f"{b / 2**20:.1f}" for b in self.weight_bytes))

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return sum(self.collective_rpc("kv_cache_bytes_per_block", block_size))

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> int:
        """``cache.num_blocks`` if set; on CPU the byte budget (all ranks together: they share
        this host's memory) over the bytes a block takes on all ranks; on CUDA the smallest
        number any rank's profile allows (as vLLM does).

        Raises:
            ValueError: the budget holds no block.
        """
        if cache.num_blocks:
            return cache.num_blocks
        if (self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
            return min(self.collective_rpc("determine_num_blocks", cache, max_num_batched_tokens))
        per_block = self.kv_cache_bytes_per_block(cache.block_size)
        budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        if budget // per_block < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(budget // per_block)

    def initialize_kv_cache(self, num_blocks: int, block_size: int, *, max_num_seqs: int,
                            enforce_eager: bool = False) -> None:
        self.block_size = block_size
        self.collective_rpc("initialize_kv_cache", num_blocks, block_size, max_num_seqs, enforce_eager)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        if self.failure is not None:
            raise self.failure
        try:
            step = prepare_input(sched, sched.block_tables, self.block_size, self.faults)
        except SequenceError:
            if sched.blocks_to_copy:  # copy-on-write happens even when the step fails
                self.collective_rpc("copy_blocks", sched.blocks_to_copy)
            raise
        step.blocks_to_copy = list(sched.blocks_to_copy)
        results = self.collective_rpc("execute_model", step)
        # a writable copy when the transport hands back a read-only buffer (Ray's object store)
        rank0_logits, prompt_logprobs = results[0]
        logits = None if rank0_logits is None else torch.from_numpy(np.require(rank0_logits, requirements="W"))
        return sample_step(sched, logits, prompt_logprobs, self.generator)

    def memory(self) -> list[dict]:
        """Each rank's ``Worker.memory()`` (pid, RSS, CUDA bytes)."""
        return self.collective_rpc("memory")

    def worker_census(self, ended_request_ids: list[str], seq_names: dict[int, str],
                      live_seq_ids: list[int]) -> list[dict]:
        # over the executor's own call channel: every rank walks its own process at once
        return self.collective_rpc("census", list(ended_request_ids), dict(seq_names), list(live_seq_ids))


class MultiprocExecutor(DistributedExecutor):
    """One spawned worker process per rank on this host, each joined to a gloo (CPU) or NCCL
    (CUDA) group through a free loopback port; calls travel over one pipe per rank.

    Raises:
        ExecutorStartupError: a rank failed to start (one line naming the rank and why).
    """

    def __init__(self, config: EngineConfig, faults: FaultSet, spec_args: dict) -> None:
        super().__init__(config, faults)
        import multiprocessing as mp

        from vlite.engine.worker.cpu_threads import available_cpus
        from vlite.engine.worker.worker import worker_main

        n = self.tensor_parallel_size
        port = rendezvous_port()
        ctx = mp.get_context("spawn")
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() \
            else max(1, available_cpus() // n)  # the affinity mask's CPUs, not the host's
        spec = WorkerSpec(**spec_args, tp_size=n, init_method=f"tcp://127.0.0.1:{port}", num_threads=threads)
        self.procs = []
        self.conns = []
        for rank in range(n):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, child_end, os.getpid()),
                               name=f"vlite-tp-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.procs), list(self.conns))
        try:
            infos = self._collect(START_TIMEOUT_S, "start-up")
        except WorkerFailedError as exc:
            raise ExecutorStartupError(f"tensor-parallel rank {exc.rank} failed to start: {exc.detail}") from None
        self._started(infos)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _fail(self, rank: int, detail: str) -> WorkerFailedError:
        pid = self.procs[rank].pid if 0 <= rank < len(self.procs) else None
        exc = WorkerFailedError(rank, pid, f"tensor-parallel rank {rank} (pid {pid}) failed: {detail}", detail)
        self.failure = self.failure or exc
        self.shutdown()
        return exc

    def _died(self, rank: int) -> str:
        code = self.procs[rank].exitcode
        if code is not None and code < 0:
            try:
                return f"exit code {code}, {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exit code {code}"

    def _blame(self, rank: int, detail: str | None, what: str) -> WorkerFailedError:
        """Fail the executor, naming the rank that caused it: a rank whose process died (its
        peers then fail in their collectives too) before one that merely raised. ``detail``:
        the rank's own error message, None when its pipe or process just ended."""
        ended = connection.wait([p.sentinel for p in self.procs], timeout=0.5)  # a death shows up at once
        for p in self.procs:
            if p.sentinel in ended:
                p.join(timeout=2)  # its pipes close before the kernel lets us reap it
        reported = {rank: detail} if detail is not None else {}
        silent = []  # ranks whose process ended without saying why
        for r, p in enumerate(self.procs):
            if p.exitcode is None or r in reported:
                continue
            try:
                reply = self.conns[r].recv() if self.conns[r].poll() else None
            except (EOFError, OSError):
                reply = None
            if reply is not None and reply[0] == "error":
                reported[reply[1]] = reply[2]
            else:
                silent.append(r)
        if silent:
            return self._fail(silent[0], f"process died during {what} ({self._died(silent[0])})")
        first = min(reported) if reported else rank
        return self._fail(first, reported.get(first) or f"process died during {what} ({self._died(first)})")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """Wait for one answer from every rank, watching every process's sentinel."""
        results: list[Any] = [None] * len(self.conns)
        pending = set(range(len(self.conns)))
        deadline = time.monotonic() + timeout
        by_conn = {id(c): r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                rank = min(pending)
                raise self._fail(rank, f"no answer to {what} within {timeout:.0f} s (hung?)")
            ready = connection.wait([self.conns[r] for r in pending] + list(by_sentinel), timeout=left)
            answered = [obj for obj in ready if not isinstance(obj, int)]
            for conn in answered:  # read answers first: a rank that answered then exited is fine
                rank = by_conn[id(conn)]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    raise self._blame(rank, None, what) from None
                if reply[0] == "error":
                    raise self._blame(reply[1], reply[2], what)
                results[rank] = reply[1]
                pending.discard(rank)
            for obj in ready:
                if isinstance(obj, int) and by_sentinel[obj] in pending:
                    rank = by_sentinel[obj]
                    if self.conns[rank].poll():
                        continue  # its answer is waiting: read it on the next pass
                    raise self._blame(rank, None, what)
        return results

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, OSError):
                self.procs[rank].join(timeout=1)
                raise self._fail(rank, f"process died before {method} ({self._died(rank)})") from None
        return self._collect(CALL_TIMEOUT_S, method)

    def shutdown(self) -> None:
        self._finalizer()


def _stop_processes(procs: list, conns: list, grace_s: float = 2.0) -> None:
    """Ask every worker to stop, then terminate and finally kill what is left; join all."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", ())))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=1.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)
    for conn in conns:
        conn.close()


__all__ = ["DistributedExecutor", "Executor", "ExecutorError", "ExecutorStartupError", "MultiprocExecutor",
           "UniProcExecutor", "WorkerFailedError", "free_loopback_port"]
