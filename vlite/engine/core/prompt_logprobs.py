"""Prompt log-probabilities (vLLM's ``prompt_logprobs``, and ``echo`` with ``logprobs`` on the
legacy completions route), computed from the prefill logits of the same paged forward.

The logits at position ``p`` predict token ``p + 1``, so prompt token ``i >= 1`` gets
``log_softmax(logits[i - 1])[token_i]`` (natural log, float32, of the model's unprocessed
distribution); token 0 has no logprob (``None``), as in vLLM. Each chunk of a chunked prefill
contributes the tokens its positions predict; the entries are gathered on the sequence
(``Sequence.partial_prompt_logprobs``) until the prompt's last chunk has run, and the complete
list then moves to ``Sequence.prompt_logprobs``.

Prefix caching: a prompt served from cached blocks has no logits for those positions, so the
scheduler does not look up the prefix cache for a sequence whose prompt logprobs are still
missing (``needs_prompt_logprobs``): the whole prompt is recomputed, as vLLM does. Its full
blocks are still cached for others afterwards. Preemption (recompute) re-runs the prompt from
position 0 and overwrites the entries gathered so far; once complete they are never
recomputed. All of this state lives on the Sequence, so a finished, aborted or preempted
request leaves nothing behind in any registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlite.engine.core.sched_output import SchedulerOutput
    from vlite.engine.core.sequence import Sequence

# Rows of logits materialised at once: 256 x a 49152-token vocabulary x 4 bytes = 48 MiB.
_ROWS_PER_SLICE = 256


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability (nats, float32 model distribution) and its rank in that
    distribution (1 = most likely), vLLM's ``Logprob`` (its ``decoded_token`` is added by the
    server)."""

    logprob: float
    rank: int


# Per prompt token: None for the first token, else {token_id: Logprob} holding the prompt
# token itself and the ``prompt_logprobs`` most likely tokens at that position.
PromptLogprobs = list[dict[int, Logprob] | None]


def needs_prompt_logprobs(seq: Sequence) -> bool:
    """True while ``seq`` asked for prompt logprobs and has not got all of them."""
    return seq.sampling_params.prompt_logprobs is not None and seq.prompt_logprobs is None


@dataclass(frozen=True, slots=True)
class PromptLogprobsRows:
    """Which rows of one step yield one sequence's prompt logprobs (plain data: it travels in
    ``StepInput`` to whichever process holds the model, every tensor-parallel rank included).

    seq_id: the sequence. first: index of the first prompt token these rows predict (tokens).
    row: the step row (flattened token index) of the chunk's first position.
    targets: the prompt tokens predicted by rows ``row .. row + len(targets) - 1``.
    k: how many most likely alternatives each entry also holds (the request's ``prompt_logprobs``).
    """

    seq_id: int
    first: int
    row: int
    targets: list[int]
    k: int


def plan_prompt_logprobs(sched: SchedulerOutput) -> list[PromptLogprobsRows]:
    """The rows of each scheduled chunk whose logits give prompt logprobs (engine process).
    Sequences that do not need them are skipped; a chunk that predicts no prompt token (the
    prompt's last position only) still gets an empty plan, so its completion is recorded."""
    plans: list[PromptLogprobsRows] = []
    offset = 0
    for item in sched.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        row = offset
        offset += item.num_new_tokens
        if not needs_prompt_logprobs(seq):
            continue
        # positions start .. min(end, P - 1) - 1 predict prompt tokens start + 1 .. min(end, P) - 1
        last = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
        plans.append(PromptLogprobsRows(seq.seq_id, start + 1, row, list(seq.prompt_token_ids[start + 1:last + 1]),
                                        seq.sampling_params.prompt_logprobs))
    return plans


def compute_prompt_logprobs(model, hidden: torch.Tensor,
                            plans: list[PromptLogprobsRows]) -> dict[int, tuple[int, list]]:
    """The prompt logprobs of the planned rows, from the step's hidden states.

    Args:
        model: has ``compute_logits(hidden [N, H]) -> [N, vocab]`` (None on tensor-parallel
            ranks other than 0; every rank still calls it, since the gather is a collective).
        hidden: [T, H], the step's hidden states (rows in ``StepInput`` order).
        plans: from ``plan_prompt_logprobs``.

    Returns:
        {seq_id: (first token index, entries)} where entries[j] is the Logprob dict of prompt
        token ``first + j``; {} on ranks other than 0.
    """
    results: dict[int, tuple[int, list]] = {}
    for plan in plans:
        entries: list = []
        targets, k, n = plan.targets, plan.k, len(plan.targets)
        for lo in range(0, n, _ROWS_PER_SLICE):
            hi = min(lo + _ROWS_PER_SLICE, n)
            logits = model.compute_logits(hidden[plan.row + lo:plan.row + hi])
            if logits is None:  # a tensor-parallel rank other than 0
                continue
            logprobs = logits.float().log_softmax(-1)
            target = torch.tensor(targets[lo:hi], dtype=torch.long, device=logprobs.device)
            chosen = logprobs.gather(1, target[:, None])
            ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
            chosen = chosen[:, 0].tolist()
            if k:
                top = torch.topk(logprobs, k, dim=-1)
                top_ids, top_vals = top.indices.tolist(), top.values.tolist()
            for j in range(hi - lo):
                entry = {targets[lo + j]: Logprob(chosen[j], ranks[j])}
                if k:
                    for r, (tid, val) in enumerate(zip(top_ids[j], top_vals[j]), start=1):
                        entry.setdefault(tid, Logprob(val, r))
                entries.append(entry)
        results[plan.seq_id] = (plan.first, entries)
    return results


def record_prompt_logprobs(seq: Sequence, first: int, entries: list, chunk_end: int) -> None:
    """Store one chunk's entries on ``seq`` (overwriting any from before a preemption); once
    the chunk reaches the end of the prompt (``chunk_end`` >= prompt length, positions), the
    list is complete and moves to ``seq.prompt_logprobs``."""
    partial = seq.partial_prompt_logprobs or [None]
    partial = partial[:first] + entries
    if chunk_end >= seq.num_prompt_tokens:
        seq.prompt_logprobs = partial
        seq.partial_prompt_logprobs = None
    else:
        seq.partial_prompt_logprobs = partial


__all__ = ["Logprob", "PromptLogprobs", "PromptLogprobsRows", "compute_prompt_logprobs", "needs_prompt_logprobs",
           "plan_prompt_logprobs", "record_prompt_logprobs"]
