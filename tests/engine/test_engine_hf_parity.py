"""Greedy float32 outputs equal Hugging Face transformers' ``generate`` token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model_dir, make_engine

from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import load_checkpoint
from vlite.engine.worker.models.linear import resolve_cpu_gemm_backend

TINY_PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "A paged KV cache splits each sequence into fixed-size blocks of sixteen tokens, "
    "so memory is allocated on demand and freed when the request ends.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33",
    "def add(a, b):\n    return a + b\n",
]

SMOL_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    "def fibonacci(n):",
    "Explain what a KV cache is in one sentence.",
    "List three primary colors:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: The weather is nice today, and I would like to go for a walk in the park "
    "with my friends before dinner.",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter "
    "and his daughter. Every morning they",
]


def hf_greedy(hf_model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        # eos_token_id=None: run to max_new_tokens without masking EOS, like vlite's ignore_eos
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def _check_parity(ckpt, prompts, max_tokens, cpu_gemm=None, **engine_kwargs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, ckpt.tokenizer, p, max_tokens) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # each prompt alone
    for prompt, ref in zip(prompts, refs):
        out = make_engine(ckpt, cpu_gemm=cpu_gemm).generate([prompt], params)[0]
        assert out.outputs[0].token_ids == ref, f"alone: {prompt!r}"
    # all in one continuous batch, with a cache small enough to force preemption and chunked prefill
    engine = make_engine(ckpt, cpu_gemm=cpu_gemm, **engine_kwargs)
    assert engine.cpu_gemm == (cpu_gemm or resolve_cpu_gemm_backend(None))
    outs = engine.generate(prompts, params)
    for prompt, ref, out in zip(prompts, refs, outs):
        assert out.outputs[0].token_ids == ref, f"batched: {prompt!r}"
        assert out.outputs[0].text == ckpt.tokenizer.decode(ref, skip_special_tokens=True)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0, "the small cache was meant to force preemption"
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
    assert stats.kv_cache_usage == 0.0
    return engine


@pytest.mark.parametrize("arch,cpu_gemm", [("llama", None), ("qwen2", None), ("mistral", None), ("llama", "torch"),
                                           ("llama", "onednn")])
def test_tiny_models_match_transformers(tmp_path, arch, cpu_gemm):
    """Every CPU GEMM: the default (vlite's packed kernels where the CPU has AVX-512, else
    oneDNN), oneDNN on prepacked weights, and F.linear (what HF runs)."""
    overrides = {"tie_word_embeddings": True} if arch == "llama" else {}
    if arch == "qwen2":
        overrides["rope_theta"] = 50000.0
    ckpt = load_checkpoint(str(build_tiny_model_dir(tmp_path, arch, **overrides)))
    _check_parity(ckpt, TINY_PROMPTS, max_tokens=24, cpu_gemm=cpu_gemm, num_blocks=16, block_size=8,
                  max_num_batched_tokens=24)


def test_tiny_llama_with_rope_scaling_matches(tmp_path):
    ckpt = load_checkpoint(str(build_tiny_model_dir(
        tmp_path, "llama", rope_scaling={"rope_type": "linear", "factor": 2.0})))
    _check_parity(ckpt, TINY_PROMPTS[:3], max_tokens=16, num_blocks=7, block_size=8, max_num_batched_tokens=16)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_checkpoint):
    # 8 prompts of different lengths; 14 blocks of 16 tokens cannot hold all of them at once.
    _check_parity(smollm2_checkpoint, SMOL_PROMPTS, max_tokens=32, num_blocks=14,
                  max_num_batched_tokens=48)
