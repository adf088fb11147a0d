"""Client actions: what a replay client does with each request (complete, or abort it somehow).

Actions are chosen per request from a seeded RNG, so a run is reproducible, and each
request carries its action into its origin, where the leak report finds it again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# kind -> what the client does; the kinds are also the values of ``--abort-mode``.
ACTION_KINDS: dict[str, str] = {
    "complete": "read the whole response",
    "abort-waiting": "abort while the request is still waiting (before it is scheduled)",
    "abort-prefill": "abort during prefill (after K/V of some prompt tokens are cached, before the first token)",
    "abort-after-tokens": "abort after k output tokens",
    "disconnect-stream": "disconnect mid-stream after k chunks",
    "client-timeout": "non-streaming request whose client times out after t seconds",
    # Only in-process (a client cannot see preemption over HTTP); used by the scenarios, traces
    # and the default all-paths workload.
    "abort-preempted": "abort once the request has been preempted (recompute)",
    "abort-resumed": "abort once the request has been preempted and scheduled again (resumed)",
}
IN_PROCESS_ONLY = ("abort-preempted", "abort-resumed")
ABORT_KINDS = tuple(k for k in ACTION_KINDS if k not in ("complete", *IN_PROCESS_ONLY))
ABORT_MODES = ABORT_KINDS + ("mix",)


@dataclass(frozen=True)
class ClientAction:
    """One request's planned client action.

    kind: a key of ``ACTION_KINDS``.
    after_tokens: k for abort-after-tokens (tokens) and disconnect-stream (chunks).
    timeout_s: t for client-timeout, seconds.
    """

    kind: str = "complete"
    after_tokens: int = 0
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown client action {self.kind!r}; known: {', '.join(ACTION_KINDS)}")

    @property
    def is_abort(self) -> bool:
        return self.kind != "complete"

    @property
    def streams(self) -> bool:
        """Whether the client reads a stream (client-timeout is the non-streaming one)."""
        return self.kind != "client-timeout"

    @property
    def label(self) -> str:
        """The words the leak report uses, e.g. "disconnect after 3 chunks"."""
        if self.kind == "abort-after-tokens":
            return f"abort after {self.after_tokens} tokens"
        if self.kind == "disconnect-stream":
            return f"disconnect after {self.after_tokens} chunks"
        if self.kind == "client-timeout":
            return f"client timeout after {self.timeout_s:.2f} s (non-streaming)"
        return {"complete": "complete", "abort-waiting": "abort while waiting",
                "abort-prefill": "abort during prefill", "abort-preempted": "abort after preemption",
                "abort-resumed": "abort after preemption and resumption"}[self.kind]

    @classmethod
    def parse(cls, text: str) -> ClientAction:
        """Parse a kind with an optional ``:k`` or ``:seconds`` argument ("disconnect-stream:3").

        Raises:
            ValueError: an unknown kind or a bad argument.
        """
        kind, _, arg = text.strip().partition(":")
        if kind == "client-timeout":
            return cls(kind, timeout_s=float(arg or 0.5))
        if kind in ("abort-after-tokens", "disconnect-stream"):
            return cls(kind, after_tokens=int(arg or 2))
        if arg:
            raise ValueError(f"client action {kind!r} takes no argument")
        return cls(kind)


def plan_action(rng: random.Random, abort_rate: float, abort_mode: str, max_tokens: int) -> ClientAction:
    """Draw one request's action: abort with probability ``abort_rate``, of kind ``abort_mode``
    (or a uniformly drawn kind for "mix"). k is drawn below ``max_tokens`` so that an abort
    after k tokens really cuts the request short.

    Raises:
        ValueError: an unknown mode or a rate outside [0, 1].
    """
    if not 0.0 <= abort_rate <= 1.0:
        raise ValueError(f"abort rate must be in [0, 1], got {abort_rate}")
    if abort_mode not in ABORT_MODES:
        raise ValueError(f"unknown abort mode {abort_mode!r}; known: {', '.join(ABORT_MODES)}")
    if rng.random() >= abort_rate:
        return ClientAction()
    kind = rng.choice(ABORT_KINDS) if abort_mode == "mix" else abort_mode
    k = rng.randint(1, max(1, min(8, max_tokens - 1)))
    return ClientAction(kind, after_tokens=k if kind in ("abort-after-tokens", "disconnect-stream") else 0,
                        timeout_s=round(rng.uniform(0.2, 1.5), 2) if kind == "client-timeout" else 0.0)
