"""Sampling, stop conditions and detokenization through the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.sampler import _truncate, draw


def test_seeded_requests_reproduce_in_any_batch(tiny_checkpoint):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_checkpoint).generate(["Tell me a story"], p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = make_engine(tiny_checkpoint).generate(["Other prompt", "Tell me a story", "Third one here"],
                                                  [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert make_engine(tiny_checkpoint).generate(["Tell me a story"], different)[0].outputs[0].token_ids != alone


def test_stop_strings_cut_the_text_and_set_stop_reason(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    free_run = engine.generate(["Once upon"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    text = free_run.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]  # a stop string somewhere inside (it may span tokens)
    out = engine.generate(["Once upon"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                        stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_min_tokens(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    free_run = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    ids = free_run.outputs[0].token_ids
    target = ids[4]
    first = ids.index(target)
    out = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target and out.token_ids == ids[:first + 1]
    # min_tokens masks the stop id until then: the output never stops early
    out = engine.generate(["abc"], SamplingParams(max_tokens=10, min_tokens=10, temperature=0,
                                                  stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10 and target not in out.token_ids


def test_repetition_penalty_changes_greedy_output(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    base = engine.generate(["a a a a"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    pen = engine.generate(["a a a a"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                      repetition_penalty=1e6))[0]
    seen = set(pen.prompt_token_ids)
    toks = pen.outputs[0].token_ids
    # with a huge penalty no token repeats one already in the prompt or output (while others remain)
    for i, t in enumerate(toks):
        assert t not in seen | set(toks[:i])
    base_toks = base.outputs[0].token_ids
    assert any(t in set(base.prompt_token_ids) | set(base_toks[:i]) for i, t in enumerate(base_toks)), \
        "without the penalty this prompt repeats tokens, so the check above means something"


def test_truncation_rules():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(_truncate(logits.clone(), 2, 1.0, 0.0)[2:]).all()
    kept = ~torch.isinf(_truncate(logits.clone(), -1, 0.7, 0.0))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    kept = ~torch.isinf(_truncate(logits.clone(), -1, 1.0, 0.5))
    assert kept.tolist() == [True, True, False, False]  # p >= 0.5 * 0.5


def test_logprobs_are_returned_when_asked(tiny_checkpoint):
    out = make_engine(tiny_checkpoint).generate(
        ["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok] == max(lp.values()) and lp[tok] <= 0


def test_streamed_text_equals_final_text(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    engine.add_request("Streaming test:", SamplingParams(max_tokens=15, temperature=0, ignore_eos=True),
                       request_id="s")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    texts = [o.outputs[0].text for o in outs]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert texts[-1] == engine.tokenizer.decode(outs[-1].outputs[0].token_ids, skip_special_tokens=True)
    assert sum(len(o.new_token_ids) for o in outs) == 15


def test_logprobs_are_the_models_unfiltered_ones(tiny_checkpoint):
    """vLLM's raw_logprobs: top-k / temperature do not change the reported log-probabilities, and
    tokens the filter removed keep their finite value (not -inf, nor the sampled one 0.0)."""
    import math

    engine = make_engine(tiny_checkpoint)
    greedy = engine.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                    logprobs=3))[0].outputs[0]
    filtered = engine.generate(["hi"], SamplingParams(max_tokens=3, temperature=0.7, top_k=1, seed=0,
                                                      ignore_eos=True, logprobs=3))[0].outputs[0]
    assert filtered.token_ids == greedy.token_ids  # top_k 1 samples the argmax
    for want, got in zip(greedy.logprobs, filtered.logprobs):
        assert set(got) == set(want) and len(got) == 3
        assert all(math.isfinite(v) and v == pytest.approx(want[t], abs=1e-5) for t, v in got.items())


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    probs = torch.zeros(1000)
    probs[[3, 500, 998, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the last id is a possible pick
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=1000)
    assert counts.sum() == n and set(counts.nonzero().flatten().tolist()) == {3, 500, 998, 999}
    # each frequency within 4 standard deviations of its probability
    for tid, p in ((3, 0.1), (500, 0.2), (998, 0.3), (999, 0.4)):
        assert abs(counts[tid] / n - p) < 4 * (p * (1 - p) / n) ** 0.5, (tid, counts[tid])
    # the same generator state draws the same token
    assert draw(probs, torch.Generator().manual_seed(7)) == draw(probs, torch.Generator().manual_seed(7))
