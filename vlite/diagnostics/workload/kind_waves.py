"""``--workload kind-waves``: waves of one request kind at a time, in rounds, for the fit of
memory growth per request kind (``diagnostics/checks/kind_growth.py``).

Each round serves one wave of every kind in ``KINDS`` order; the run waits for the engine to go
idle after every wave (``--idle-every`` is the wave size), so each interval between two idle
points holds one kind only. The first round is the fit's warm-up (each kind's first interval);
the later rounds give every kind two or more intervals: its growth per request and a 95%
confidence interval, per process.

=============  ===============================================================
kind           requests
=============  ===============================================================
plain          greedy, ignore_eos, length finish
n>1            n = 2, temperature 1, seeded
beam           beam search, width 2
structured     structured output, the all-paths forms in turn (JSON schema, regex, ...)
logprobs       logprobs = 2 and prompt_logprobs = 1
aborted        plain, the client aborts after 2 tokens
=============  ===============================================================
"""

from __future__ import annotations

from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.all_paths import STRUCTURED_FORMS
from vlite.diagnostics.workload.sources import RequestSpec, seeded_arrivals, synthetic_prompt

KINDS = ("plain", "n>1", "beam", "structured", "logprobs", "aborted")
MIN_ROUNDS = 4  # two of warm-up (kind_growth.WARMUP_INTERVALS), two or more per kind for a slope and its CI


def kind_wave_size(num_requests: int) -> int:
    """Requests per wave: ``num_requests`` spread over ``MIN_ROUNDS`` rounds of every kind, at least 2."""
    return max(2, num_requests // (len(KINDS) * MIN_ROUNDS))


def kind_waves_workload(num_requests: int, *, input_len: tuple[int, int] = (16, 64),
                        output_len: tuple[int, int] = (8, 32), seed: int = 0, prefix: str = "kw") -> list[RequestSpec]:
    """About ``num_requests`` requests (rounded down to whole rounds, at least ``MIN_ROUNDS``), in waves
    of ``kind_wave_size(num_requests)`` requests of one kind each; every request arrives at 0 s
    (the waves are made by the idle points, in list order).

    Raises:
        WorkloadError: a bad count or length range (``seeded_arrivals``).
    """
    wave = kind_wave_size(num_requests)
    rounds = max(MIN_ROUNDS, num_requests // (wave * len(KINDS)))
    total = rounds * wave * len(KINDS)
    rng, _ = seeded_arrivals(total, input_len, output_len, float("inf"), seed)
    specs: list[RequestSpec] = []
    for _round in range(rounds):
        for kind in KINDS:
            for _ in range(wave):
                i = len(specs)
                # the longest lengths, every time: each kind meets its allocator high-water marks (a
                # logprobs prompt's prompt_len x vocab logits) in its warm-up waves, not at random later
                n_in, n_out = input_len[1], output_len[1]
                specs.append(_make(kind, f"{prefix}-{i:05d}", synthetic_prompt(rng, n_in), n_in, n_out, i))
    return specs


def _make(kind: str, rid: str, prompt: str, n_in: int, n_out: int, i: int) -> RequestSpec:
    tag = f"kind:{kind}"
    if kind == "n>1":
        return RequestSpec(rid, 0.0, prompt, n_in, n_out, n=2, temperature=1.0, seed=i, client_tag=tag)
    if kind == "beam":
        return RequestSpec(rid, 0.0, prompt, n_in, max(4, n_out // 2), beam_width=2, client_tag=tag)
    if kind == "structured":
        form = STRUCTURED_FORMS[i % len(STRUCTURED_FORMS)]
        return RequestSpec(rid, 0.0, prompt, n_in, max(12, n_out), ignore_eos=False, client_tag=tag,
                           extra_params={"structured_outputs": dict(form)})
    if kind == "logprobs":
        return RequestSpec(rid, 0.0, prompt, n_in, n_out, logprobs=2, client_tag=tag,
                           extra_params={"prompt_logprobs": 1})
    if kind == "aborted":
        return RequestSpec(rid, 0.0, prompt, n_in, max(n_out, 8), ClientAction("abort-after-tokens", after_tokens=2),
                           client_tag=tag)
    return RequestSpec(rid, 0.0, prompt, n_in, n_out, client_tag=tag)
