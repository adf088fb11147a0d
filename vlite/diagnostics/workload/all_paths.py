"""The default leak-check workload: synthetic requests that walk every allocation, free and
finish path of the engine, several times each.

Each request gets one *kind*, drawn from a seeded RNG with the weights below (and the first
requests cycle through every kind, so that even a small run has each at least once, then a
second shared-prefix request on the first one's prefix):

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
structured         structured output, each form in turn: a JSON schema, a regex, a
                   choice, a Lark grammar, a JSON object (grammar matchers, "stop:grammar")
logprobs           logprobs and prompt_logprobs (over HTTP: a completion with echo)
sampling-knobs     seeded random sampling with top_k/top_p/min_p, the three penalties,
                   logit_bias, bad_words, min_tokens; every other one allowed_token_ids
=================  =====================================================================

After the first cycle through the kinds, when the run aborts in ``mix`` mode, *abort probes*
make sure the request families whose bookkeeping differs are aborted where it matters: n > 1
with a long prompt during its chunked prefill, n > 1 during decode, beam search during decode,
structured output during decode, and in process a plain request after its preemption and one
after its resumption. After the drawn requests come a few extra ones: a structured-output request
aborted while it waits; a multi-prompt completion whose second prompt is longer than
max_model_len (refused after the first was admitted: ``sources.OVER_MAX_MODEL_LEN``); a request
the engine admits and prefills,
then refuses for its own parameters (a choice constraint with ``allowed_token_ids`` [0]); and
over HTTP the chat route with each client action (a long prompt and answer, so that the client
leaves before it ends: ``API_PROBES``).

Client actions come from ``--abort-rate`` / ``--abort-mode`` as for the plain synthetic
workload; in process, ``mix`` also draws ``abort-preempted`` and ``abort-resumed`` (a client
cannot see a preemption over HTTP). Preemption itself needs a KV budget smaller than a wave:
``vlite leak-check`` sizes the cache for that (docs/leak-check/replay.md, "Coverage").
"""

from __future__ import annotations

import random
from dataclasses import replace

from vlite.diagnostics.workload.actions import ClientAction, plan_action
from vlite.diagnostics.workload.sources import (
    OVER_MAX_MODEL_LEN,
    RequestSpec,
    seeded_arrivals,
    shared_prefix,
    synthetic_prompt,
)

KINDS: dict[str, float] = {"plain": 0.20, "shared-prefix": 0.14, "samples": 0.10, "beam": 0.07, "chat-eos": 0.10,
                           "stop-token": 0.08, "stop-string": 0.08, "structured": 0.11, "logprobs": 0.06,
                           "sampling-knobs": 0.06}
# (kind, client action) planned right after the first cycle when the run aborts at all
# (beam search streams nothing before it ends: its probe is a client that times out mid-decode)
ABORT_PROBES = (("samples", "abort-prefill"), ("samples", "abort-after-tokens"), ("beam", "client-timeout"),
                ("structured", "abort-after-tokens"))
# Extra requests after the drawn ones (so that every drawn request stays as it was):
# a constraint aborted while waiting, a multi-prompt request with one prompt refused, a request
# refused once running (over HTTP then the chat route's probes)
API_PATH_PROBES = (("structured", "abort-waiting"), ("multi-prompt-rejected", "complete"),
                   ("rejected-after-admission", "complete"))
# ... over HTTP also the chat route with each client action (the completions route has them above)
API_PROBES = (("chat-eos", "abort-prefill"), ("chat-eos", "disconnect-stream"), ("chat-eos", "client-timeout"),
              ("plain", "abort-prefill"), ("plain", "client-timeout"))  # ... and the completions route's two
