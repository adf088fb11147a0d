"""logit_bias, allowed_token_ids and bad_words in the engine (vlite/engine/worker/logits_processors.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.llm_engine import RequestRejectedError
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.logits_processors import bad_word_token_ids, build_logits_processor
from vlite.engine.worker.sampler import sample

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return make_engine(tiny_checkpoint)


def greedy(engine, max_tokens=8, **extra):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)
    return engine.generate([PROMPT], params)[0].outputs[0].token_ids


def test_logit_bias_forces_and_bans(engine):
    base = greedy(engine)
    assert greedy(engine, logit_bias={123: 100.0}) == [123] * 8
    banned = greedy(engine, logit_bias={base[0]: -100.0})
    assert base[0] not in banned and banned != base
    assert greedy(engine, logit_bias={base[0]: 0.0}) == base  # a zero bias changes nothing


def test_logprobs_stay_raw_under_logit_bias(engine):
    """vLLM's raw_logprobs: the reported logprob of a token is the model's, not the biased one."""
    params = dict(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0)
    plain = engine.generate([PROMPT], SamplingParams(**params))[0].outputs[0]
    forced = engine.generate([PROMPT], SamplingParams(**params, logit_bias={123: 100.0}))[0].outputs[0]
    assert forced.token_ids == [123] and plain.token_ids != [123]
    assert forced.logprobs[0][123] < plain.logprobs[0][plain.token_ids[0]]


def test_allowed_token_ids_sampled_n2(engine):
    allowed = [5, 77, 900]
    params = SamplingParams(max_tokens=12, temperature=100.0, seed=0, n=2, ignore_eos=True,  # nearly flat
                            allowed_token_ids=allowed)
    out = engine.generate([PROMPT], params)[0]
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert set(c.token_ids) <= set(allowed)
    assert len({t for c in out.outputs for t in c.token_ids}) > 1  # really sampled


def test_bad_words_single_and_multi_token(engine, tiny_checkpoint):
    tok = tiny_checkpoint.tokenizer
    base = greedy(engine, 12)
    word = tok.decode(base[:1]).strip()
    out = greedy(engine, 12, bad_words=[word])
    for ids in bad_word_token_ids(tok, [word]):
        assert len(ids) > 1 or ids[0] not in out
    # a two-token word: its last token never follows its first
    pair = next(base[i:i + 2] for i in range(len(base) - 1) if base[i] != base[i + 1])
    words = bad_word_token_ids(tok, [tok.decode(pair)])
    out = greedy(engine, 12, bad_words=[tok.decode(pair)])
    for ids in words:
        assert all(tuple(out[i:i + len(ids)]) != ids for i in range(len(out)))
    assert out != base


def test_bad_word_prefix_rule_masks_only_after_prefix():
    """Unit: the last token of a multi-token word is masked only right after its prefix."""
    from vlite.engine.worker.logits_processors import LogitsProcessor

    proc = LogitsProcessor(bad_words=[(7, 8)])
    seq = Sequence("r", None, [1, 2], SamplingParams(), RequestOrigin("r"))
    row = torch.zeros(10)
    proc.apply(row, seq)
    assert torch.isfinite(row).all()
    seq.output_token_ids = [3, 7]
    proc.apply(row, seq)
    assert row[8] == float("-inf") and torch.isfinite(row[:8]).all()


def test_requests_without_processors_are_untouched():
    seqs = [Sequence(f"r{i}", None, [1], SamplingParams(temperature=0.0), RequestOrigin(f"r{i}")) for i in range(3)]
    logits = torch.randn(3, 50)
    ref = logits.clone()
    out = sample(logits, seqs)
    assert torch.equal(logits, ref) and out.token_ids == ref.argmax(-1).tolist()
    assert build_logits_processor(SamplingParams(), None, 50) is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(logit_bias={1: 100.5}), "logit_bias values must be numbers in \\[-100, 100\\]"),
    (dict(logit_bias={1: float("nan")}), "logit_bias values"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words must be non-blank strings"),
    (dict(temperature=0.0, beam_width=2, logit_bias={1: 1.0}), "beam search does not support logit_bias"),
])
def test_sampling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_engine_refuses_ids_outside_the_vocabulary(engine):
    vocab = engine.hf_config.vocab_size
    for params, field in [(SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[0, vocab + 5]), "allowed_token_ids")]:
        with pytest.raises(RequestRejectedError, match=f"{field} holds token id .* outside the vocabulary"):
            engine.add_request(PROMPT, params)
    assert not engine.has_unfinished_requests()
