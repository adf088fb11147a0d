"""Per-request logits processors: ``logit_bias`` (OpenAI), ``allowed_token_ids`` and
``bad_words`` (vLLM's SamplingParams fields).

Each request that sets one gets a ``LogitsProcessor``, built once when the engine accepts it
(``build_logits_processor``: token ids checked against the vocabulary, bad words tokenized)
and kept on its sequences (``Sequence.logits_processor``, copied to forked samples). The
sampler calls ``apply_logits_processors`` once per step; a batch in which no request uses
them costs one attribute check per row and nothing else.

Semantics:
  * ``allowed_token_ids``: every other token's logit becomes -inf (vLLM).
  * ``bad_words``: each word is tokenized without special tokens, as written (leading
    whitespace stripped) and with one leading space (the form it takes after another word);
    a variant of one token is always masked, a longer one has its last token masked when the
    sequence's output ends with the rest of it (vLLM's rule, over output tokens only).
  * ``logit_bias``: ``bias`` is added to the token's logit (OpenAI: -100 bans, 100 forces).
They apply in that order, after the raw logprobs are taken (vLLM's default ``raw_logprobs``:
reported logprobs are the model's own) and before penalties, temperature and truncation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlite.engine.core.sequence import Sequence
from vlite.engine.sampling_params import SamplingParams


@dataclass
class LogitsProcessor:
    """One request's processors, as tensors ready to apply to a [vocab] float32 logits row.

    bias_ids / bias_values: token ids and the biases added to them (None if no logit_bias).
    blocked: bool [vocab], True for tokens outside ``allowed_token_ids`` (None if unset).
    bad_words: token id sequences never to complete.
    """

    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    blocked: torch.Tensor | None = None
    bad_words: list[tuple[int, ...]] = field(default_factory=list)

    def apply(self, row: torch.Tensor, seq: Sequence) -> None:
        """Modify one sequence's logits row [vocab] in place."""
        if self.blocked is not None:
            row.masked_fill_(self.blocked.to(row.device), float("-inf"))
        if self.bad_words:
            out = seq.output_token_ids
            for word in self.bad_words:
                prefix = word[:-1]
                if len(prefix) <= len(out) and (not prefix or tuple(out[len(out) - len(prefix):]) == prefix):
                    row[word[-1]] = float("-inf")
        if self.bias_ids is not None:
            row.index_add_(0, self.bias_ids.to(row.device), self.bias_values.to(row.device, row.dtype))


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids of ``logit_bias`` and ``allowed_token_ids`` must be in [0, vocab_size).

    Raises:
        ValueError: naming the field and the first bad id.
    """
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def bad_word_token_ids(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """Token id sequences of each word, as written (leading whitespace stripped) and after a
    space; duplicates dropped. ``tokenizer`` is a Hugging Face tokenizer."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def build_logits_processor(params: SamplingParams, tokenizer, vocab_size: int) -> LogitsProcessor | None:
    """The request's LogitsProcessor, or None when it sets none of the three fields.

    Raises:
        ValueError: a token id outside [0, vocab_size) (message names the field), or a bad
            word that tokenizes to ids outside the vocabulary.
    """
    if not params.uses_logits_processors:
        return None
    check_token_ids(params, vocab_size)
    proc = LogitsProcessor()
    if params.logit_bias:
        ids = sorted(params.logit_bias)
        proc.bias_ids = torch.tensor(ids, dtype=torch.long)
        proc.bias_values = torch.tensor([float(params.logit_bias[t]) for t in ids], dtype=torch.float32)
    if params.allowed_token_ids is not None:
        proc.blocked = torch.ones(vocab_size, dtype=torch.bool)
        proc.blocked[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = False
    if params.bad_words:
        proc.bad_words = bad_word_token_ids(tokenizer, params.bad_words)
        bad = [t for w in proc.bad_words for t in w if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"bad_words tokenize to token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return proc


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply each sequence's processors to its row of ``logits`` ([len(seqs), vocab] float32,
    in place); rows of sequences without processors are untouched."""
    for i, seq in enumerate(seqs):
        if seq.logits_processor is not None:
            seq.logits_processor.apply(logits[i], seq)


__all__ = ["LogitsProcessor", "apply_logits_processors", "bad_word_token_ids", "build_logits_processor",
           "check_token_ids"]