# that the drawn requests and abort probes leave to timing (their requests may end first)
# A chat probe: 64 more prompt tokens and 128 output tokens (ignore_eos): about 15 blocks of 16,
# which fit a 25-block pool and a 512-token max_model_len; its client times out after 0.05 s,
# before it ends even on a tiny model
API_PROBE_PROMPT = 64
API_PROBE_OUTPUT = 128
API_PROBE_TIMEOUT_S = 0.05
# Structured-output forms, in turn (StructuredOutputsParams fields).
STRUCTURED_FORMS = (
    {"json": {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}},
    {"regex": "[a-z]{2,6}( [a-z]{2,6}){1,3}"},
    {"choice": ["yes", "no", "maybe"]},
    {"grammar": 'start: "x" NUM+\nNUM: /[0-9]/'},
    {"json_object": True},
)
# A choice constraint with allowed_token_ids [0] (a special token in the vocabularies we know): after
# its prefill the engine finds no token both allow and ends it for its own parameters (a 400)
REJECTED_CHOICE = ("yes", "no")
KNOB_TOKEN_IDS = tuple(range(100, 164))  # token ids every vocabulary has (logit_bias, allowed_token_ids)
NUM_PREFIXES = 4
PREFIX_LEN = 48  # tokens: three full 16-token blocks
LONG_PROMPT = 300  # tokens: an abort-prefill request's prompt, longer than a 256-token step budget
LONG_PROMPT_SAMPLES = 136  # the same for n = 2 samples: longer than a 128-token budget, and its 2 x (prompt +
# max_tokens) admission fits the pool of a 60-request run
LATE_OUTPUT = 48  # tokens: the least output of a request planned to abort after a preemption
DEFAULT_MAX_NUM_BATCHED_TOKENS = 128  # tokens per step for the default run: long prompts are chunked
CHAT_MESSAGES = ["Say hello.", "What is 2+2?", "Name a color.", "Reply with one word: yes or no?",
                 "What is the capital of France?", "Give me a short greeting.", "Is water wet? Answer briefly.",
                 "Name one fruit.", "What day comes after Monday?", "Count to three."]


