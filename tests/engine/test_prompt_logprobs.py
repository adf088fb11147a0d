"""Prompt logprobs equal transformers' float32 log-softmax of the same prompt (within 1e-4):
alone, from a prompt whose blocks are in the prefix cache, across chunked prefill, and after
recompute preemption; aborts leave nothing behind."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from vlite.engine.introspection import EngineView
from vlite.engine.sampling_params import SamplingParams

PROMPT = ("A paged KV cache splits each sequence into fixed-size blocks of sixteen tokens, so memory is "
          "allocated on demand and freed when the request ends; blocks are shared by prefix.")
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log-softmax of transformers' logits for ``ids``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def check_against_hf(hf_model, ids: list[int], prompt_logprobs: list, k: int) -> None:
    ref = hf_log_softmax(hf_model, ids)
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row = prompt_logprobs[i], ref[i - 1]
        token = ids[i]
        assert abs(entry[token].logprob - float(row[token])) < TOL, f"position {i}"
        # the rank transformers' logits give, up to the tokens whose logprob lies within 1e-5 of
        # this one (deep in a random model's near-flat distribution, a last-bit difference swaps them)
        lo, hi = int((row > row[token] + 1e-5).sum()) + 1, int((row >= row[token] - 1e-5).sum())
        assert lo <= entry[token].rank <= hi, (entry[token].rank, lo, hi)
        top = torch.topk(row, k)
        for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert abs(entry[tid].logprob - val) < TOL
            if tid != token:
                assert entry[tid].rank == rank
        assert set(entry) <= set(top.indices.tolist()) | {token}


def test_prompt_logprobs_match_hf_with_and_without_prefix_cache(tiny_checkpoint, hf_model):
    # chunked prefill: 8-token chunks over a ~35-token prompt, block_size 8
    engine = make_engine(tiny_checkpoint, block_size=8, max_num_batched_tokens=8)
    ids = tiny_checkpoint.tokenizer(PROMPT).input_ids
    assert len(ids) > 3 * 8
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    out = engine.generate([PROMPT], plain)[0]
    assert out.prompt_logprobs is None  # not asked for
    hits_before = engine.scheduler.kv_cache_manager.prefix_cache_hits
    # the prompt's full blocks are cached now; asking for prompt logprobs recomputes them
    asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    out = engine.generate([PROMPT], asked)[0]
    check_against_hf(hf_model, ids, out.prompt_logprobs, 3)
    assert engine.scheduler.kv_cache_manager.prefix_cache_hits == hits_before, "the prefix cache was read"
    # a request without prompt logprobs still reads the cache afterwards
    engine.generate([PROMPT], plain)
    assert engine.scheduler.kv_cache_manager.prefix_cache_hits > hits_before
    # a fresh engine (nothing cached), one chunk for the whole prompt, k = 0: only the prompt tokens
    fresh = make_engine(tiny_checkpoint)
    out = fresh.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    check_against_hf(hf_model, ids, out.prompt_logprobs, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_under_preemption_and_n(tiny_checkpoint, hf_model):
    """A cache small enough to force recompute preemption mid-prefill; n = 2 forks share them."""
    prompts = [PROMPT, "The quick brown fox jumps over the lazy dog " * 3, "1 2 3 4 5 6 7 8 9 10 11 12 13 14",
               "def add(a, b):\n    return a + b\n"]
    engine = make_engine(tiny_checkpoint, num_blocks=16, block_size=8, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True, n=2, prompt_logprobs=2)
    outs = engine.generate(prompts, params)
    assert engine.stats().num_preemptions_total > 0, "the small cache was meant to force preemption"
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 2
        check_against_hf(hf_model, tiny_checkpoint.tokenizer(prompt).input_ids, out.prompt_logprobs, 2)
    assert engine.stats().kv_cache_usage == 0.0


def test_prompt_logprobs_one_token_prompt_and_abort_mid_prefill(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, block_size=8, max_num_batched_tokens=8)
    out = engine.generate([[42]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=5))
    engine.step()  # first 8-token chunk only
    seq = engine.scheduler.requests[rid].live[0]
    assert seq.partial_prompt_logprobs is not None and seq.prompt_logprobs is None
    assert engine.abort(rid)
    view = EngineView(engine)
    assert all(size == 0 for size in view.registries().values()), view.registries()
    assert engine.stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_bounds():
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in \\[0, 20\\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)


def test_prompt_logprobs_with_beam_search(tiny_checkpoint, hf_model):
    engine = make_engine(tiny_checkpoint, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, beam_width=3, n=2, prompt_logprobs=1)
    out = engine.generate([PROMPT], params)[0]
    assert len(out.outputs) == 2
    check_against_hf(hf_model, tiny_checkpoint.tokenizer(PROMPT).input_ids, out.prompt_logprobs, 1)
    assert engine.stats().kv_cache_usage == 0.0
