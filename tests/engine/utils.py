"""Shared helpers for the engine tests without a model (after vLLM's ``tests/v1/core/utils.py``):
a small scheduler, a sequence, and a fake runner output (``StepResult``) that books a step
through the scheduler's own ``update_from_output``."""

from __future__ import annotations

import torch

from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.core.sched_output import ForkSamples, SamplerOutput, SchedulerOutput, StepResult
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams

BLOCK = 4  # tokens per KV block
VOCAB = 16


def make_scheduler(num_blocks: int = 32, budget: int = 64, max_num_seqs: int = 8, prefix_caching: bool = False,
                   max_model_len: int | None = None) -> Scheduler:
    """A scheduler over ``num_blocks`` blocks of ``BLOCK`` tokens, ``budget`` tokens per step."""
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
                     CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching), num_blocks,
                     max_model_len=max_model_len)


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 8, **params) -> Sequence:
    """A sequence of request ``request_id`` over the prompt token ids ``prompt``."""
    return Sequence(request_id, None, prompt, SamplingParams(max_tokens=max_tokens, **params),
                    RequestOrigin(request_id))


def fake_result(out: SchedulerOutput, token: int, logits: bool = False) -> StepResult:
    """The runner's answer to ``out``: ``token`` for every sampled row and for the first token of
    every sample to fork (n > 1), and, with ``logits``, raw logits peaked at ``token`` [rows, VOCAB]."""
    seqs = [item.seq for item in out.scheduled if item.sample]
    raw = None
    if logits:
        raw = torch.full((len(seqs), VOCAB), -1e9)
        raw[:, token] = 0.0
    forks = {item.seq.seq_id: ForkSamples(SamplerOutput([token] * item.num_forks, [None] * item.num_forks),
                                          [None] * item.num_forks)
             for item in out.scheduled if item.num_forks}
    return StepResult(seqs, SamplerOutput([token] * len(seqs), [None] * len(seqs)), raw, forks=forks)


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule one step, book ``token`` for every sampled row, and return the step's output."""
    out = sched.schedule()
    sched.update_from_output(out, fake_result(out, token))
    return out


def held_blocks(sched: Scheduler) -> int:
    """Blocks held by live sequences (free and cached-evictable blocks excluded)."""
    return sched.kv_cache_manager.num_used_blocks
