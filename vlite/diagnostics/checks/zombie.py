"""Zombie requests: requests that go on after their client left (disconnect, abort, timeout).

For every request the client gave up on, the time from the client leaving to the release of
the request's blocks (its last block release, or its finish when it held none), the engine
steps in between, and the tokens the engine generated after the client left. The engine side
comes from its introspection point (``EngineView.request_history``: finish time, last release
time and step from the bounded release history, output tokens); over HTTP from
``/debug/blocks``, else from the running-request gauge (the time from the last client leaving
to ``vlite:num_requests_running`` reading 0).

Threshold (documented in docs/leak-check.md): a request is a ZOMBIE when it outlived its client
by more than ``threshold_steps`` engine steps (default 2) where the steps are known (in
process, where the abort is applied at once), else by more than ``threshold_s`` seconds
(default 1 s: over HTTP the server notices a closed connection within its next event-loop
turn), or when the engine generated more than ``threshold_steps`` tokens after the client left
(in process). A request whose blocks were never released is a leak, not a zombie: it is in
the leak sections and counted here as ``not_released``.
"""

from __future__ import annotations

import statistics

DEFAULT_THRESHOLD_S = 1.0
DEFAULT_THRESHOLD_STEPS = 2
_LEFT = ("aborted", "abort-raised", "stalled")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def zombie_check(results, request_history: dict[str, dict], *, threshold_s: float = DEFAULT_THRESHOLD_S,
                 threshold_steps: int = DEFAULT_THRESHOLD_STEPS, gauge_lag_s: float | None = None) -> dict:
    """Rows per request the client left, their distribution, and the zombies.

    ``request_history``: request_id -> RequestHistory fields (finished, finished_time,
    released_time, released_step, num_output_tokens). Times in seconds, steps in engine steps.
    """
    rows, not_released = [], []
    for r in results:
        if r.outcome not in _LEFT or r.abort_time is None:
            continue
        h = request_history.get(r.request_id)
        if h is None:
            continue
        if not h.get("finished"):
            not_released.append(r.request_id)
            continue
        ends = [t for t in (h.get("finished_time"), h.get("released_time")) if t is not None]
        if not ends:
            continue
        outlived_s = max(0.0, max(ends) - r.abort_time)
        steps = None
        if r.abort_step is not None and h.get("released_step") is not None:
            steps = max(0, h["released_step"] - r.abort_step)
        tokens = None
        if r.tokens_at_abort is not None and r.abort_step is not None:
            tokens = max(0, int(h.get("num_output_tokens") or 0) - r.tokens_at_abort)
        if steps is not None:
            zombie = steps > threshold_steps
        else:
            zombie = outlived_s > threshold_s
        zombie = zombie or (tokens is not None and tokens > threshold_steps)
        rows.append({"request_id": r.request_id, "client_action": r.action_label, "outlived_s": round(outlived_s, 4),
                     "outlived_steps": steps, "tokens_after_leaving": tokens, "zombie": zombie})
    secs = [row["outlived_s"] for row in rows]
    toks = [row["tokens_after_leaving"] for row in rows if row["tokens_after_leaving"] is not None]
    zombies = [row for row in rows if row["zombie"]]
    dist = {"n": len(rows), "p50_s": _pct(secs, 0.5), "p90_s": _pct(secs, 0.9), "p99_s": _pct(secs, 0.99),
            "max_s": max(secs, default=None), "mean_s": round(statistics.fmean(secs), 4) if secs else None,
            "max_steps": max((row["outlived_steps"] for row in rows if row["outlived_steps"] is not None),
                             default=None),
            "tokens_after_leaving_total": sum(toks) if toks else None, "max_tokens_after_leaving": max(toks, default=None)}
    if gauge_lag_s is not None and gauge_lag_s > threshold_s:
        zombies.append({"request_id": None, "client_action": "(running-request gauge)", "outlived_s": gauge_lag_s,
                        "outlived_steps": None, "tokens_after_leaving": None, "zombie": True})
    return {"threshold_s": threshold_s, "threshold_steps": threshold_steps, "distribution": dist,
            "gauge_lag_s": gauge_lag_s, "zombies": zombies, "not_released": not_released, "requests": rows}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def lines(z: dict | None) -> list[str]:
    """Console / report.md lines: the distribution and each zombie."""
    if not z:
        return []
    d = z["distribution"]
    if not d["n"] and z.get("gauge_lag_s") is None:
        return ["zombie requests: no aborted request to measure"]
    out = [f"client left -> blocks released, {d['n']} aborted request{'' if d['n'] == 1 else 's'}: p50 {_ms(d['p50_s'])}, p90 {_ms(d['p90_s'])}, "
           f"max {_ms(d['max_s'])} (max {d['max_steps']} engine steps); tokens generated after the client left: "
           f"{d['tokens_after_leaving_total']} in all, max {d['max_tokens_after_leaving']} per request "
           f"(a request is a ZOMBIE when its blocks outlive its client by more than {z['threshold_steps']} engine "
           f"steps, or {z['threshold_s']} s where steps are unknown)"]
    if z.get("gauge_lag_s") is not None:
        out.append(f"running-request gauge read 0 {z['gauge_lag_s']:.3f} s after the last client left")
    for row in z["zombies"][:12]:
        out.append(f"ZOMBIE {row['request_id']} ({row['client_action']}): outlived its client by "
                   f"{row['outlived_s']} s, {row['outlived_steps']} steps, {row['tokens_after_leaving']} tokens")
    return out
