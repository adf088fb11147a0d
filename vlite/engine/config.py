"""Engine configuration dataclasses (names follow vLLM's engine arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# On CPU the KV cache is sized by a byte budget (vLLM: --kv-cache-memory-bytes).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# The CPU GEMM of the linear layers (vlite/engine/worker/models/linear.py).
CPU_GEMM_BACKENDS = ("auto", "vlite", "onednn", "torch")


@dataclass
class CacheConfig:
    """KV cache geometry.

    block_size: tokens per physical block (vLLM default 16; a power of two).
    num_blocks: physical blocks; None means size from ``kv_cache_memory_bytes`` on CPU or
        ``gpu_memory_utilization`` on CUDA.
    kv_cache_memory_bytes: byte budget for K and V of all layers (CPU sizing).
    gpu_memory_utilization: fraction of device memory the engine may use (CUDA sizing).
    enable_prefix_caching: reuse cached full blocks across requests (on by default, as in vLLM).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class SchedulerConfig:
    """Continuous-batching limits.

    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    max_num_seqs: most sequences running at once.
    max_model_len: longest sequence (prompt + output), tokens; None = the model's limit.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    """How the model is split across processes (vLLM's ``ParallelConfig``).

    tensor_parallel_size: ranks the model's layers are sharded over (Megatron-LM style);
        1 runs the model in the engine's own process.
    distributed_executor_backend: "mp" (one spawned worker process per rank, this host) or
        "ray" (Ray actors, across hosts; needs ``pip install 'vlite[ray]'``).
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")


@dataclass
class EngineConfig:
    """Everything ``LLMEngine`` needs to start.

    model: a local Hugging Face directory, a ``.gguf`` file, or the default model's name.
    dtype: "float32" (default, the reference precision) or "bfloat16".
    device: "cpu" or "cuda"; None picks CUDA when available.
    inject_faults: planted defects for the leak checker's self-test (never on by default).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    inject_faults: tuple[str, ...] = ()
    # The allocation ledger is always on in production; off only to measure its cost.
    enable_ledger: bool = True
    # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # CPU: the linear layers' GEMM, "vlite" (vlite's packed-weight kernels), "onednn" (oneDNN on
    # prepacked weights), "torch" (F.linear) or "auto" (the first of those that runs the dtype
    # here); None = the VLITE_CPU_GEMM environment variable, else auto.
    cpu_gemm: str | None = None
    # Finished requests remembered for leak attribution (bounded, oldest dropped first).
    finished_history: int = 10_000

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.cpu_gemm is not None and self.cpu_gemm not in CPU_GEMM_BACKENDS:
            raise ValueError(f"cpu_gemm must be one of {CPU_GEMM_BACKENDS}, got {self.cpu_gemm!r}")
