"""Beam search over forked sequences, scored as transformers' ``generate(num_beams=W)`` does.

Each step, every running beam's next-token log-probabilities are added to its cumulative
score; the best ``K = max(2, 1 + num_eos) * W`` continuations over all beams are ranked; a
continuation that ends (EOS, or max_tokens reached) and ranks in the top W becomes a finished
hypothesis scored ``sum_logprobs / generated_len ** length_penalty``; the best W that go on
become the next beams. Search stops when no running beam can beat the worst of W finished
hypotheses (transformers' default ``early_stopping=False`` heuristic) or every continuation
ended. Beams live in the engine as sequences: a beam chosen twice is forked (blocks shared by
ref_count, copy-on-write on the next write), a beam not chosen is freed (pruned).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlite.engine.core.sequence import Sequence

_NEG = -1.0e9


@dataclass
class Hypothesis:
    """A finished beam: its output tokens and length-normalised score."""

    score: float
    token_ids: list[int]
    ends_with_eos: bool


@dataclass
class Continuation:
    """A running beam for the next step: extend ``parent`` with ``token``."""

    parent: Sequence
    token: int
    cumulative_logprob: float


@dataclass
class BeamState:
    """Search state of one request. ``pending`` holds the logits of beams that have run
    this step, until every running beam has."""

    width: int
    length_penalty: float
    max_tokens: int
    eos_token_ids: frozenset[int]
    running: list[Sequence] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    improvable: bool = True
    done: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.running) and all(s.seq_id in self.pending for s in self.running)

    def step(self) -> list[Continuation]:
        """Rank continuations of all running beams; update finished hypotheses; return the
        next beams (empty when the search is done)."""
        beams = self.running
        logprobs = torch.stack([self.pending.pop(s.seq_id) for s in beams]).float().log_softmax(-1)
        scores = torch.tensor([s.cumulative_logprob for s in beams])[:, None] + logprobs
        vocab = logprobs.shape[-1]
        k = min(max(2, 1 + len(self.eos_token_ids)) * self.width, scores.numel())
        top_scores, top_idx = torch.topk(scores.flatten(), k)
        gen_len = beams[0].num_output_tokens + 1  # generated tokens including the new one
        at_max = gen_len >= self.max_tokens
        continuations: list[Continuation] = []
        new_finished: list[Hypothesis] = []
        any_open = False
        for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
            parent, token = beams[idx // vocab], idx % vocab
            is_eos = token in self.eos_token_ids
            if is_eos or at_max:
                if rank < self.width and self.improvable:
                    new_finished.append(Hypothesis(score / gen_len ** self.length_penalty,
                                                   parent.output_token_ids + [token], is_eos))
            else:
                any_open = True
                if len(continuations) < self.width:
                    continuations.append(Continuation(parent, token, score))
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[:self.width]
        if continuations and self.improvable:
            best_running = continuations[0].cumulative_logprob / gen_len ** self.length_penalty
            worst_finished = self.finished[-1].score if len(self.finished) == self.width else _NEG
            self.improvable = best_running > worst_finished
        self.done = not any_open or not self.improvable or not continuations
        return [] if self.done else continuations

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return self.finished[:n]
