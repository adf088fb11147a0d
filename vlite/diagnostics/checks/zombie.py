"""Zombie requests: requests that go on after their client left (disconnect, abort, timeout).

For every request the client gave up on, the time from the client leaving to the release of
the request's blocks (its last block release, or its finish when it held none), the engine
steps in between, and the tokens the engine generated after the client left. The engine side
comes from its introspection point (``EngineView.request_history``: finish time and step, last
release time and step from the bounded release history, output tokens); over HTTP from
``/debug/blocks``, else from the running-request gauge (the time, and the steps, from the last
client of a wave leaving to ``vlite:num_requests_running`` reading 0).

Threshold (documented in docs/architecture.md, "The leak check"), in the server's own pace: an abort lands at the
next step boundary at best, so on a slow engine a healthy release can come seconds after the
disconnect. A request is a ZOMBIE when its blocks outlived its client by more than
``threshold_steps`` engine steps (default 2, ``--zombie-threshold-steps``). The step at the
disconnect is the engine's own in process (the abort is applied at once); over HTTP it is the
``vlite:engine_steps_total`` counter the client sampled at or just after the disconnect
(``pace.step_at``: a lower bound of the steps outlived, so a healthy server is never a zombie
for want of samples), and there the request must also have outlived its client by more than the
wall-clock bound below (the HTTP layer notices a disconnect in its own time, during which a fast
engine runs many steps, and a loaded one's event loop is as slow as its steps). Where no step is known (a server without that counter or without
``/debug/blocks``), the bound is wall-clock: ``max(threshold_s, (threshold_steps + 1) x the p99
inter-token latency measured during the run)`` (``threshold_s`` default 1 s,
``--zombie-threshold-s``). In process, where its steps are unknown, a request with more than
``threshold_steps`` tokens generated after its client left is a zombie too. A request whose blocks were never released is
a leak, not a zombie: it is in the leak sections and counted here as ``not_released``.
"""

from __future__ import annotations

import statistics

from vlite.diagnostics.checks.pace import quantile, step_at

DEFAULT_THRESHOLD_S = 1.0
DEFAULT_THRESHOLD_STEPS = 2
_LEFT = ("aborted", "abort-raised", "stalled")


def wall_clock_bound(threshold_s: float, threshold_steps: int, step_time_s: float | None) -> float:
    """Seconds a request may outlive its client where steps are unknown: ``threshold_s``, or
    ``threshold_steps + 1`` steps (the one running at the disconnect, then the allowance) at the
    p99 step time ``step_time_s`` measured during the run, whichever is longer."""
    if step_time_s is None:
        return threshold_s
    return max(threshold_s, (threshold_steps + 1) * step_time_s)


def _end_step(h: dict) -> int | None:
    steps = [s for s in (h.get("released_step"), h.get("finished_step")) if s is not None]
    return max(steps) if steps else None


def _left_requests(results, request_history: dict[str, dict]):
    """``(result, engine request id, its history or None)`` for every engine request whose client
    left: aborted, timed out or gave up, and each admitted prompt of a multi-prompt request that
    was refused (its client had its error at ``abort_time``; sglang#28380, vllm#27420). The
    refused prompt itself, never admitted, has no history and is left out."""
    for r in results:
        refused = r.outcome == "rejected" and bool(r.engine_request_ids)
        if (r.outcome not in _LEFT and not refused) or r.abort_time is None:
            continue
        for rid in r.engine_request_ids or [r.request_id]:
            h = request_history.get(rid)
            if h is None and refused:
                continue
            yield r, rid, h


def _client_action(r) -> str:
    if r.outcome == "rejected":
        return f"{r.action_label}; refused, a multi-prompt request (a sibling prompt was rejected)"
    return r.action_label