def all_paths_workload(num_requests: int, *, input_len: tuple[int, int] = (16, 64),
                       output_len: tuple[int, int] = (8, 32), request_rate: float = float("inf"),
                       abort_rate: float = 0.3, abort_mode: str = "mix", seed: int = 0, prefix: str = "lc",
                       in_process: bool = True, wave_size: int | None = None,
                       prompt_source: str = "word-list") -> list[RequestSpec]:
    """``num_requests`` requests of every kind above (tokens for lengths, req/s for the rate),
    then, when the run aborts in ``mix`` mode and has room for every abort probe (17 requests in
    process, 15 over HTTP), the extra probes (3 in process, 8 over HTTP; client tag
    ``probe:<kind>``).

    Prompt text comes from ``prompt_source`` (``sources.synthetic_prompt``); the shared prefixes
    and the chat messages stay fixed on purpose (prefix-cache hits, EOS finishes).

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
    probes = ABORT_PROBES if abort_rate > 0 and abort_mode == "mix" else ()
    if probes and in_process:  # a client sees preemption only in process
        # ... and a beam search's decode progress, though it streams nothing: abort it after
        # tokens instead of by a client timeout, which a busy run lets fire while it still waits
        probes = tuple((k, "abort-after-tokens" if k == "beam" else p) for k, p in probes)
        probes += (("plain", "abort-preempted"), ("plain", "abort-resumed"))
    # the issue-42 probes are extra requests at the head of the first wave: every drawn request, the
    # waves (``is_extra_probe``: not counted) and the KV pool sized for them (suggest_num_blocks)
    # stay as they were before they came
    cycle = names + ["shared-prefix"]  # a second shared-prefix request, admitted later: a certain prefix hit
    # (only in a run long enough for every abort probe: a smaller one stays as it was)
    tail = ((API_PATH_PROBES + (() if in_process else API_PROBES))
            if probes and num_requests >= len(cycle) + len(probes) else ())
    arrivals = arrivals + [arrivals[-1]] * len(tail)

    def probe_at(i: int) -> tuple[str, str] | None:
        if 0 <= i - len(cycle) < len(probes):
            return probes[i - len(cycle)]
        return tail[i - num_requests] if i >= num_requests else None
    for i, t in enumerate(arrivals):
        kind = cycle[i] if i < len(cycle) else rng.choices(names, weights)[0]
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        action = plan_action(rng, abort_rate, abort_mode, n_out)
        if in_process and abort_mode == "mix" and action.is_abort and rng.random() < 0.25:
            action = ClientAction(rng.choice(("abort-preempted", "abort-resumed")))
        if i == len(cycle) - 1:
            action = ClientAction()  # the prefix hit must happen: this one runs to the end
        if probe_at(i) is not None:
            kind, probe = probe_at(i)
            # an n > 1 prefill probe: 2 samples, few tokens (the engine admits n x (prompt + max_tokens))
            n_out = 8 if probe == "abort-prefill" else max(n_out, 12)
            action = (ClientAction(probe, after_tokens=2) if probe in ("abort-after-tokens", "disconnect-stream")
                      else ClientAction(probe, timeout_s=0.3) if probe == "client-timeout" else ClientAction(probe))
            if probe in ("abort-preempted", "abort-resumed"):
                n_out = max(n_out, LATE_OUTPUT)
        if action.kind == "abort-prefill" and kind in ("plain", "shared-prefix", "logprobs", "sampling-knobs"):
            n_in = LONG_PROMPT
        elif action.kind == "abort-prefill" and kind == "samples":
            n_in = LONG_PROMPT_SAMPLES  # admitted as 2 x (prompt + max_tokens)
        if action.kind in ("abort-preempted", "abort-resumed"):
            kind, n_out = "plain", max(n_out, LATE_OUTPUT)  # admitted last, growing longest: preempted
        nth = sum(1 for s in specs if s.client_tag == f"path:{kind}")  # this kind's count so far
        spec = _make(kind, i, t, n_in, n_out, action, rng, prefix, nth, prompt_source)
        if i >= num_requests:  # an extra probe, named as such
            spec = replace(spec, client_tag=f"probe:{kind}")
        if probe_at(i) in API_PROBES:
            # the chat route's probe must still run when its client acts: a long answer (no EOS)
            # behind a long prompt (a prefill of its own), so the client leaves before it ends
            more = synthetic_prompt(rng, API_PROBE_PROMPT, prompt_source)
            spec = replace(spec, prompt=spec.prompt + " " + more if spec.chat else more,
                           prompt_len=16 + API_PROBE_PROMPT, max_tokens=API_PROBE_OUTPUT, ignore_eos=True,
                           action=ClientAction("client-timeout", timeout_s=API_PROBE_TIMEOUT_S)
                           if action.kind == "client-timeout" else action)
        specs.append(spec)
    wave = wave_size or max(1, num_requests // 5)
    late = ("abort-preempted", "abort-resumed")
    drawn, extra = specs[:num_requests], specs[num_requests:]
    out = []
    for start in range(0, len(drawn), wave):
        chunk = drawn[start:start + wave]
        out += [s for s in chunk if s.action.kind not in late] + [s for s in chunk if s.action.kind in late]
    # the extra probes open the first wave (no wave of their own): what they allocate once (the
    # tokenizer's work on a prompt over max_model_len) falls in the warm-up, which the
    # host-memory fit leaves out
    return extra + out


def is_extra_probe(spec: RequestSpec) -> bool:
    """An extra probe (client tag ``probe:<kind>``): it rides in the first wave and is
    not counted in a wave's size (``--idle-every``), so the drawn requests' waves stay the same."""
    return (spec.client_tag or "").startswith("probe:")


def suggest_num_blocks(specs: list[RequestSpec], wave_size: int, block_size: int = 16) -> int:
    """A KV cache (blocks) about a quarter of what the average wave asks for, so that recompute
    preemption is certain, yet a little more than the largest single request (so each fits)."""
    def need(s: RequestSpec) -> int:
        return max(s.n, s.beam_width) * -(-(s.prompt_len + s.max_tokens + 8) // block_size)

    demands = [need(s) for s in specs if not is_extra_probe(s)]  # the extra probes hold no pool
    waves = [sum(demands[i:i + wave_size]) for i in range(0, len(demands), max(1, wave_size))]
    return max(max(demands) + 4, sum(waves) // max(1, len(waves)) // 4)


def _make(kind: str, i: int, t: float, n_in: int, n_out: int, action: ClientAction, rng: random.Random,
          prefix: str, nth: int = 0, prompt_source: str = "word-list") -> RequestSpec:
    rid, tag = f"{prefix}-{i:05d}", f"path:{kind}"
    prompt = synthetic_prompt(rng, n_in, prompt_source)
    if kind == "shared-prefix":
        pid = "p0" if nth < 2 else f"p{rng.randrange(NUM_PREFIXES)}"  # the first two share one prefix
        return RequestSpec(rid, t, shared_prefix(pid, PREFIX_LEN) + " " + prompt, n_in + PREFIX_LEN, n_out, action,
                           client_tag=tag)
    if kind == "samples":
        n = 2 if action.kind == "abort-prefill" else rng.choice((2, 3))  # a long prompt twice fits the pool
        return RequestSpec(rid, t, prompt, n_in, n_out, action, temperature=1.0, seed=i, n=n, client_tag=tag)
    if kind == "beam":
        return RequestSpec(rid, t, prompt, n_in, max(4, n_out // 2), action, n=2, beam_width=3, client_tag=tag)
    if kind == "chat-eos":
        return RequestSpec(rid, t, rng.choice(CHAT_MESSAGES), 16, 48, action, ignore_eos=False, chat=True,
                           client_tag=tag)
    if kind == "multi-prompt-rejected":  # the second prompt cannot fit: refused after the first was admitted
        return RequestSpec(rid, t, prompt, n_in, n_out, action, client_tag=tag, extra_prompts=(OVER_MAX_MODEL_LEN,))
    if kind == "rejected-after-admission":  # admitted and prefilled, then refused: no allowed token fits the choice
        return RequestSpec(rid, t, prompt, n_in, n_out, action, ignore_eos=False, client_tag=tag,
                           extra_params={"structured_outputs": {"choice": list(REJECTED_CHOICE)},
                                         "allowed_token_ids": [0]})
    if kind == "structured":
        form = STRUCTURED_FORMS[nth % len(STRUCTURED_FORMS)]
        return RequestSpec(rid, t, prompt, n_in, max(12, n_out), action, ignore_eos=False, client_tag=tag,
                           extra_params={"structured_outputs": dict(form)})
    if kind == "logprobs":
        return RequestSpec(rid, t, prompt, n_in, n_out, action, logprobs=2, client_tag=tag,
                           extra_params={"prompt_logprobs": 1})
    if kind == "sampling-knobs":
        knobs = {"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.1, "presence_penalty": 0.3,
                 "frequency_penalty": 0.2, "logit_bias": {KNOB_TOKEN_IDS[0]: 2.0, KNOB_TOKEN_IDS[1]: -2.0},
                 "bad_words": ["zebra"]}
        if nth % 2:
            knobs["allowed_token_ids"] = list(KNOB_TOKEN_IDS)
        return RequestSpec(rid, t, prompt, n_in, n_out, action, temperature=0.8, top_p=0.95, seed=i,
                           min_tokens=min(2, n_out), client_tag=tag, extra_params=knobs)
    k = rng.randint(1, max(1, min(6, n_out - 3)))
    if kind == "stop-token":
        return RequestSpec(rid, t, prompt, n_in, n_out, action, stop_token_at=k, client_tag=tag)
    if kind == "stop-string":
        return RequestSpec(rid, t, prompt, n_in, n_out, action, stop_string_at=k, client_tag=tag)
    return RequestSpec(rid, t, prompt, n_in, n_out, action, client_tag=tag)
