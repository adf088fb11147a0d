"""Sampling parameters, validated on construction (fields and defaults follow vLLM), and what a
request asks structured output for (vLLM's ``StructuredOutputsParams``, here as in vLLM's
``sampling_params.py``: a plain dataclass, no torch and no grammar library at import;
``vlite.engine.core.structured_output`` compiles it)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

# The constraint fields of StructuredOutputsParams; exactly one is set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One request's output constraint (vLLM's ``StructuredOutputsParams``; exactly one of the
    first five fields).

    json: a JSON Schema (a dict, or its JSON text); the output is a JSON value valid against it
        (llguidance's JSON Schema subset; an unsupported keyword is an error, not ignored).
    regex: the whole output matches this regular expression (Rust ``regex`` syntax).
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar in Lark syntax or llama.cpp's GBNF.
    json_object: True: the output is a JSON object (OpenAI's JSON mode, as vLLM: ``{"type": "object"}``).
    disable_any_whitespace: no whitespace between JSON tokens (default: any JSON whitespace).
    disable_additional_properties: objects of ``json`` that do not say otherwise get
        ``"additionalProperties": false``.
    whitespace_pattern: a regex for the whitespace allowed between JSON tokens.

    Raises:
        ValueError: none or several constraints, or a field of the wrong type; the message
            names the field and what is allowed.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON Schema object, got "
                                 f"{type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty Lark or GBNF grammar")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False))

    def cache_key(self) -> str:
        """A canonical text naming this constraint and its options (the compiler cache's key)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties, self.whitespace_pattern], sort_keys=True)

    def to_llguidance(self) -> str:
        """The llguidance grammar text of this constraint.

        Raises:
            ValueError: a grammar that cannot be converted (e.g. malformed GBNF).
        """
        import llguidance

        kind = self.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            if self.disable_additional_properties:
                schema = _close_objects(schema)
            options: dict[str, Any] = {}
            if self.disable_any_whitespace:
                options["whitespace_flexible"] = False
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", self.choice)
        return llguidance.grammar_from("grammar", self.grammar)


def _close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``false`` (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# Documented bounds (docs/serve.md), shared by the engine and the OpenAI server's request schema.
# Outside them the arithmetic either overflows float32 (logits / 1e-300 is inf, then NaN) or the
# value has no meaning; vLLM's own checks are looser (e.g. no upper temperature bound).
MIN_TEMPERATURE = 0.01  # a positive temperature below this is refused (0 = greedy); vLLM clamps to 0.01
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 1e6
MAX_ABS_LENGTH_PENALTY = 10.0
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI: "values between -100 and 100"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed range, as vLLM validates it
MAX_TOP_K = 2**31 - 1  # any top_k >= the vocabulary size keeps every token


class RequestOutputKind(enum.Enum):
    """Which steps give a request a ``RequestOutput`` (vLLM's ``RequestOutputKind``).

    CUMULATIVE: every step that advanced or ended it (a stream, a client that watches
        tokens), with the text and tokens so far.
    FINAL_ONLY: only the step that ended it (``LLMEngine.generate``, vLLM's offline default):
        nothing is built or detokenized for it in between.
    """

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's output.

    max_tokens: most output tokens (>= 1). min_tokens: EOS and stop ids are masked before this.
    temperature: 0 means greedy; otherwise logits are divided by it, in [0.01, 100].
    top_k: keep the k most likely tokens (-1 or 0 = all; at most 2**31 - 1). top_p: nucleus
        mass in (0, 1].
    min_p: drop tokens whose probability is below min_p * max probability, in [0, 1].
    repetition_penalty: in [0.01, 1e6], 1 = off (CTRL's rule, as in HF and vLLM: divides
        positive logits, multiplies negative ones, for every token in prompt or output).
    presence_penalty / frequency_penalty: in [-2, 2], OpenAI's definition over output tokens.
    seed: per-request generator seed in int64 (as vLLM), so a request samples the same text in
        any batch.
    stop: strings that end the output (not included in it). stop_token_ids: ids that end it.
    ignore_eos: keep going past EOS until max_tokens.
    n: sequences returned per request; with n > 1 the samples share the prompt's KV blocks.
    logprobs: also return the log-probabilities of the top ``logprobs`` tokens (0..20).
    prompt_logprobs: also return the log-probabilities of every prompt token and of the top
        ``prompt_logprobs`` tokens at each prompt position (0..20; vLLM's extension); see
        vlite/engine/core/prompt_logprobs.py.
    logit_bias: {token id: bias added to its logit}, bias in [-100, 100] (OpenAI's logit_bias).
    allowed_token_ids: only these token ids can be sampled (vLLM); non-empty when given.
    bad_words: words that are never generated (vLLM): each word's token sequence, with and
        without a leading space, is blocked by masking its last token after its prefix.
        Token ids are checked against the vocabulary by the engine (vlite/engine/worker/logits_processors.py).
    beam_width: > 1 runs beam search (greedy scores, as transformers' ``num_beams``); the
        ``n`` best beams are returned. length_penalty: beam score = logprob sum / length**penalty,
        in [-10, 10].
    structured_outputs: constrain the output to a JSON schema, a JSON object, a regex, a choice
        or a grammar (``vlite.engine.core.structured_output``; vLLM's field); a dict is read as
        ``StructuredOutputsParams(**dict)``. Not with beam search.
    output_kind: which steps return an output for the request (``RequestOutputKind``;
        CUMULATIVE by default, FINAL_ONLY in ``LLMEngine.generate``).
    Every float must be finite; booleans are not accepted as integers.

    Raises:
        ValueError: any field out of range; the message names the field and the allowed range.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise ValueError(f"structured_outputs: {exc}") from None
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be StructuredOutputsParams or a dict, got {self.structured_outputs!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                   f"{name} must be a finite number, got {value!r}")
        for name in ("max_tokens", "min_tokens", "top_k", "n", "beam_width"):
            _check(_is_int(getattr(self, name)), f"{name} must be an integer, got {getattr(self, name)!r}")
        _check(self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check(-1 <= self.top_k <= MAX_TOP_K,
               f"top_k must be -1 (disabled), 0 (disabled) or a positive integer <= {MAX_TOP_K}, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 = off), "
               f"got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY,
               f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}], "
               f"got {self.length_penalty}")
        _check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            for tid, bias in self.logit_bias.items():
                _check(_is_int(tid) and tid >= 0, f"logit_bias keys must be token ids (integers >= 0), got {tid!r}")
                _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
                       and abs(bias) <= MAX_ABS_LOGIT_BIAS,
                       f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tid}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(bool(self.allowed_token_ids) and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                   f"got {self.allowed_token_ids!r}")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   f"bad_words must be non-blank strings, got {self.bad_words!r}")
        _check(self.beam_width >= 1,
               f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.beam_width > 1:
            _check(self.temperature == 0.0 and not self.uses_penalties,
                   "beam search (beam_width > 1) needs temperature 0 and no penalties")
            _check(self.n <= self.beam_width, f"n ({self.n}) must be <= beam_width ({self.beam_width})")
            _check(not self.stop, "beam search does not support stop strings")
            _check(not self.uses_logits_processors,
                   "beam search does not support logit_bias, allowed_token_ids or bad_words")
            _check(self.structured_outputs is None, "beam search does not support structured outputs")
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def uses_logits_processors(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad_words is set."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(value) -> bool:
    """An int that is not a bool (JSON ``true`` must not read as token id 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
