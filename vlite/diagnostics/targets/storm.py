"""The abort storm and the two checks after it, over one server URL (``checks/storm.py`` judges).

``storm_check(base_url, ...)`` needs nothing but an OpenAI-compatible ``/v1/completions`` and
``/health``, so it runs the same against a single server (``--url``), and per replica of a fleet:

1. **Before**: the wedge probe's request ``PROBE_RUNS`` times (its latencies set the bound) and
   the output canary twice (``checks/storm.py``: the second run is the reference).
2. **The storm**: ``storm_requests`` streamed requests sent at once (long ``max_tokens``,
   ``ignore_eos``), all cut together, by closing their connections, once each has streamed a
   token or ``hold_s`` after the first token (a mass disconnect: a router restart, a load test
   stopped with Ctrl-C).
3. **After**: the wedge probe (``GET /health``, then the plain request with the bound as its
   timeout), then the canary once more (skipped on a wedged server: it would wait forever too).

A run that already stopped draining after its client aborts (the black-box waves) is probed
at once with ``wedge_probe``: the waves were the storm.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from vlite.diagnostics.checks.storm import judge_canary, judge_wedge, wedge_bound, worst
from vlite.diagnostics.checks.verdict import Verdict

CANARY_PROMPT = "Write the numbers from one to twenty in words, separated by commas:"
CANARY_MAX_TOKENS = 16
PROBE_PROMPT = "wedge probe: say hello"
PROBE_MAX_TOKENS = 4
PROBE_RUNS = 3
DEFAULT_STORM_REQUESTS = 32
STORM_MAX_TOKENS = 256
STORM_HOLD_S = 1.0
STORM_TIMEOUT_S = 30.0
_STORM_PROMPT = "abort storm {i}: tell me a long story about a harbour, a storm and the boats that stayed out"


def _post(client: httpx.Client, base: str, body: dict, headers: dict, timeout_s: float) -> dict:
    """One non-streamed completion: status (HTTP status or the error's name), text,
    completion_tokens (usage; None without), finish_reason, latency_s."""
    t0 = time.monotonic()
    try:
        r = client.post(f"{base}/v1/completions", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "text": None, "completion_tokens": None, "finish_reason": None,
                "latency_s": round(time.monotonic() - t0, 4)}
    out = {"status": r.status_code, "text": None, "completion_tokens": None, "finish_reason": None,
           "latency_s": round(time.monotonic() - t0, 4)}
    try:
        data = r.json()
        choice = (data.get("choices") or [{}])[0]
        out.update(text=choice.get("text"), finish_reason=choice.get("finish_reason"),
                   completion_tokens=(data.get("usage") or {}).get("completion_tokens"))
    except (ValueError, AttributeError, IndexError):
        pass
    return out


def canary(client: httpx.Client, base: str, *, headers: dict | None = None, body: dict | None = None,
           timeout_s: float = 120.0) -> dict:
    """One run of the output canary: ``CANARY_PROMPT``, greedy, ``CANARY_MAX_TOKENS`` tokens
    (``ignore_eos``, so a healthy server always returns that many). Keys as ``_post``."""
    req = {"prompt": CANARY_PROMPT, "max_tokens": CANARY_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
           **(body or {})}
    return _post(client, base, req, headers or {}, timeout_s)


def probe_latency(client: httpx.Client, base: str, *, headers: dict | None = None, body: dict | None = None,
                  timeout_s: float = 120.0) -> dict:
    """The wedge probe's plain request once (before the storm: its latency sets the bound)."""
    req = {"prompt": PROBE_PROMPT, "max_tokens": PROBE_MAX_TOKENS, "temperature": 0.0, **(body or {})}
    return _post(client, base, req, headers or {}, timeout_s)


def wedge_probe(client: httpx.Client, base: str, bound_s: float, *, headers: dict | None = None,
                body: dict | None = None) -> dict:
    """``GET /health``, then the plain request with ``bound_s`` as its timeout. Returns
    ``health_status``, ``completed`` (HTTP 200 within the bound), ``status``, ``latency_s``,
    ``bound_s``, and ``verdict`` / ``reason`` (``checks.storm.judge_wedge``)."""
    try:
        health: int | str = client.get(f"{base}/health", headers=headers or {}, timeout=10).status_code
    except httpx.HTTPError as exc:
        health = type(exc).__name__
    run = probe_latency(client, base, headers=headers, body=body, timeout_s=bound_s)
    out = {"health_status": health, "completed": run["status"] == 200, "status": run["status"],
           "latency_s": run["latency_s"], "bound_s": round(bound_s, 3)}
    out["verdict"], out["reason"] = judge_wedge(out)
    return out


async def abort_storm(base: str, n: int, *, headers: dict | None = None, body: dict | None = None,
                      max_tokens: int = STORM_MAX_TOKENS, hold_s: float = STORM_HOLD_S,
                      timeout_s: float = STORM_TIMEOUT_S) -> dict:
    """Send ``n`` streamed requests at once and cut them all together (module docstring).
    Returns ``sent``, ``streamed`` (got a token before the cut), ``finished`` (ended before the
    cut), ``held_s`` (first send to the cut)."""
    streamed, finished = set(), set()
    first = asyncio.Event()
    all_streamed = asyncio.Event()

    async def one(i: int, client: httpx.AsyncClient) -> None:
        req = {"prompt": _STORM_PROMPT.format(i=i), "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, **(body or {})}
        async with client.stream("POST", f"{base}/v1/completions", json=req, headers=headers or {}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text"' in line and i not in streamed:
                    streamed.add(i)
                    first.set()
                    if len(streamed) == n:
                        all_streamed.set()
        finished.add(i)

    t0 = time.monotonic()
    clients = [httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) for _ in range(n)]  # one connection each
    tasks = [asyncio.create_task(one(i, c)) for i, c in enumerate(clients)]
    try:
        try:
            await asyncio.wait_for(first.wait(), timeout_s)
            await asyncio.wait_for(all_streamed.wait(), hold_s)
        except TimeoutError:
            pass
    finally:
        held = time.monotonic() - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:  # closing the connections is the disconnect the server must notice
            await c.aclose()
    return {"sent": n, "streamed": len(streamed), "finished": len(finished), "held_s": round(held, 3)}


def fit_max_tokens(client: httpx.Client, base: str, headers: dict | None = None,
                   max_tokens: int = STORM_MAX_TOKENS) -> int:
    """``max_tokens`` capped at the server's ``max_model_len`` less 64 prompt tokens (from
    ``GET /v1/models``, which vLLM and vlite fill; unchanged where it says nothing), at least 16."""
    try:
        data = client.get(f"{base}/v1/models", headers=headers or {}, timeout=10).json().get("data") or []
        limit = int(data[0]["max_model_len"]) if data and data[0].get("max_model_len") else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        limit = None
    return max_tokens if limit is None else max(16, min(max_tokens, limit - 64))


def storm_check(base_url: str, *, headers: dict | None = None, body: dict | None = None,
                storm_requests: int = DEFAULT_STORM_REQUESTS, wedge_timeout_s: float | None = None,
                max_tokens: int = STORM_MAX_TOKENS, before: dict | None = None) -> dict:
    """Before, the storm, after (module docstring) against one server.

    Args:
        base_url: the server (``http://host:port``); headers / body: auth and fields such as
            ``model`` added to every request.
        storm_requests: requests in the storm.
        wedge_timeout_s: the wedge probe's bound in seconds (None: from the latencies before,
            ``checks.storm.wedge_bound``).
        max_tokens: the storm requests' max_tokens (long, so that each is cut mid-decode).
        before: ``measure_before``'s result when it was taken earlier (before a run's own
            abort waves); None takes it now.

    Returns:
        ``{"before", "storm", "wedge", "canary_after", "canary_verdict", "canary_reason",
        "verdict", "summary"}``; ``verdict`` is WEDGED, EMPTY-OUTPUT, OUTPUT-DRIFT or None.
    """
    base = base_url.rstrip("/")
    with httpx.Client() as client:
        before = before or measure_before(client, base, headers=headers, body=body)
        max_tokens = fit_max_tokens(client, base, headers, max_tokens)
        storm = asyncio.run(abort_storm(base, storm_requests, headers=headers, body=body, max_tokens=max_tokens))
        bound = wedge_bound(before["probe_latencies_s"], override_s=wedge_timeout_s)
        return judge_after(client, base, before, bound, storm, headers=headers, body=body)


def measure_before(client: httpx.Client, base: str, *, headers: dict | None = None, body: dict | None = None
                   ) -> dict:
    """The wedge probe's request ``PROBE_RUNS`` times and the canary twice, before any abort.
    Returns ``probe_latencies_s`` (of those that answered 200) and ``canary`` (the two runs)."""
    runs = [probe_latency(client, base, headers=headers, body=body) for _ in range(PROBE_RUNS)]
    return {"probe_latencies_s": [r["latency_s"] for r in runs if r["status"] == 200],
            "canary": [canary(client, base, headers=headers, body=body) for _ in range(2)]}


def judge_after(client: httpx.Client, base: str, before: dict, bound_s: float, storm: dict | None, *,
                headers: dict | None = None, body: dict | None = None) -> dict:
    """The wedge probe, then (unless wedged) the canary after; both judged. ``storm``: what the
    storm sent (None when the run's own waves were the storm)."""
    wedge = wedge_probe(client, base, bound_s, headers=headers, body=body)
    after = None if wedge["verdict"] else canary(client, base, headers=headers, body=body, timeout_s=max(bound_s, 30))
    cv, creason = judge_canary(before["canary"], after)
    if after is None:
        creason = "not run after the storm: the server did not answer the wedge probe"
    verdict = worst([wedge["verdict"], cv])
    summary = None
    if verdict == Verdict.WEDGED:
        summary = f"WEDGED: {wedge['reason']}"
    elif verdict:
        summary = f"{verdict}: {creason}"
    return {"before": before, "storm": storm, "wedge": wedge, "canary_after": after, "canary_verdict": cv,
            "canary_reason": creason, "verdict": verdict, "summary": summary}


def apply_to(res, s: dict) -> None:
    """Fold the storm checks into a ``BlackboxResult``: a storm verdict replaces CLEAN, ZOMBIE or
    INCONCLUSIVE (the replaced summary goes to the notes); beside a LEAK, the cause to fix, it is
    added to the LEAK's summary; none leaves the result as it is."""
    res.storm = s
    if not s["verdict"]:
        return
    if res.verdict == Verdict.LEAK:
        res.summary = f"{res.summary}; after the abort storm: {s['summary']}"
        return
    if res.verdict != Verdict.CLEAN:
        res.notes.append(f"before the storm checks: {res.summary}")
    res.verdict, res.summary = s["verdict"], s["summary"]
