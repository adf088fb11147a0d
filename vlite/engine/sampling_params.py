"""Sampling parameters, validated on construction (fields and defaults follow vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's output.

    max_tokens: most output tokens (>= 1). min_tokens: EOS and stop ids are masked before this.
    temperature: 0 means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens (-1 or 0 = all). top_p: nucleus mass in (0, 1].
    min_p: drop tokens whose probability is below min_p * max probability, in [0, 1].
    repetition_penalty: > 0, 1 = off (CTRL's rule, as in HF and vLLM: divides positive
        logits, multiplies negative ones, for every token in prompt or output).
    presence_penalty / frequency_penalty: in [-2, 2], OpenAI's definition over output tokens.
    seed: per-request generator seed, so a request samples the same text in any batch.
    stop: strings that end the output (not included in it). stop_token_ids: ids that end it.
    ignore_eos: keep going past EOS until max_tokens.
    n: sequences returned per request; with n > 1 the samples share the prompt's KV blocks.
    logprobs: also return the log-probabilities of the top ``logprobs`` tokens (0..20).
    beam_width: > 1 runs beam search (greedy scores, as transformers' ``num_beams``); the
        ``n`` best beams are returned. length_penalty: beam score = logprob sum / length**penalty.

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
               f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        _check(isinstance(self.beam_width, int) and self.beam_width >= 1,
               f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.beam_width > 1:
            _check(self.temperature == 0.0 and not self.uses_penalties,
                   "beam search (beam_width > 1) needs temperature 0 and no penalties")
            _check(self.n <= self.beam_width, f"n ({self.n}) must be <= beam_width ({self.beam_width})")
            _check(not self.stop, "beam search does not support stop strings")
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
