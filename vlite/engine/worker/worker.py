"""One tensor-parallel rank: a process (or Ray actor) that holds its shard of the model and its
own KV cache, and runs every step the engine sends it (vLLM's ``Worker``).

Start-up (``Worker.__init__``): join the ``torch.distributed`` group (gloo on CPU, NCCL on
CUDA, rendezvous at ``WorkerSpec.init_method``), build the model's shard for this rank reading
only its slices of the checkpoint, prepare the attention backend. Afterwards the engine calls
``initialize_kv_cache`` once and ``execute_model`` once per step, on every rank with the same
arguments (``Executor.collective_rpc``); rank 0 returns the gathered logits.

``worker_main`` is the loop of a multiprocessing worker: it reads pickled ``(method, args)``
calls from its pipe and answers ``("ok", result)`` or ``("error", rank, message)``. It exits
when the pipe closes or the parent process disappears (a watchdog thread checks the parent
pid twice a second), so no worker outlives its engine.

Test hook: ``VLITE_TEST_WORKER_FAULT="raise:RANK:N"`` (or ``exit:RANK:N``) makes rank RANK
raise (or exit with status 3) in its N-th ``execute_model`` call (1-based).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

logger = logging.getLogger("vlite.worker")

DEFAULT_DIST_TIMEOUT_S = 300.0


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its shard (picklable; sent once at start-up).

    hf_config: the model's transformers config; model_path: the resolved HF directory
        (``*.safetensors`` read lazily, each rank its own slices).
    max_model_len: tokens; device: "cpu" or "cuda"; dtype: "float32" | "bfloat16" | "float16".
    tp_size: ranks; init_method: torch.distributed rendezvous URL (``tcp://host:port``).
    num_threads: torch intra-op threads of this rank (None: torch's default).
    dist_timeout_s: how long a collective waits for a missing peer before failing, seconds.
    rope: the rotary tables (``vlite.engine.worker.models.llama.rope_tables``), computed once by the engine.
    """

    hf_config: object
    model_path: str
    model_name: str
    max_model_len: int
    device: str
    dtype: str
    cpu_gemm: str | None
    seed: int
    tp_size: int
    init_method: str
    num_threads: int | None = None
    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    rope: tuple | None = None  # (cos, sin) tables from the engine: no transformers modeling import here


def _parse_test_fault() -> tuple[str, int, int] | None:
    spec = os.environ.get("VLITE_TEST_WORKER_FAULT")
    if not spec:
        return None
    kind, rank, call = spec.split(":")
    return kind, int(rank), int(call)


