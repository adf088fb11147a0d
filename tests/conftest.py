"""Shared fixtures: tiny random Llama-family models built in-process, and the real SmolLM2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vlite.engine.worker.cpu_threads import apply_openmp_defaults

apply_openmp_defaults()  # the OpenMP wait policy the vlite command runs with; must precede torch's import

import torch  # noqa: E402

# The probe is its own distribution (probe/); its tests import it from the checkout.
PROBE_DIR = Path(__file__).resolve().parents[1] / "probe"
if str(PROBE_DIR) not in sys.path:
    sys.path.append(str(PROBE_DIR))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny_model_dir(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of ``arch`` (llama | qwen2 | mistral) with SmolLM2's tokenizer.

    The weights use a large init scale so that greedy logits have clear winners (near-ties
    would make float32 token-for-token comparisons flaky for reasons unrelated to vlite).
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tokenizer = smollm2_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id)
    common.update(overrides)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common)).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


_TOKENIZER = None


# A directory holding the default model's tokenizer files alone (tokenizer.json, tokenizer_config.json):
# where the 98 MB GGUF package cannot go (the GPU machine, benchmarks/gpu/gpu_check.sh), the tiny test
# models take their tokenizer from there.
TOKENIZER_DIR_ENV = "VLITE_TEST_TOKENIZER_DIR"


def smollm2_tokenizer():
    """SmolLM2's tokenizer: from ``$VLITE_TEST_TOKENIZER_DIR`` when set, else from vlite's
    conversion cache of the default model (converted once per machine)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        if os.environ.get(TOKENIZER_DIR_ENV):
            _TOKENIZER = AutoTokenizer.from_pretrained(os.environ[TOKENIZER_DIR_ENV])
        else:
            from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model

            _TOKENIZER = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).path)
    return _TOKENIZER


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model_dir):
    from vlite.engine.worker.loader import load_checkpoint

    return load_checkpoint(str(tiny_model_dir))


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    from vlite.engine.worker.loader import DEFAULT_MODEL, load_checkpoint

    return load_checkpoint(DEFAULT_MODEL)


def make_engine(checkpoint, *, num_blocks: int | None = 64, block_size: int = 16, max_num_batched_tokens: int = 2048,
                max_num_seqs: int = 128, max_model_len: int | None = None, faults: tuple[str, ...] = (),
                dtype: str = "float32", cpu_gemm: str | None = None, tensor_parallel_size: int = 1,
                distributed_executor_backend: str = "mp", device: str = "cpu", enforce_eager: bool = False):
    """An LLMEngine on an already loaded checkpoint (no disk reads in this process; with
    ``tensor_parallel_size`` > 1 each worker reads its shard from ``checkpoint.path``).
    ``device``/``enforce_eager``: as vlite's --device and --enforce-eager (CPU by default)."""
    from vlite.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from vlite.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(checkpoint.path), dtype=dtype, device=device, enforce_eager=enforce_eager, inject_faults=faults,
        cpu_gemm=cpu_gemm,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len),
        parallel=ParallelConfig(tensor_parallel_size, distributed_executor_backend))
    return LLMEngine(config, checkpoint=checkpoint)


SERVE_STARTUP_TIMEOUT_S = 300.0  # imports, model load and (first run) the CPU kernels' build on a loaded 2-core machine


@pytest.fixture
def vlite_serve(tiny_model_dir, tmp_path):
    """``start(*args, env=None) -> base URL``: ``vlite serve --model <tiny> --num-blocks 96 ARGS`` on a free
    loopback port, ready (/health 200) when returned; ``env`` adds to the environment. Every server
    started is stopped after the test, and its log tail printed (pytest shows it when the test failed)."""
    from serve_harness import ServerProcess

    servers: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> str:
        srv = ServerProcess(tiny_model_dir, tmp_path / f"serve-{len(servers)}.log", "--num-blocks", "96", *args,
                            env=env)
        servers.append(srv)
        srv.wait_ready(timeout=SERVE_STARTUP_TIMEOUT_S)
        return srv.base_url

    yield start
    for srv in servers:
        srv.stop()
        print(srv.log()[-4000:])
