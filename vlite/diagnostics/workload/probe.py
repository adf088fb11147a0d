"""The requests of the cache-versus-leak probe (checks/cache_probe.py): rounds drawn from the run's
own workload, either repeated as they were or with new prompts no request repeats."""

from __future__ import annotations

import random
from dataclasses import replace

from vlite.diagnostics.workload.sources import RequestSpec, synthetic_prompt

PREFIX = "cp"  # request ids of the probe: cp-r<round>-<i> (repeated), cp-d<round>-<i> (distinct)


def template(specs: list[RequestSpec], round_size: int) -> list[RequestSpec]:
    """The first ``round_size`` requests of the run (all-paths: a cycle through every kind),
    arriving at once; the probe's rounds are copies of them.

    Raises:
        ValueError: no request, or ``round_size`` < 1.
    """
    if not specs or round_size < 1:
        raise ValueError(f"the cache probe needs requests and a round size >= 1, got {len(specs)} and {round_size}")
    return [replace(s, arrival_s=0.0) for s in specs[:round_size]]


def repeated_round(base: list[RequestSpec], index: int) -> list[RequestSpec]:
    """``base`` again with new request ids and the same prompts (and everything else)."""
    return [replace(s, request_id=f"{PREFIX}-r{index}-{i:03d}") for i, s in enumerate(base)]


def distinct_round(base: list[RequestSpec], index: int, seed: int = 0) -> list[RequestSpec]:
    """``base`` with new request ids and new prompts of the same lengths from the ``distinct``
    source, seeded by (``seed``, ``index``): no two rounds share a prompt. A chat request keeps its
    message (the model's EOS finish depends on it)."""
    rng = random.Random(f"cache-probe:{seed}:{index}")
    return [replace(s, request_id=f"{PREFIX}-d{index}-{i:03d}",
                    prompt=s.prompt if s.chat else synthetic_prompt(rng, s.prompt_len, "distinct"))
            for i, s in enumerate(base)]