def zombie_check(results, request_history: dict[str, dict], *, threshold_s: float = DEFAULT_THRESHOLD_S,
                 threshold_steps: int = DEFAULT_THRESHOLD_STEPS, gauge_lag_s: float | None = None,
                 gauge_lag_steps: int | None = None, step_timeline: list[tuple[float, int]] | None = None,
                 step_time_s: float | None = None) -> dict:
    """Rows per request the client left, their distribution, and the zombies.

    Args:
        results: the client's ``RequestResult``s (``abort_time`` in ``time.time()`` s; in process
            also ``abort_step``, the engine step at the abort, and ``tokens_at_abort``).
        request_history: request_id -> RequestHistory fields (finished, finished_time,
            finished_step, released_time, released_step, num_output_tokens). Steps in engine steps.
        threshold_s / threshold_steps: the bounds (module docstring).
        gauge_lag_s / gauge_lag_steps: over HTTP without per-request history, the longest time
            (s) and the most engine steps from the last client of a wave leaving to the running
            gauge reading 0.
        step_timeline: ``(time, engine step counter)`` reads sampled by the client (HTTP), for
            requests with no engine step of their own at the abort.
        step_time_s: the p99 step time (s; the inter-token latency) measured during the run; it
            scales the wall-clock bound (``wall_clock_bound``).

    Returns:
        ``{"threshold_s", "threshold_steps", "bound_s", "step_time_s", "step_source",
        "client_left", "distribution", "gauge_lag_s", "gauge_lag_steps", "zombies",
        "not_released", "unmeasured", "requests"}``; ``step_source`` is "engine", "sampled" (a
        lower bound) or None (no step known: judged in seconds against ``bound_s``).
    """
    bound_s = wall_clock_bound(threshold_s, threshold_steps, step_time_s)
    timeline = sorted(step_timeline or [])
    rows, not_released, unmeasured, left, sources = [], [], 0, 0, set()
    for r, rid, h in _left_requests(results, request_history):
        left += 1
        if h is None:
            unmeasured += 1
            continue
        if not h.get("finished"):
            not_released.append(rid)
            continue
        ends = [t for t in (h.get("finished_time"), h.get("released_time")) if t is not None]
        if not ends:
            unmeasured += 1
            continue
        outlived_s = max(0.0, max(ends) - r.abort_time)
        steps, source = None, None
        end_step = _end_step(h)
        if r.abort_step is not None:
            leave_step, source = r.abort_step, "engine"
        else:
            leave_step, source = (step_at(timeline, r.abort_time), "sampled") if timeline else (None, None)
        if end_step is not None and leave_step is not None:
            steps = max(0, end_step - leave_step)
            sources.add(source)
        tokens = None
        if r.tokens_at_abort is not None and r.abort_step is not None:
            tokens = max(0, int(h.get("num_output_tokens") or 0) - r.tokens_at_abort)
        if steps is None:
            zombie = outlived_s > bound_s
        elif source == "engine":  # in process the abort is applied at once: any step is a defect
            zombie = steps > threshold_steps
        else:  # over HTTP the server also has to notice the disconnect, in its own pace: bound_s for that
            zombie = steps > threshold_steps and outlived_s > bound_s
        # a step makes at most one token per sequence, so tokens judge only where steps are unknown
        # (a token count of another of the request's sequences once read 15 against 8 at 0 steps)
        zombie = zombie or (steps is None and tokens is not None and tokens > threshold_steps)
        rows.append({"request_id": rid, "client_action": _client_action(r), "outlived_s": round(outlived_s, 4),
                     "outlived_steps": steps, "tokens_after_leaving": tokens, "zombie": zombie})
    secs = [row["outlived_s"] for row in rows]
    toks = [row["tokens_after_leaving"] for row in rows if row["tokens_after_leaving"] is not None]
    zombies = [row for row in rows if row["zombie"]]
    dist = {"n": len(rows), "p50_s": quantile(secs, 0.5), "p90_s": quantile(secs, 0.9), "p99_s": quantile(secs, 0.99),
            "max_s": max(secs, default=None), "mean_s": round(statistics.fmean(secs), 4) if secs else None,
            "max_steps": max((row["outlived_steps"] for row in rows if row["outlived_steps"] is not None),
                             default=None),
            "tokens_after_leaving_total": sum(toks) if toks else None, "max_tokens_after_leaving": max(toks, default=None)}
    gauge_zombie = (gauge_lag_steps > threshold_steps and gauge_lag_s > bound_s if gauge_lag_steps is not None
                    else gauge_lag_s is not None and gauge_lag_s > bound_s)
    if gauge_zombie:
        zombies.append({"request_id": None, "client_action": "(running-request gauge)", "outlived_s": gauge_lag_s,
                        "outlived_steps": gauge_lag_steps, "tokens_after_leaving": None, "zombie": True})
    step_source = "sampled" if "sampled" in sources else "engine" if sources else None
    return {"threshold_s": threshold_s, "threshold_steps": threshold_steps, "bound_s": round(bound_s, 4),
            "step_time_s": step_time_s, "step_source": step_source, "client_left": left,
            "distribution": dist, "gauge_lag_s": gauge_lag_s, "gauge_lag_steps": gauge_lag_steps, "zombies": zombies,
            "not_released": not_released, "unmeasured": unmeasured, "requests": rows}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def rule(z: dict) -> str:
    """The zombie rule of this run, with its thresholds and the options that set them."""
    steps = (f"more than {_plural(z['threshold_steps'], 'engine step')} (--zombie-threshold-steps) after the "
             "step the client left in")
    bound = z.get("bound_s", z["threshold_s"])
    pace = (f" = max(--zombie-threshold-s {z['threshold_s']:g} s, {z['threshold_steps'] + 1} x the p99 inter-token "
            f"latency {z['step_time_s']:.3g} s)" if z.get("step_time_s") is not None
            else " (--zombie-threshold-s)")
    if z.get("step_source") == "sampled" or z.get("gauge_lag_steps") is not None:  # over HTTP: and in time
        return (f"a request is a ZOMBIE when its blocks outlive its client by {steps} and by more than {bound:g} s"
                f"{pace} (the server noticing the disconnect), or by that time alone where no step is known")
    return (f"a request is a ZOMBIE when its blocks outlive its client by {steps}, or by more than "
            f"{bound:g} s{pace} where no step is known")


