"""Workload sources for the leak checker: synthetic, a JSONL trace, or a ShareGPT file.

Every source yields ``RequestSpec``s with an arrival offset and a planned client action
(see actions.py). The JSONL schema is documented in docs/reference.md.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from vlite.diagnostics.workload.actions import ACTION_KINDS, ClientAction, plan_action

# Common English words that are one token each in Llama-style BPE vocabularies (with a leading
# space), so that a synthetic prompt of n words is close to n tokens.
_WORDS = ["the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "by", "at", "from", "this", "be", "are", "it", "was", "an", "or", "have", "not", "but", "which", "one", "all", "were", "can", "more", "when", "there", "has", "their", "time", "will", "about", "if", "up", "out", "so", "what", "into", "than", "other", "some", "them", "only", "new", "these", "also", "any", "may", "first", "two", "over", "such", "after", "most", "year", "made", "where", "people", "work", "world", "well", "way", "even", "back", "good", "high", "life", "very", "long", "state", "through", "great", "last", "many", "same", "part", "under", "take", "house", "water", "small", "home", "light", "city", "place"]


class WorkloadError(ValueError):
    """A workload file or option that cannot be used (the message says which line or field)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to replay.

    arrival_s: offset from the start of the run, seconds.
    prompt: text; prompt_len is its approximate length in tokens.
    max_tokens: most output tokens; ignore_eos makes the output exactly that long.
    n: samples per request (parallel sampling; the samples share the prompt's KV blocks).
    """

    request_id: str
    arrival_s: float
    prompt: str
    prompt_len: int
    max_tokens: int
    action: ClientAction = field(default_factory=ClientAction)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True
    client_tag: str | None = None
    n: int = 1  # samples per request: n > 1 forks sequences that share the prompt's blocks
    # Everything else a client can say (vLLM's SamplingParams names; see docs/reference.md):
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    beam_width: int = 1  # > 1: beam search (temperature 0); the n best beams are returned
    chat: bool = False  # the prompt is one user message, rendered with the model's chat template
    # "responses": sent to the Responses API (/v1/responses, the prompt as its input) over HTTP,
    # with ``store`` (whether the server keeps the response for previous_response_id and GET);
    # "": /v1/chat/completions or /v1/completions by ``chat``
    api: str = ""
    store: bool = False
    # Resolved by a greedy calibration run of the same prompt before the replay (calibrate.py):
    stop_token_at: int | None = None  # stop on the token greedy decoding puts at this output index
    stop_string_at: int | None = None  # stop on a string spanning output tokens k and k + 1
    # More SamplingParams fields by vLLM's name (logit_bias, prompt_logprobs, repetition_penalty,
    # top_k, min_p, allowed_token_ids, bad_words, structured_outputs as a dict of its fields, ...);
    # over HTTP the same fields of vLLM's OpenAI API. Not hashed (a dict).
    extra_params: dict = field(default_factory=dict, hash=False)
    # More prompts of the same request (a multi-prompt /v1/completions; in process one
    # all-or-none ``add_requests``): one engine request each, ids ``<request_id>-<p>`` with p = 0
    # for ``prompt``. ``OVER_MAX_MODEL_LEN`` stands for a prompt longer than the target's
    # max_model_len (``expand_prompts``), which the engine refuses after the others were admitted.
    extra_prompts: tuple[str, ...] = ()

    @property
    def stream(self) -> bool:
        return self.action.streams

    def sampling_params(self):
        """The engine's SamplingParams for this request.

        Raises:
            ValueError: a field out of range (SamplingParams' message names it).
        """
        from vlite.engine import SamplingParams, StructuredOutputsParams

        extra = dict(self.extra_params)
        if isinstance(extra.get("structured_outputs"), dict):
            extra["structured_outputs"] = StructuredOutputsParams(**extra["structured_outputs"])
        if extra.get("logit_bias"):
            extra["logit_bias"] = {int(k): float(v) for k, v in extra["logit_bias"].items()}
        return SamplingParams(max_tokens=self.max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos, n=self.n,
                              stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), logprobs=self.logprobs,
                              beam_width=self.beam_width, **extra)


OVER_MAX_MODEL_LEN = "<a prompt longer than max_model_len>"


def expand_prompts(spec: RequestSpec, max_model_len: int) -> list[str]:
    """Every prompt of ``spec`` (``prompt``, then ``extra_prompts``), each ``OVER_MAX_MODEL_LEN``
    written out as ``max_model_len + 16`` words (tokens) of filler: longer than any request fits."""
    over = " ".join(["the"] * (max_model_len + 16))
    return [spec.prompt, *(over if p == OVER_MAX_MODEL_LEN else p for p in spec.extra_prompts)]


def engine_request_ids(spec: RequestSpec) -> list[str]:
    """The engine request ids of ``spec``: its id, or ``<id>-<p>`` per prompt of a multi-prompt
    request (as the API server names them, ``RequestInfo.engine_request_id``)."""
    if not spec.extra_prompts:
        return [spec.request_id]
    return [f"{spec.request_id}-{p}" for p in range(1 + len(spec.extra_prompts))]


# Pieces of the "distinct" source's made-up words (onset + nucleus + coda, one or two syllables):
# about 3,000 syllables and 10 million words, which BPE vocabularies split into 2.5 tokens a word
# on average, drawn from thousands of different tokens (SmolLM2's tokenizer, measured 2026-12-06).
# A prompt gets words until their estimated tokens (``_tokens_of``) reach the length asked for.
_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "ch",
           "dr", "fl", "gr", "kl", "pr", "sh", "st", "th", "tr")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "oo", "ie")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "t", "k", "x")
# --prompt-source: where synthetic prompt text comes from (docs/leak-check/replay.md, "Workload variety").
PROMPT_SOURCES = ("distinct", "word-list")
DEFAULT_PROMPT_SOURCE = "distinct"


def _made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(1, 2)))


def _tokens_of(word: str) -> float:
    """Tokens a made-up word (with its leading space) takes on a BPE vocabulary: a fit of SmolLM2's
    tokenizer over 3,000 of them (1.1 for 2 letters, 3.2 for 7, 4.1 for 10)."""
    return 0.3 + 0.40 * len(word)  # 0.42 fits; 0.40 errs long, so a "long" prompt is long enough


def synthetic_prompt(rng: random.Random, num_tokens: int, source: str = "word-list") -> str:
    """About ``num_tokens`` tokens of filler text from ``source`` (``PROMPT_SOURCES``).

    ``word-list``: words of a 90-word list, one token each: prompts differ, but every token is one
    of about 90, so a cache keyed by a word or a short window of text fills after a few requests.
    ``distinct``: made-up words from a seeded syllable generator (about 10 million words, 2.5
    tokens each on a BPE vocabulary): no prompt repeats, nor most of its words (one-syllable
    words, 3,000 of them, do), its tokens come from thousands, and greedy outputs differ with it.
    Plain text, so an HTTP target sends it as any prompt. Either source makes the same draws
    from ``rng``.

    Raises:
        ValueError: an unknown source.
    """
    if source not in PROMPT_SOURCES:
        raise ValueError(f"unknown prompt source {source!r}; choose one of: {', '.join(PROMPT_SOURCES)}")
    listed = " ".join(rng.choice(_WORDS) for _ in range(max(1, num_tokens)))
    if source == "word-list":
        return listed
    # the same draws from ``rng`` as the word list, so that a workload's plan (kinds, lengths,
    # client actions) is the same whichever the source; the text is seeded by them
    rng = random.Random(listed)
    words, est = [], 0.0
    while est < num_tokens or not words:
        words.append(_made_up_word(rng))
        est += _tokens_of(words[-1])
    return " ".join(words)


def arrival_offsets(rng: random.Random, n: int, request_rate: float) -> list[float]:
    """Arrival offsets (s): all at 0 for an infinite rate, else a Poisson process of ``request_rate`` req/s."""
    if request_rate == float("inf"):
        return [0.0] * n
    if request_rate <= 0:
        raise WorkloadError(f"--request-rate {request_rate}: must be > 0 requests/s, or inf (all at once)")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def _check_range(name: str, lo: int, hi: int) -> None:
    if lo < 1 or hi < lo:
        raise WorkloadError(f"{name} {lo}:{hi}: must be MIN:MAX tokens with 1 <= MIN <= MAX")


def seeded_arrivals(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    request_rate: float, seed: int) -> tuple[random.Random, list[float]]:
    """Check a generated workload's count and length ranges (tokens), then return its seeded
    random source and the arrival offsets (seconds) of its requests.

    Raises:
        WorkloadError: a bad count, length range or rate.
    """
    if num_requests < 1:
        raise WorkloadError(f"num requests must be >= 1, got {num_requests}")
    _check_range("--input-len", *input_len)
    _check_range("--output-len", *output_len)
    rng = random.Random(seed)
    return rng, arrival_offsets(rng, num_requests, request_rate)


def synthetic_workload(num_requests: int, *, input_len: tuple[int, int] = (16, 64),
                       output_len: tuple[int, int] = (8, 48), request_rate: float = float("inf"),
                       abort_rate: float = 0.0, abort_mode: str = "mix", seed: int = 0,
                       prefix: str = "lc", n: int = 1, prompt_source: str = "word-list") -> list[RequestSpec]:
    """``num_requests`` requests with uniform input/output lengths (tokens) and seeded actions;
    ``n`` samples each (n > 1 with temperature 1 and a per-request seed, so samples differ);
    prompt text from ``prompt_source`` (``synthetic_prompt``).

    Raises:
        WorkloadError: a bad count, length range or rate.
        ValueError: a bad abort rate or mode.
    """
    rng, arrivals = seeded_arrivals(num_requests, input_len, output_len, request_rate, seed)
    specs = []
    for i, t in enumerate(arrivals):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        action = plan_action(rng, abort_rate, abort_mode, n_out)
        sampling = {"n": n, "temperature": 1.0, "seed": i} if n > 1 else {}
        specs.append(RequestSpec(f"{prefix}-{i:05d}", t, synthetic_prompt(rng, n_in, prompt_source), n_in, n_out, action,
                                 **sampling))
    return specs


def jsonl_workload(path: Path, *, abort_rate: float = 0.0, abort_mode: str = "mix", seed: int = 0,
                   prefix: str = "lc", warn: Callable[[str], None] | None = None) -> list[RequestSpec]:
    """Read a JSONL trace, one request per line, checked against ``TRACE_SCHEMA`` (documented in
    docs/reference.md, "JSONL trace schema").

    Lines without ``client_action`` get one drawn from ``abort_rate``/``abort_mode``. Keys not in
    the schema are ignored, and ``warn`` (default: ``warnings.warn``) is called once with a line
    listing them (and the key each was probably meant to be).

    Raises:
        WorkloadError: a directory or unreadable file, a line that is not JSON, or a field with a
            wrong type or value: the message names the line, the field and the allowed values.
    """
    path = Path(path)
    if path.is_dir():
        raise WorkloadError(f"trace {path} is a directory; give a JSONL file (one JSON object per line)")
    rng = random.Random(seed)
    specs = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from exc
    unknown: dict[str, list[int]] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}, line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object, "
                                f"e.g. {_EXAMPLE_LINE} (schema: docs/reference.md, JSONL trace schema)") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{path}, line {lineno}: a JSON {type(row).__name__.replace('str', 'string')} where "
                                f"a JSON object is needed, e.g. {_EXAMPLE_LINE}")
        for key in row:
            if key not in TRACE_SCHEMA:
                unknown.setdefault(key, []).append(lineno)
        try:
            specs.append(_spec_from_row(row, rng, len(specs), abort_rate, abort_mode, prefix))
        except (ValueError, TypeError) as exc:
            raise WorkloadError(f"{path}, line {lineno}: {exc}") from None
    if unknown:
        (warn or _warn)(f"{path}: ignored unknown {'key' if len(unknown) == 1 else 'keys'} " + "; ".join(
            f"{k} (line{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls[:5]))}{', ...' if len(ls) > 5 else ''}"
            f"{_did_you_mean(k)})" for k, ls in unknown.items()) + f"; known keys: {', '.join(TRACE_SCHEMA)}")
    if not specs:
        raise WorkloadError(f"trace {path} has no requests")
    return sorted(specs, key=lambda s: s.arrival_s)


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, stacklevel=3)


def _did_you_mean(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, TRACE_SCHEMA, n=1)
    return f": did you mean {close[0]}?" if close else ""


_EXAMPLE_LINE = '{"prompt": "Hello", "max_tokens": 16}'


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Every key a JSONL trace line may have: key -> (check of the JSON value, the allowed values in
# words). docs/reference.md, "JSONL trace schema", documents the same table.
TRACE_SCHEMA: dict[str, tuple[Callable[[object], bool], str]] = {
    "arrival_s": (lambda v: _is_number(v) and v >= 0, "a number >= 0 (seconds from the start)"),
    "prompt": (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string"),
    "prompt_len": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (tokens)"),
    "prefix_id": (lambda v: v is None or isinstance(v, str) and bool(v), "a non-empty string or null"),
    "prefix_len": (lambda v: _is_int(v) and v >= 1, "an integer >= 1 (tokens)"),
    "chat": (lambda v: isinstance(v, bool), "true or false"),
    "api": (lambda v: v in ("completions", "chat", "responses"), "completions, chat or responses (over HTTP)"),
    "store": (lambda v: isinstance(v, bool), "true or false (api responses: keep the response on the server)"),
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "min_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "seed": (lambda v: v is None or _is_int(v), "an integer or null"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "n": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "beam_width": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "stop": (lambda v: v is None or (isinstance(v, str) and bool(v)) or (
        isinstance(v, list) and all(isinstance(x, str) and x for x in v)), "a non-empty string, a list of them, or null"),
    "stop_token_ids": (lambda v: v is None or isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
                       "a list of integers >= 0, or null"),
    "stop_token_at": (lambda v: v is None or _is_int(v) and v >= 0, "an output token index >= 0, or null"),
    "stop_string_at": (lambda v: v is None or _is_int(v) and v >= 0, "an output token index >= 0, or null"),
    "logprobs": (lambda v: v is None or _is_int(v) and 0 <= v <= 20, "an integer 0..20, or null"),
    "stream": (lambda v: isinstance(v, bool), "true or false"),
    "client_action": (lambda v: isinstance(v, str) and v.partition(":")[0] in ACTION_KINDS,
                      "one of " + ", ".join(ACTION_KINDS) + " (abort-after-tokens and disconnect-stream take :k "
                      "tokens, client-timeout :seconds)"),
    "request_id": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "client_tag": (lambda v: v is None or isinstance(v, str), "a string or null"),
}
TRACE_KEYS = tuple(TRACE_SCHEMA)


def _check_fields(row: dict) -> None:
    """Raise ValueError naming the first field whose value the schema does not allow."""
    for key, value in row.items():
        rule = TRACE_SCHEMA.get(key)
        if rule is not None and not rule[0](value):
            raise ValueError(f"field {key} must be {rule[1]}, got {json.dumps(value)}")


def shared_prefix(prefix_id: str, num_tokens: int) -> str:
    """The shared prefix named ``prefix_id``: about ``num_tokens`` tokens of filler text, the same
    for every request that names it (so its full KV blocks are prefix-cache hits)."""
    return synthetic_prompt(random.Random(f"prefix:{prefix_id}"), num_tokens)


def _spec_from_row(row: dict, rng: random.Random, index: int, abort_rate: float, abort_mode: str,
                   prefix: str) -> RequestSpec:
    _check_fields(row)
    if "prompt" in row:
        prompt = row["prompt"]
        prompt_len = len(prompt.split())
    elif "prompt_len" in row:
        prompt_len = row["prompt_len"]
        prompt = synthetic_prompt(rng, prompt_len)
    else:
        raise ValueError("no prompt: give field prompt (a non-empty string) or prompt_len (an integer >= 1 tokens)")
    if row.get("prefix_id") is not None:
        plen = row.get("prefix_len", 48)
        prompt = shared_prefix(row["prefix_id"], plen) + " " + prompt
        prompt_len += plen
    elif "prefix_len" in row:
        raise ValueError("field prefix_len needs field prefix_id (the name of the shared prefix)")
    max_tokens = row.get("max_tokens", 16)
    if "client_action" in row:
        try:
            action = ClientAction.parse(row["client_action"])
        except ValueError:
            raise ValueError(f"field client_action must be {TRACE_SCHEMA['client_action'][1]}, got "
                             f"{json.dumps(row['client_action'])}") from None
    else:
        action = plan_action(rng, abort_rate, abort_mode, max_tokens)
    if "stream" in row and row["stream"] != action.streams:
        raise ValueError(f"field stream is {json.dumps(row['stream'])}, which contradicts client_action "
                         f"{action.kind} (client-timeout is the one non-streaming action)")
    spec = RequestSpec(row.get("request_id", f"{prefix}-{index:05d}"), float(row.get("arrival_s", 0.0)), prompt,
                       prompt_len, max_tokens, action, temperature=float(row.get("temperature", 0.0)),
                       top_p=float(row.get("top_p", 1.0)), seed=row.get("seed"), ignore_eos=row.get("ignore_eos", True),
                       client_tag=row.get("client_tag"), n=row.get("n", 1),
                       stop=_str_list(row["stop"]) if row.get("stop") is not None else (),
                       stop_token_ids=tuple(row.get("stop_token_ids") or ()), min_tokens=row.get("min_tokens", 0),
                       logprobs=row.get("logprobs"), beam_width=row.get("beam_width", 1),
                       chat=row.get("chat", False) or row.get("api") == "chat",
                       api="responses" if row.get("api") == "responses" else "", store=row.get("store", False),
                       stop_token_at=row.get("stop_token_at"), stop_string_at=row.get("stop_string_at"))
    spec.sampling_params()  # validates the fields together (the message names the field)
    if (spec.stop_token_at is not None or spec.stop_string_at is not None) and spec.temperature != 0:
        raise ValueError("fields stop_token_at / stop_string_at need temperature 0 (they are found by a greedy run)")
    return spec


def _str_list(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def sharegpt_workload(path: Path, num_requests: int, *, count_tokens: Callable[[str], int] | None = None,
                      max_output_len: int = 64, request_rate: float = float("inf"), abort_rate: float = 0.0,
                      abort_mode: str = "mix", seed: int = 0, prefix: str = "lc") -> list[RequestSpec]:
    """Read a ShareGPT file (``[{id, conversations: [{from, value}, ...]}]``) as vLLM's benchmarks do:
    the first turn is the prompt, the second turn's length (tokens) the reference output length,
    capped at ``max_output_len``. Conversations with fewer than two turns are skipped.

    Raises:
        WorkloadError: unreadable or malformed file, or no usable conversation.
    """
    count = count_tokens or (lambda text: max(1, int(len(text.split()) * 1.3)))
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read ShareGPT file {path}: {exc}") from exc
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of conversations")
    rng = random.Random(seed)
    pairs = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2 or not str(turns[0].get("value", "")).strip():
            continue
        prompt = str(turns[0]["value"])
        pairs.append((prompt, count(prompt), max(1, min(max_output_len, count(str(turns[1].get("value", "")))))))
        if len(pairs) == num_requests:
            break
    if not pairs:
        raise WorkloadError(f"{path}: no conversation with a prompt and a reply")
    arrivals = arrival_offsets(rng, len(pairs), request_rate)
    return [RequestSpec(f"{prefix}-{i:05d}", t, p, n_in, n_out, plan_action(rng, abort_rate, abort_mode, n_out))
            for i, (t, (p, n_in, n_out)) in enumerate(zip(arrivals, pairs))]


def with_action(spec: RequestSpec, action: ClientAction) -> RequestSpec:
    """A copy of ``spec`` with another client action."""
    return replace(spec, action=action)
