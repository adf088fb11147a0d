"""The default leak-check workload: synthetic requests that walk every allocation, free and
finish path of the engine, several times each.

Each request gets one *kind*, drawn from a seeded RNG with the weights below (and the first
requests cycle through every kind, so that even a small run has each at least once):

=================  =====================================================================
kind               what it exercises
=================  =====================================================================
plain              prefill, decode append, length finish (ignore_eos)
shared-prefix      one of 4 shared 48-token prefixes: prefix-cache hits
samples            n = 2..3 (temperature 1, seeded): fork, copy-on-write of the shared
                   partial block, several samples finishing (and aborted) apart
beam               beam search, width 3, n = 2: forks, copy-on-write, pruned beams
chat-eos           a chat message with the model's chat template, ignore_eos off: an
                   EOS finish on an instruction-tuned model
stop-token         greedy, stop_token_ids from a calibration run: a stop-token finish
stop-string        greedy, a stop string spanning two tokens from a calibration run
=================  =====================================================================

Client actions come from ``--abort-rate`` / ``--abort-mode`` as for the plain synthetic
workload; in process, ``mix`` also draws ``abort-preempted`` and ``abort-resumed`` (a client
cannot see a preemption over HTTP). Preemption itself needs a KV budget smaller than a wave:
``vlite leak-check`` sizes the cache for that (docs/leak-check.md).
"""

from __future__ import annotations

import random

from vlite.diagnostics.workload.actions import ClientAction, plan_action
from vlite.diagnostics.workload.sources import (
    RequestSpec,
    seeded_arrivals,
    shared_prefix,
    synthetic_prompt,
)

KINDS: dict[str, float] = {"plain": 0.30, "shared-prefix": 0.18, "samples": 0.12, "beam": 0.08, "chat-eos": 0.12,
                           "stop-token": 0.10, "stop-string": 0.10}
NUM_PREFIXES = 4
PREFIX_LEN = 48  # tokens: three full 16-token blocks
LONG_PROMPT = 300  # tokens: an abort-prefill request's prompt, longer than a 256-token step budget
LATE_OUTPUT = 48  # tokens: the least output of a request planned to abort after a preemption
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # tokens per step for the default run: long prompts are chunked
CHAT_MESSAGES = ["Say hello.", "What is 2+2?", "Name a color.", "Reply with one word: yes or no?",
                 "What is the capital of France?", "Give me a short greeting.", "Is water wet? Answer briefly.",
                 "Name one fruit.", "What day comes after Monday?", "Count to three."]


def all_paths_workload(num_requests: int, *, input_len: tuple[int, int] = (16, 64),
                       output_len: tuple[int, int] = (8, 32), request_rate: float = float("inf"),
                       abort_rate: float = 0.3, abort_mode: str = "mix", seed: int = 0, prefix: str = "lc",
                       in_process: bool = True, wave_size: int | None = None) -> list[RequestSpec]:
    """``num_requests`` requests of every kind above (tokens for lengths, req/s for the rate).

    A request planned to abort during prefill gets a ``LONG_PROMPT``-token prompt, so that a
    256-token step budget really chunks it. Within each wave of ``wave_size`` requests
    (default: a fifth of them, leak-check's default ``--idle-every``) the requests planned to
    abort after a preemption come last, as plain requests with at least ``LATE_OUTPUT`` output
    tokens: the scheduler preempts the most recently admitted, and they grow the longest.

    Raises:
        WorkloadError: a bad count, length range or rate.
        ValueError: a bad abort rate or mode.
    """
    rng, arrivals = seeded_arrivals(num_requests, input_len, output_len, request_rate, seed)
    names, weights = list(KINDS), list(KINDS.values())
    specs = []
    for i, t in enumerate(arrivals):
        kind = names[i] if i < len(names) else rng.choices(names, weights)[0]
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        action = plan_action(rng, abort_rate, abort_mode, n_out)
        if in_process and abort_mode == "mix" and action.is_abort and rng.random() < 0.25:
            action = ClientAction(rng.choice(("abort-preempted", "abort-resumed")))
        if action.kind == "abort-prefill" and kind in ("plain", "shared-prefix"):
            n_in = LONG_PROMPT
        if action.kind in ("abort-preempted", "abort-resumed"):
            kind, n_out = "plain", max(n_out, LATE_OUTPUT)  # admitted last, growing longest: preempted
        specs.append(_make(kind, i, t, n_in, n_out, action, rng, prefix))
    wave = wave_size or max(1, num_requests // 5)
    late = ("abort-preempted", "abort-resumed")
    out = []
    for start in range(0, len(specs), wave):
        chunk = specs[start:start + wave]
        out += [s for s in chunk if s.action.kind not in late] + [s for s in chunk if s.action.kind in late]
    return out


def suggest_num_blocks(specs: list[RequestSpec], wave_size: int, block_size: int = 16) -> int:
    """A KV cache (blocks) about a quarter of what the average wave asks for, so that recompute
    preemption is certain, yet a little more than the largest single request (so each fits)."""
    def need(s: RequestSpec) -> int:
        return max(s.n, s.beam_width) * -(-(s.prompt_len + s.max_tokens + 8) // block_size)

    demands = [need(s) for s in specs]
    waves = [sum(demands[i:i + wave_size]) for i in range(0, len(demands), max(1, wave_size))]
    return max(max(demands) + 4, sum(waves) // max(1, len(waves)) // 4)


def _make(kind: str, i: int, t: float, n_in: int, n_out: int, action: ClientAction, rng: random.Random,
          prefix: str) -> RequestSpec:
    rid, tag = f"{prefix}-{i:05d}", f"path:{kind}"
    prompt = synthetic_prompt(rng, n_in)
    if kind == "shared-prefix":
        pid = f"p{rng.randrange(NUM_PREFIXES)}"
        return RequestSpec(rid, t, shared_prefix(pid, PREFIX_LEN) + " " + prompt, n_in + PREFIX_LEN, n_out, action,
                           client_tag=tag)
    if kind == "samples":
        return RequestSpec(rid, t, prompt, n_in, n_out, action, temperature=1.0, seed=i, n=rng.choice((2, 3)),
                           client_tag=tag)
    if kind == "beam":
        return RequestSpec(rid, t, prompt, n_in, max(4, n_out // 2), action, n=2, beam_width=3, client_tag=tag)
    if kind == "chat-eos":
        return RequestSpec(rid, t, rng.choice(CHAT_MESSAGES), 16, 48, action, ignore_eos=False, chat=True,
                           client_tag=tag)
    k = rng.randint(1, max(1, min(6, n_out - 3)))
    if kind == "stop-token":
        return RequestSpec(rid, t, prompt, n_in, n_out, action, stop_token_at=k, client_tag=tag)
    if kind == "stop-string":
        return RequestSpec(rid, t, prompt, n_in, n_out, action, stop_string_at=k, client_tag=tag)
    return RequestSpec(rid, t, prompt, n_in, n_out, action, client_tag=tag)
