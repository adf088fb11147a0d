"""Incremental detokenization (vlite/engine/core/detokenizer.py) on SmolLM2's byte-level BPE:
decoding pending tokens in chunks of any size (text decoded only when read) gives the same
text as decoding them one at a time and as one full decode, on text with multi-byte UTF-8
characters split across tokens, leading spaces and special tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import smollm2_tokenizer
from vlite.engine.core.detokenizer import detokenize_incrementally, fast_decoder, init_detokenizer
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams

TEXT = st.text(alphabet=st.sampled_from(list("ab c.\n") + ["é", "ö", "日", "本", "🎉", "ﬁ", "\t", "\u200b"]),
               min_size=1, max_size=40)


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def _seq(prompt: list[int]) -> Sequence:
    seq = Sequence("r", None, prompt, SamplingParams(), RequestOrigin("r"))
    init_detokenizer(seq)
    return seq


def _decode_in_chunks(tokenizer, prompt: list[int], output: list[int], cuts: list[int]) -> str:
    """Append ``output`` to a sequence, decoding after each position in ``cuts`` and at the end."""
    seq = _seq(prompt)
    for i, token in enumerate(output, 1):
        seq.output_token_ids.append(token)
        if i in cuts:
            detokenize_incrementally(tokenizer, seq)
    detokenize_incrementally(tokenizer, seq)
    return seq.output_text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt_text=TEXT, output_text=TEXT, seed=st.integers(0, 2**16), specials=st.booleans())
def test_chunked_equals_per_token_equals_full_decode(tokenizer, prompt_text, output_text, seed, specials):
    prompt = tokenizer(prompt_text).input_ids
    output = tokenizer(output_text).input_ids
    rng = random.Random(seed)
    if specials:  # special tokens are skipped wherever they fall
        for _ in range(2):
            output.insert(rng.randrange(len(output) + 1), rng.choice(tokenizer.all_special_ids))
    per_token = _decode_in_chunks(tokenizer, prompt, output, cuts=list(range(1, len(output) + 1)))
    cuts = sorted(rng.sample(range(1, len(output) + 1), k=rng.randrange(len(output) + 1)))
    chunked = _decode_in_chunks(tokenizer, prompt, output, cuts)
    once = _decode_in_chunks(tokenizer, prompt, output, cuts=[])
    full = tokenizer.decode(output, skip_special_tokens=True)
    assert chunked == per_token == once == full
    rust = fast_decoder(tokenizer)  # the engine's decoder: the Rust tokenizer behind this one
    assert rust is not tokenizer
    assert _decode_in_chunks(rust, prompt, output, cuts) == _decode_in_chunks(rust, prompt, output, []) == full


def test_chunk_ending_inside_a_character_keeps_the_text_before_it(tokenizer):
    """A read between the bytes of one character shows the text before it (as a per-token
    decode would have), and the character once it is complete."""
    ids = tokenizer("ab 🎉").input_ids
    seq = _seq(tokenizer("x").input_ids)
    seq.output_token_ids.extend(ids[:-1])  # the emoji's last byte still missing
    new = detokenize_incrementally(tokenizer, seq)
    assert new == seq.output_text == "ab"  # " \xf0" is one token: the space waits with the emoji
    seq.output_token_ids.append(ids[-1])
    detokenize_incrementally(tokenizer, seq)
    assert seq.output_text == "ab 🎉"


def test_nothing_pending_decodes_nothing(tokenizer):
    seq = _seq(tokenizer("x").input_ids)
    seq.output_token_ids.extend(tokenizer(" hello").input_ids)
    assert detokenize_incrementally(tokenizer, seq) == " hello"
    assert detokenize_incrementally(tokenizer, seq) == ""
    assert seq.output_text == " hello"
