"""What the engine returns per request (shape follows vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlite.engine.core.sequence import RequestOrigin


@dataclass
class CompletionOutput:
    """One generated sequence. text/token_ids are cumulative; finish_reason is None while running.

    logprobs: per output token, {token_id: logprob} when requested.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # beam search: the length-normalised beam score


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of one request after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    origin: RequestOrigin
    metrics: RequestMetrics
    error: str | None = None
    # Why ``error`` happened: "request" (the request's own parameters contradict each other, e.g.
    # structured output with allowed_token_ids that exclude every token the grammar allows; a
    # client error, HTTP 400) or "engine" (anything else, HTTP 500).
    error_kind: str | None = None
    # Characters at the end of outputs[i].text a stream must hold back (possible stop-string start).
    stream_holdback: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: per prompt token None (the first) or {token_id:
    # Logprob} (vlite.engine.core.prompt_logprobs), once the whole prompt has run; else None.
    prompt_logprobs: list | None = None
