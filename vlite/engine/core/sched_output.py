"""The step's two messages between the scheduler and the model runner (vLLM's
``SchedulerOutput`` and ``ModelRunnerOutput``): what one step runs, and what it sampled.

They live apart from both sides, so that the scheduler (request life) and the runner (the
forward and the sampler) each import this file and never each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vlite.engine.core.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: ``num_new_tokens`` tokens starting at its
    ``num_computed_tokens``; ``sample`` is True when the chunk reaches its last token.
    ``num_forks``: parallel sampling (n > 1) after the prompt: the runner also samples the
    first token of each of the ``n - 1`` samples still to be forked from this sequence."""

    seq: Sequence
    num_new_tokens: int
    sample: bool
    num_forks: int = 0


@dataclass
class SchedulerOutput:
    """What one step runs, everything the runner needs. ``scheduled`` lists decodes first,
    then prefill chunks; ``block_tables`` maps each scheduled sequence id to its block table
    (physical block ids); ``blocks_to_copy`` lists copy-on-write (src, dst) block pairs to
    apply before the forward; ``keep_logits`` asks the runner for the raw logits of the
    sampled rows (to fork n samples or rank beams)."""

    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    keep_logits: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SamplerOutput:
    """token_ids: one sampled id per row. logprobs: per row, {token_id: logprob} (natural log,
    of the model's unprocessed distribution) for the sampled token and the ``logprobs`` most
    likely tokens, or None when not requested."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


@dataclass
class ForkSamples:
    """The first tokens of the ``n - 1`` samples to fork from one sequence (sample ``i`` is row
    ``i - 1``), drawn from that sequence's logits, and each sample's own generator (a seeded
    request: seed + i, already advanced past this draw; None: the engine's shared generator)."""

    sampled: SamplerOutput
    generators: list[torch.Generator | None]


@dataclass
class StepResult:
    """Sampled tokens for the sequences that reached their last token this step."""

    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput
    # [len(sampled_seqs), vocab] float32 logits before sampling, when asked for (beams)
    logits: torch.Tensor | None = None
    # {seq_id: (first prompt token index, entries)}: prompt logprobs this step's chunks yielded
    prompt_logprobs: dict[int, tuple[int, list]] = field(default_factory=dict)
    # {seq_id: ForkSamples}: the first tokens of the samples to fork from that sequence (n > 1)
    forks: dict[int, ForkSamples] = field(default_factory=dict)
