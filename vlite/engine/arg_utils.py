"""``EngineArgs``: every engine option in one flat dataclass, and the one place that turns it
into a validated ``EngineConfig`` (vLLM's ``vllm/engine/arg_utils.py``).

Each field that is a command-line option carries its flag names and help text in its
``metadata`` (``flags``, ``help``); ``vlite.cli.common.engine_args_options`` turns those
into Typer options, so ``vlite generate``, ``serve``, ``bench`` and ``leak-check`` share one
set of engine flags with the same names and defaults (vLLM's: ``--max-num-seqs``,
``--tensor-parallel-size``/``-tp``, ...). Fields without ``flags`` (``enable_ledger``,
``cpu_gemm``, ``finished_history``) are set in code or from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vlite.engine.config import (
    DEFAULT_MODEL,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from vlite.engine.core.faults import FAULTS


def _cli(*flags: str, help: str) -> dict:  # noqa: A002 (the keyword is click's)
    return {"flags": flags, "help": help}


@dataclass
class EngineArgs:
    """Engine options as the command line spells them (one field per flag, vLLM's names).

    Units: ``block_size`` tokens per block; ``kv_cache_memory_bytes`` bytes;
    ``gpu_memory_utilization`` a fraction in (0, 1]; ``max_num_batched_tokens`` and
    ``max_model_len`` tokens. Nothing is validated here: ``create_engine_config`` does it.
    """

    model: str = field(default=DEFAULT_MODEL, metadata=_cli(
        "--model", "-m", help="Local HF directory, .gguf file, or the default model's name."))
    dtype: str = field(default="float32", metadata=_cli(
        "--dtype", help="float32 (default), bfloat16, or float16 (CUDA)."))
    device: str | None = field(default=None, metadata=_cli(
        "--device", help="cpu or cuda (default: cuda when available)."))
    seed: int = field(default=0, metadata=_cli(
        "--seed", help="Engine seed (requests without a seed sample from it)."))
    block_size: int = field(default=16, metadata=_cli(
        "--block-size", help="Tokens per KV block (a power of two)."))
    num_blocks: int | None = field(default=None, metadata=_cli(
        "--num-blocks", help="Physical KV blocks (default: sized from --kv-cache-memory-bytes on CPU, "
                             "--gpu-memory-utilization on CUDA)."))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=_cli(
        "--kv-cache-memory-bytes", help="KV cache byte budget on CPU (default 1 GiB)."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_cli(
        "--gpu-memory-utilization", help="Fraction of GPU memory to use (CUDA)."))
    enable_prefix_caching: bool = field(default=True, metadata=_cli(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse cached full KV blocks across requests (on by default, as in vLLM)."))
    max_num_seqs: int = field(default=128, metadata=_cli(
        "--max-num-seqs", help="Most sequences running at once."))
    max_num_batched_tokens: int = field(default=2048, metadata=_cli(
        "--max-num-batched-tokens", help="Token budget of one step."))
    max_model_len: int | None = field(default=None, metadata=_cli(
        "--max-model-len", help="Longest prompt + output, tokens."))
    enforce_eager: bool = field(default=False, metadata=_cli(
        "--enforce-eager", help="CUDA: run decode eagerly instead of replaying captured CUDA graphs."))
    tensor_parallel_size: int = field(default=1, metadata=_cli(
        "--tensor-parallel-size", "-tp", help="Processes the model's layers are sharded over (1: in the "
                                              "engine's own process)."))
    distributed_executor_backend: str = field(default="mp", metadata=_cli(
        "--distributed-executor-backend",
        help=f"How tensor-parallel workers run: {' or '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} "
             "(mp: worker processes on this host; ray: Ray actors)."))
    inject_faults: tuple[str, ...] = field(default=(), metadata=_cli(
        "--inject-fault", help="Plant a known defect (repeatable; for leak-check self-tests): "
                               f"{', '.join(FAULTS)}."))
    # Not command-line options of every command:
    enable_ledger: bool = True  # ``vlite bench throughput --disable-ledger`` turns it off
    cpu_gemm: str | None = None  # None: the VLITE_CPU_GEMM environment variable, else auto
    finished_history: int = 10_000

    @classmethod
    def cli_fields(cls) -> list:
        """The dataclass fields that are command-line options, in declaration order."""
        return [f for f in fields(cls) if "flags" in f.metadata]

    def create_engine_config(self) -> EngineConfig:
        """Validate every option and build the nested ``EngineConfig``.

        Raises:
            ValueError: one line naming the bad option, its value and what is allowed
                (from the config dataclasses' checks and ``FaultSet``).
        """
        from vlite.engine.core.faults import FaultSet

        FaultSet(tuple(self.inject_faults))  # unknown fault names fail here, before any model loads
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, seed=self.seed,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend),
            inject_faults=tuple(self.inject_faults), enable_ledger=self.enable_ledger,
            enforce_eager=self.enforce_eager, cpu_gemm=self.cpu_gemm, finished_history=self.finished_history)