def _steps_words(z: dict) -> str:
    src = z.get("step_source")
    if src == "engine":
        return "counted from the engine's step at the abort"
    if src == "sampled":
        return "at least: counted from the server's step counter read at or just after the disconnect"
    return "no engine step known: judged in seconds"


def lines(z: dict | None) -> list[str]:
    """Console / report.md lines: the distribution, the rule (thresholds and options), each zombie."""
    if not z:
        return []
    d = z["distribution"]
    left = z.get("client_left", d["n"])
    if not d["n"] and z.get("gauge_lag_s") is None:
        if not left:
            return ["zombie requests: no client left early in this run: nothing to measure (--abort-rate)"]
        why = f"; {len(z['not_released'])} never released (a leak, above)" if z["not_released"] else ""
        return [f"zombie requests: {_plural(left, 'request')} whose client left, none measurable: the server's "
                f"request history does not hold them{why}"]
    out = []
    if d["n"]:
        parts = [f"client left -> blocks released, {_plural(d['n'], 'request')}: p50 {_ms(d['p50_s'])}, "
                 f"p90 {_ms(d['p90_s'])}, max {_ms(d['max_s'])}"]
        if d["max_steps"] is not None:
            parts.append(f"engine steps after the client left: max {d['max_steps']} ({_steps_words(z)})")
        else:
            parts.append(_steps_words(z))
        if d["tokens_after_leaving_total"] is not None:
            parts.append(f"tokens generated after the client left: {d['tokens_after_leaving_total']} in all, "
                         f"max {d['max_tokens_after_leaving']} per request")
        skipped = left - d["n"] - len(z["not_released"])
        if skipped > 0:
            parts.append(f"{_plural(skipped, 'request')} whose client left not in the server's request history "
                         "(left before the request reached the engine, or forgotten by its bounded history)")
        out.append("; ".join(parts))
    if z.get("gauge_lag_s") is not None:
        steps = "" if z.get("gauge_lag_steps") is None else f", {_plural(z['gauge_lag_steps'], 'engine step')}"
        out.append(f"running-request gauge read 0 {z['gauge_lag_s']:.3f} s{steps} after the last client of a wave left")
    out.append(rule(z))
    for row in z["zombies"][:12]:
        measured = [f"{row['outlived_s']} s"] if row["outlived_s"] is not None else []
        if row["outlived_steps"] is not None:
            measured.append(_plural(row["outlived_steps"], "engine step"))
        if row["tokens_after_leaving"] is not None:
            measured.append(_plural(row["tokens_after_leaving"], "token"))
        who = row["request_id"] or "requests"
        out.append(f"ZOMBIE {who} ({row['client_action']}): outlived its client by {', '.join(measured)}")
    return out