class Worker:
    """Rank ``rank`` of ``spec.tp_size``: joins the process group and loads its shard.

    Raises:
        RuntimeError: the rendezvous failed (e.g. its port is in use) or the shard cannot load.
    """

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        import torch
        import torch.distributed as dist

        from vlite.engine.worker.loader import LoadedCheckpoint
        from vlite.engine.worker.model_runner import ModelRunner
        from vlite.engine.worker.models.parallel_layers import TPGroup

        self.rank = rank
        self.spec = spec
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        if spec.device == "cuda":
            local = rank % max(1, torch.cuda.device_count())
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        try:
            dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.tp_size,
                                    timeout=timedelta(seconds=spec.dist_timeout_s))
        except Exception as exc:  # noqa: BLE001 - reported as one line by the executor
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                first = f"rendezvous port {spec.init_method} is in use (EADDRINUSE)"
            raise RuntimeError(f"torch.distributed {backend} rendezvous at {spec.init_method} failed: {first}") from exc
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype]
        ckpt = LoadedCheckpoint(spec.hf_config, {}, None, spec.model_name, Path(spec.model_path))
        torch.manual_seed(spec.seed)
        try:
            self.runner = ModelRunner(ckpt, spec.max_model_len, device, dtype, cpu_gemm=spec.cpu_gemm, seed=spec.seed,
                                      tp=TPGroup(rank, spec.tp_size), rope=spec.rope)
        except Exception as exc:
            raise RuntimeError(f"cannot load its shard of {spec.model_path}: {type(exc).__name__}: {exc}") from exc
        self._calls = 0
        self._fault = _parse_test_fault()

    # ---- calls from the engine (same arguments on every rank) -------------------------------
    def info(self) -> dict:
        """pid, rank, this rank's weight bytes, CPU GEMM, KV heads held."""
        return {"pid": os.getpid(), "rank": self.rank, "weight_bytes": self.runner.weight_bytes,
                "cpu_gemm": self.runner.cpu_gemm, "num_kv_heads": self.runner.model.num_kv_heads}

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_cache_bytes_per_block(block_size)

    def determine_num_blocks(self, cache, max_num_batched_tokens: int) -> int:
        return self.runner.determine_num_blocks(cache, max_num_batched_tokens)

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_num_seqs: int, enforce_eager: bool) -> None:
        # CUDA graphs are not captured under tensor parallelism (their collectives are untested)
        self.runner.initialize_kv_cache(num_blocks, block_size, max_num_seqs=max_num_seqs,
                                        enforce_eager=enforce_eager or self.spec.tp_size > 1)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def execute_model(self, step):
        """Run one step; rank 0 returns the logits as a float32 numpy array [n, vocab] (or None)
        and the step's prompt logprobs ({seq_id: (first token index, entries)}; {} elsewhere)."""
        self._calls += 1
        if self._fault and self._fault[1] == self.rank and self._fault[2] == self._calls:
            if self._fault[0] == "exit":
                os._exit(3)
            raise RuntimeError(f"planted test fault in execute_model call {self._calls}")
        logits, prompt_logprobs = self.runner.execute_model(step)
        return None if logits is None else logits.numpy(), prompt_logprobs

    def memory(self) -> dict:
        """This process's RSS and (on CUDA) torch's allocated bytes."""
        import psutil
        import torch

        out = {"pid": os.getpid(), "rss_bytes": psutil.Process().memory_info().rss}
        if self.runner.device.type == "cuda":
            out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.runner.device)
        return out

    def census(self, ended_request_ids: list[str], seq_names: dict[int, str], live_seq_ids: list[int]) -> dict:
        """This rank's request-id census and host-memory readings, for the engine's idle points.

        The walk (``census.request_census``) starts at this ``Worker`` (its runner, model and
        whatever per-request state the rank keeps) and at the module- and class-level containers
        of vlite's engine modules loaded in this process. ``ended_request_ids``: every request the
        engine has ended; ``seq_names``: sequence id -> request id of the engine's finished records
        (a rank sees sequence ids only, e.g. ``PromptLogprobsRows.seq_id``); ``live_seq_ids``: the
        engine's live sequences (none at an idle point): every other ``SeqId`` here is an ended
        request's. Read-only; costs one visit per reachable object (ms), so the engine calls it
        only at idle points, never inside a step.

        Returns a plain dict: ``rank``, ``pid``, ``held`` (``HeldRequestState.to_dict`` each),
        ``objects_visited``, ``truncated``, ``container_sizes`` (path -> entries of every non-empty
        container), ``elapsed_ms``. This process's memory the engine reads itself, by ``pid``.
        """
        from vlite.engine.census import module_roots, request_census
        from vlite.engine.core.sequence import SeqId

        t0 = time.perf_counter()
        result = request_census({"worker": self, **module_roots()}, ended_request_ids, seq_id_type=SeqId,
                                live_seq_ids=live_seq_ids, seq_names=seq_names)
        return {"rank": self.rank, "pid": os.getpid(), **result.to_dict(),
                "container_sizes": dict(result.container_sizes), "elapsed_ms": round((time.perf_counter() - t0) * 1e3, 2)}


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as its parent is gone (re-parented to another pid)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def worker_main(spec: WorkerSpec, rank: int, conn, parent_pid: int) -> None:
    """Entry point of a multiprocessing worker (spawned): start, then serve calls until told to
    stop, the pipe closes, or the parent dies."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    try:
        worker = Worker(spec, rank)
        conn.send(("ok", worker.info()))
    except BaseException as exc:  # noqa: BLE001 - reported, then this process ends
        try:
            conn.send(("error", rank, _one_line(exc)))
        except OSError:
            pass
        os._exit(1)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the engine is gone
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args)
        except Exception as exc:  # noqa: BLE001 - the engine decides; this rank stays up
            logger.exception("rank %d: %s failed", rank, method)
            conn.send(("error", rank, _one_line(exc)))
        else:
            conn.send(("ok", result))
    # No destroy_process_group: with a peer gone it can block (holding the GIL, so the parent
    # watchdog could not run either). Exiting closes this rank's sockets.
    os._exit(0)


__all__ = ["Worker", "WorkerSpec", "worker_main"]
