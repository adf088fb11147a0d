"""Replaying a workload: how a request's prompt reaches a tokenizer, and what a replay records
(per-request results as the client saw them, the idle points between waves), whichever target
ran it (in process, HTTP, black box, or a server's log)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlite.diagnostics.workload.sources import RequestSpec


@dataclass
class RequestResult:
    """What happened to one replayed request, as the client saw it.

    outcome: finished | aborted | rejected | error | abort-raised | engine-error (the engine raised
    on this request's add or step path) | lost | not-sent (the run was interrupted first, or the
    engine stopped stepping).
    times are ``time.time()`` seconds; ``detail`` says what the client observed
    (e.g. "aborted during prefill, 32/97 prompt tokens cached").
    """

    request_id: str
    action_kind: str
    action_label: str
    arrival_time: float
    outcome: str = "pending"
    finish_reason: str | None = None
    num_output_tokens: int = 0
    end_time: float | None = None
    abort_time: float | None = None
    detail: str = ""
    # At the abort: the engine step (in process; None over HTTP) and output tokens the client had.
    abort_step: int | None = None
    tokens_at_abort: int | None = None
    # A multi-prompt request: its engine requests' ids (``sources.engine_request_ids``). When it
    # is refused, ``abort_time`` is the refusal: those admitted before it must end there too.
    engine_request_ids: list[str] | None = None


@dataclass
class IdlePoint:
    """A moment when nothing was in flight: the trend's trough (used blocks, RSS bytes)."""

    time: float
    requests_completed: int
    num_used_blocks: int
    rss_bytes: int | None
    host: dict | None = None  # in process: anon_swap_bytes, containers {path: entries} (host_memory.py)


@dataclass
class ReplayResult:
    """Results per request (workload order) and the idle points seen."""

    requests: list[RequestResult]
    idle_points: list[IdlePoint] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    notes: list[str] = field(default_factory=list)
    # Over HTTP: per wave, seconds from the last client leaving to the running gauge reading 0.
    gauge_lags: list[float] = field(default_factory=list)
    # ... and the engine steps it ran in that time (where the server counts its steps)
    gauge_lag_steps: list[int] = field(default_factory=list)
    # Set when the replay was stopped early (Ctrl-C): what happened, in words; None for a full run.
    interrupted: str | None = None
    # Exceptions the engine (or, over HTTP, the server) raised on a path the replay drove
    # (``checks/engine_errors.py``): findings, each with its path, request id and traceback.
    engine_errors: list[dict] = field(default_factory=list)


# the detail both replays give a request cut off by the Ctrl-C (it did not end on its own)
CUT_BY_INTERRUPT = "the run was interrupted (Ctrl-C)"


def request_counts(replay: ReplayResult) -> dict[str, int]:
    """How far a replay's requests got: ``total``; ``sent``; ``ended`` (finished, or ended by their
    own client action or the server, before any Ctrl-C); ``cut`` (in flight at the Ctrl-C, aborted
    by it); ``in_flight`` (still pending, no end seen); ``not_sent``."""
    rs = replay.requests
    not_sent = sum(1 for r in rs if r.outcome == "not-sent")
    cut = sum(1 for r in rs if r.outcome != "not-sent" and r.detail.startswith(CUT_BY_INTERRUPT))
    in_flight = sum(1 for r in rs if r.outcome in ("pending", "streaming"))
    sent = len(rs) - not_sent
    return {"total": len(rs), "sent": sent, "ended": sent - cut - in_flight, "cut": cut, "in_flight": in_flight,
            "not_sent": not_sent}


def render_prompt(tokenizer, spec: RequestSpec) -> str:
    """The prompt text the engine gets: a chat request's message rendered with the model's chat
    template (transformers' ``apply_chat_template``), else the prompt as is."""
    if spec.chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": spec.prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return spec.prompt
