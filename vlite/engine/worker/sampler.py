"""Batched sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds.

Logit processing follows vLLM's sampler order: per-request logits processors (logit_bias,
allowed_token_ids, bad_words: vlite/engine/worker/logits_processors.py), penalties (repetition as in CTRL, Keskar et al.
2019; presence/frequency as the OpenAI API reference defines them), min_tokens masking,
temperature, then top-k / top-p / min-p truncation, then sampling.

Log-probabilities are vLLM's default ``raw_logprobs``: the log-softmax of the model's logits
before any of that processing, so a token that top-k / top-p / min-p / a penalty removed still
has its true (finite) log-probability, and asking for logprobs never changes which token is
sampled.
"""

from __future__ import annotations

import torch

from vlite.engine.core.sched_output import SamplerOutput
from vlite.engine.core.sequence import Sequence
from vlite.engine.core.structured_output import apply_grammar_masks
from vlite.engine.worker.logits_processors import apply_logits_processors
from vlite.kernels import cpu_sampling


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    p = seq.sampling_params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.all_token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask tokens outside top-k / nucleus top-p / min-p with -inf. logits: [V] float32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token while the mass before it is < top_p (the top token is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from probs ([V] float32, summing to about 1), by inverse transform sampling:
    the first id whose cumulative probability (float64) exceeds u * total, u ~ U[0, 1).

    One uniform number per draw: on CPU, drawing V exponentials for an exponential race (or
    ``torch.multinomial``) costs about 0.7 ms for SmolLM2's 49,152 tokens, this about 0.05 ms.
    Tokens of probability 0 are never drawn.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[-1] - 1)


def plain_greedy(seqs: list[Sequence]) -> bool:
    """True when every row's token is the argmax of its raw logits: greedy, no penalties,
    min_tokens reached, no logprobs, no logits processor and no grammar. Such a batch can be
    sampled where the logits are (``argmax_on_device``) instead of moving them to the host."""
    return all(s.sampling_params.greedy and not s.sampling_params.uses_penalties
               and s.num_output_tokens >= s.sampling_params.min_tokens and s.sampling_params.logprobs is None
               and s.logits_processor is None and s.grammar_matcher is None for s in seqs)


def argmax_on_device(logits: torch.Tensor) -> SamplerOutput:
    """The tokens of a ``plain_greedy`` batch from its logits [N, vocab] on any device: only the
    N token ids cross to the host (for SmolLM2's vocabulary, 4 bytes instead of 196 KB per
    row). Ties go to the lowest id, as in ``sample``."""
    return SamplerOutput(logits.argmax(-1).tolist(), [None] * logits.shape[0])


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator | None = None,
           row_generators: list[torch.Generator | None] | None = None) -> SamplerOutput:
    """Pick the next token of each sequence.

    Args:
        logits: [N, vocab] float32, row i for ``seqs[i]`` (modified in place).
        seqs: the sequences that sample this step.
        generator: used by rows whose request has no seed.
        row_generators: per row, a generator used before the sequence's own (the first token
            of a sample not forked yet); None entries fall back as above.
    """
    apply_grammar_masks(logits, seqs)  # structured output: -inf outside each row's grammar
    token_ids: list[int] = []
    logprobs: list[dict[int, float] | None] = []
    # Before any processing: the model's own distribution (vLLM's raw_logprobs).
    raw = [logits[i].log_softmax(-1) if s.sampling_params.logprobs is not None else None for i, s in enumerate(seqs)]
    apply_logits_processors(logits, seqs)  # logit_bias, allowed_token_ids, bad_words
    if all(s.sampling_params.greedy and not s.sampling_params.uses_penalties
           and s.num_output_tokens >= s.sampling_params.min_tokens and s.sampling_params.logprobs is None
           for s in seqs):
        return SamplerOutput(cpu_sampling.argmax(logits).tolist(), [None] * len(seqs))
    for i, seq in enumerate(seqs):
        p = seq.sampling_params
        row = logits[i]
        raw_logprobs = raw[i]
        _apply_penalties(row, seq)
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seq.eos_token_ids))
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
        if p.greedy:
            token = int(cpu_sampling.argmax(row.unsqueeze(0))[0])
        else:
            row = _truncate(row / p.temperature, p.top_k, p.top_p, p.min_p)
            own = row_generators[i] if row_generators is not None else None
            token = draw(row.softmax(-1), own or seq.generator or generator)
        token_ids.append(token)
        if raw_logprobs is not None:
            lp = raw_logprobs
            entry = {token: float(lp[token])}
            if p.logprobs:
                top = torch.topk(lp, p.logprobs)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            logprobs.append(entry)
        else:
            logprobs.append(None)
    return SamplerOutput(token_ids, logprobs)
