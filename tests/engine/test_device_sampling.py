"""Plain greedy steps take their argmax where the logits are (``ModelRunner.greedy_on_device``,
on by default on a GPU, so only token ids cross to the host): same tokens as the host sampler,
and any request that needs more than argmax goes through the host sampler."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker import model_runner
from vlite.engine.worker.sampler import argmax_on_device, plain_greedy, sample


def _seq(**params) -> Sequence:
    return Sequence("r", None, [1, 2, 3], SamplingParams(max_tokens=4, **params), RequestOrigin("r"))


def test_argmax_on_device_equals_the_host_sampler_on_plain_greedy_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    logits[2, [7, 40]] = 50.0  # a tie: the lowest id wins in both
    seqs = [_seq(temperature=0) for _ in range(5)]
    assert plain_greedy(seqs)
    out = argmax_on_device(logits.clone())
    assert out.token_ids == sample(logits.clone(), seqs).token_ids and out.token_ids[2] == 7
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=0, logprobs=2),
                                    dict(temperature=0, repetition_penalty=1.2), dict(temperature=0, min_tokens=2),
                                    dict(temperature=0, logit_bias={5: 3.0})])
def test_anything_beyond_argmax_is_not_plain_greedy(params, tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    engine.add_request("x", SamplingParams(max_tokens=4, **params), prompt_token_ids=[1, 2, 3])
    seq = next(iter(engine.scheduler.waiting))
    assert not plain_greedy([_seq(temperature=0), seq])


def test_engine_tokens_equal_with_greedy_on_device(tiny_checkpoint, monkeypatch):
    """On the CPU the switch is off; turned on, a greedy batch gives the same tokens without
    the host sampler, and a batch with a sampled request still uses it."""
    prompts = ["Hello there", "A paged KV cache splits each sequence into blocks", "1 2 3"]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = make_engine(tiny_checkpoint)
    assert engine.model_runner.greedy_on_device is False
    host = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    calls = []
    real = model_runner.sample_step
    monkeypatch.setattr(model_runner, "sample_step", lambda *a: calls.append(1) or real(*a))
    engine = make_engine(tiny_checkpoint)
    engine.model_runner.greedy_on_device = True
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == host
    assert not calls
    sampled = SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
    engine.generate(prompts, [greedy, sampled, greedy])
    assert calls
