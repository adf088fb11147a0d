"""Options and helpers shared by the CLI commands."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from vlite.engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig


def make_console(stderr: bool = False) -> Console:
    """A Rich console; when the output is not a terminal (CI logs, pipes) it is 160 columns
    wide instead of Rich's 80, so tables and verdict lines are not folded mid-word."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 160)


err_console = make_console(stderr=True)

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m",
                        help="Local HF directory, .gguf file, or the default model's name.")
NumBlocksOpt = typer.Option(None, "--num-blocks", min=1,
                            help="Physical KV blocks (default: sized from --kv-cache-memory-bytes on CPU, "
                                 "--gpu-memory-utilization on CUDA).")
BlockSizeOpt = typer.Option(16, "--block-size", help="Tokens per KV block (a power of two).")
KvBytesOpt = typer.Option(None, "--kv-cache-memory-bytes", min=1, help="KV cache byte budget on CPU (default 1 GiB).")
GpuUtilOpt = typer.Option(0.9, "--gpu-memory-utilization", help="Fraction of GPU memory to use (CUDA).")
MaxSeqsOpt = typer.Option(128, "--max-num-seqs", min=1, help="Most sequences running at once.")
MaxBatchedOpt = typer.Option(2048, "--max-num-batched-tokens", min=1, help="Token budget of one step.")
MaxModelLenOpt = typer.Option(None, "--max-model-len", min=2, help="Longest prompt + output, tokens.")
DtypeOpt = typer.Option("float32", "--dtype", help="float32 (default), bfloat16, or float16 (CUDA).")
DeviceOpt = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available).")
PrefixCachingOpt = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                help="Reuse cached full KV blocks across requests (on by default, as in vLLM).")


def build_engine_config(model: str, num_blocks: int | None, block_size: int, kv_cache_memory_bytes: int | None,
                        gpu_memory_utilization: float, max_num_seqs: int, max_num_batched_tokens: int,
                        max_model_len: int | None, dtype: str, device: str | None, seed: int = 0,
                        inject_faults: tuple[str, ...] = (), enable_prefix_caching: bool = True) -> EngineConfig:
    """Build and validate an EngineConfig; exits with code 2 and a clear message when invalid."""
    try:
        return EngineConfig(
            model=model, dtype=dtype, device=device, seed=seed, inject_faults=tuple(inject_faults),
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len))
    except ValueError as exc:
        fail(str(exc))


def load_engine(config: EngineConfig):
    """Start an LLMEngine, turning load errors into a clear message and exit code 2."""
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.loader import ModelNotFoundError

    try:
        with err_console.status(f"Loading {config.model} ..."):
            return LLMEngine(config)
    except (ModelNotFoundError, ValueError) as exc:
        fail(str(exc))


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)  # one line, never folded
    sys.exit(code)
