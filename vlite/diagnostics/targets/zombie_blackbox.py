"""Zombie requests seen from outside: does the server stop working when its client leaves?

A zombie is a request that goes on decoding after its client has gone (SGLang#36876: 182 of
them on one pod; a vLLM whose engine core drops aborts). Its blocks come back once it reaches
``max_tokens``, so the KV drain of the leak check cannot see it. This check can, with only
``/metrics``:

1. For each client action that leaves early (``ZOMBIE_ACTIONS``: disconnect right after sending,
   while the server is still admitting the request; disconnect after the headers, before the first
   token; disconnect mid-stream; non-streaming client timeout) and for a request the server answers
   with a refusal (a multi-prompt completion whose second prompt is over ``max_model_len``: HTTP
   400, so nothing may run on) it sends ``repeats`` requests,
   ONE AT A TIME on an idle server, each with a LONG ``max_tokens`` (``ignore_eos``), so that a
   zombie outlives its client by many steps and nothing else runs to blur the numbers.
2. While the request runs and until the server is idle again it scrapes ``/metrics`` every
   ``scrape_s``: the running gauge, the generation-token counter and the abort counter.
3. Per request: ``tokens_after_leaving`` (generation-token counter at idle minus its value at
   the first scrape after the client left), ``generating_s`` (client left -> last increase of that
   counter), ``running_s`` (client left -> the running gauge reads 0), ``abort_counted``
   (abort counter delta: 1 when the server noticed) and ``steps_after_leaving`` (the tokens
   generated after the client left where the server counts them: a request alone on the server
   gets one token per decode step; else ``running_s`` over the reference request's median
   inter-token latency, ``steps_estimated``). The refused request's client "left" when its answer
   came.
4. A request is a ZOMBIE when the server generated more than ``threshold_tokens`` tokens and a
   quarter of ``max_tokens`` after its client left (a zombie decodes on to ``max_tokens``; a fast
   server makes a few dozen tokens before it notices a cut), or kept it running longer than the
   server's own pace allows: ``max(threshold_s, (threshold_steps + 1) x the p99 inter-token
   latency)`` (``zombie.wall_clock_bound``; an abort lands at a step boundary at best, and a
   loaded server's steps can outlast ``threshold_s``) and half the time a complete request of
   ``max_tokens`` takes, both measured on one complete reference request streamed first; or it
   still ran it ``drain_timeout_s`` later.
   A running gauge that no token moves for ``STALE_S`` is refreshed by one 1-token request (vLLM
   updates gauges only when the engine steps): if it then reads 0 within a second it was stale,
   not a zombie. The running gauge matters on vLLM: its generation-token counter is kept by the API
   server for the requests it still tracks, so a zombie's tokens after its client left are not
   counted there (measured on vLLM 0.32 with aborts dropped in the engine core). The client's aborts are compared with the server's abort counter
   (``vllm:request_success_total{finished_reason="abort"}``, ``sglang:num_aborted_requests_total``,
   vlite's own; llama.cpp, TGI and trtllm-serve have none: said in the result).

Each zombie action gets a one-request reproducer (python for the disconnects before the
response's first token, which curl cannot time; curl for the others), and the verdict line names
the request id, how long and about how many steps it ran after its client left.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from dataclasses import dataclass

import httpx

from vlite.diagnostics.checks.pace import quantile
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.checks.zombie import DEFAULT_THRESHOLD_STEPS, wall_clock_bound
from vlite.diagnostics.readers.adapters import NO_ABORT_COUNTER, MetricsReading
from vlite.diagnostics.targets.connection import BlackboxDriver, NullProbe
from vlite.diagnostics.targets.openai_client import send_request
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.replay import RequestResult
from vlite.diagnostics.workload.sources import OVER_MAX_MODEL_LEN, RequestSpec

# client action kind -> (the words of the report, the action as sent)
ZOMBIE_ACTIONS: dict[str, tuple[str, ClientAction]] = {
    # the whole request written, the connection closed before any byte of the response
    "abort-waiting": ("disconnect while the server admits it", ClientAction("abort-waiting")),
    "abort-prefill": ("disconnect before the first token", ClientAction("abort-prefill")),
    "disconnect-stream": ("disconnect mid-stream", ClientAction("disconnect-stream", after_tokens=2)),
    "client-timeout": ("non-streaming client timeout", ClientAction("client-timeout", timeout_s=1.0)),
    # the client's answer is a refusal (HTTP 400 for its over-long second prompt): the first
    # prompt, valid, may have been queued already and must not run on
    "refused": ("refused (HTTP 400) for one prompt of two", ClientAction("complete")),
}
DEFAULT_MAX_TOKENS = 512
DEFAULT_THRESHOLD_TOKENS = 16
DEFAULT_THRESHOLD_S = 1.0
_PROMPT = "zombie check: please write a long story about a lighthouse keeper"


@dataclass
class _Scrape:
    t: float
    running: int
    waiting: int
    gen: float | None
    aborted: float | None


class _Scraper:
    """Scrapes the connection every ``period`` s in the background (async)."""

    def __init__(self, read, period: float) -> None:
        self.read, self.period = read, period
        self.rows: list[_Scrape] = []
        self._stop = False

    async def run(self) -> None:
        while not self._stop:
            try:
                s: MetricsReading = await self.read()
                self.rows.append(_Scrape(time.time(), s.num_running, s.num_waiting, s.generation_tokens, s.aborted))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(self.period)

    def stop(self) -> None:
        self._stop = True


STALE_S = 3.0  # a running gauge above 0 with no token generated for this long is poked once
MIN_SETTLE_S = 0.5  # after a client left, the server is idle only if idle this long (or twice the reference TTFT)
COUNTER_GRACE_S = 0.5  # scrapes go on this long after idle, for counters the API server updates late


def _frozen(rows: list[_Scrape], left: float, stale_s: float) -> bool:
    """The running gauge still reads > 0 but the generation-token counter has not moved for
    ``stale_s`` seconds since the client left (a stale gauge, or a stuck request)."""
    after = [r for r in rows if r.t >= left]
    if not after or after[-1].running == 0 or after[-1].gen is None or after[-1].t - left < stale_s:
        return False
    recent = [r.gen for r in after if r.t >= after[-1].t - stale_s]
    return len(set(recent)) == 1


def _measure(rows: list[_Scrape], before: _Scrape, left: float) -> dict:
    """The per-request numbers from the scrapes (see the module docstring)."""
    after = [r for r in rows if r.t >= left]
    out = {"running_s": None, "generating_s": 0.0, "tokens_after_leaving": None, "abort_counted": None}
    if not after:
        return out
    # the first idle scrape after the last busy one: a request the engine had not yet scheduled
    # when its client left shows up (waiting, running) after an idle scrape
    busy = [i for i, r in enumerate(after) if r.running > 0 or r.waiting > 0]
    idle_at = next((r.t for r in after[(busy[-1] + 1 if busy else 0):] if r.running == 0 and r.waiting == 0), None)
    out["running_s"] = None if idle_at is None else round(max(0.0, idle_at - left), 3)
    last = after[-1]
    if after[0].gen is not None and last.gen is not None:
        out["tokens_after_leaving"] = int(last.gen - after[0].gen)
        rises = [b.t for a, b in zip(after, after[1:]) if b.gen is not None and a.gen is not None and b.gen > a.gen]
        out["generating_s"] = round(max(0.0, rises[-1] - left), 3) if rises else 0.0
    if before.aborted is not None and last.aborted is not None:
        out["abort_counted"] = int(last.aborted - before.aborted)
    return out


def steps_after_leaving(m: dict, itl_median_s: float | None, drain_timeout_s: float,
                        max_tokens: int | None = None) -> dict:
    """``steps_after_leaving`` and ``steps_estimated`` of one early leaver's measures ``m``: the
    tokens generated after the client left where the server counted more than one (one request
    alone on the server gets one token per decode step), else the time it ran on (``running_s``,
    or ``drain_timeout_s`` for one still running) over the server's median inter-token latency,
    at most ``max_tokens`` (a running gauge read late overstates the time; None where neither is
    known)."""
    tokens = m.get("tokens_after_leaving")
    if tokens is not None and tokens > 1:
        return {"steps_after_leaving": int(tokens), "steps_estimated": False}
    running = m.get("running_s")
    running = drain_timeout_s if running is None else running
    if not itl_median_s:
        return {"steps_after_leaving": None, "steps_estimated": None}
    steps = int(round(running / itl_median_s))
    return {"steps_after_leaving": min(steps, max_tokens) if max_tokens else steps, "steps_estimated": True}


def judge(m: dict, left: float, poked: float | None, threshold_tokens: int, threshold_s: float) -> tuple[bool, bool]:
    """(stale_gauge, zombie) for one early leaver's measures ``m`` (``_measure``'s keys); ``left``:
    when the client left, ``poked``: when the 1-token probe ended (None: no probe).

    A running gauge that read 0 within a second of the probe was only stale (the probe made the
    engine step); one that stays up after it is a request the engine really kept running.
    """
    stale = poked is not None and m["running_s"] is not None and left + m["running_s"] <= poked + 1.0
    ran_on = m["running_s"] is None or (m["running_s"] > threshold_s and not stale)
    if m["tokens_after_leaving"] is not None:
        return stale, m["tokens_after_leaving"] > threshold_tokens or ran_on
    return stale, ran_on


def _max_model_len(conn) -> int | None:
    """``max_model_len`` from ``GET /v1/models`` (vLLM and vlite report it), or None."""
    try:
        data = conn.client.get(f"{conn.base}/v1/models", headers=conn.headers).json().get("data") or []
        return int(data[0]["max_model_len"]) if data and data[0].get("max_model_len") else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _timeout_of(row: dict) -> float | None:
    label = row.get("client_action", "")
    try:
        return float(label.split("after ")[1].split(" s")[0]) if "timeout after" in label else None
    except (IndexError, ValueError):
        return None


def reproducer(kind: str, base_url: str, max_tokens: int, headers: dict | None = None, body: dict | None = None,
               timeout_s: float | None = None) -> str:
    """A one-request reproducer of ``kind`` (a ``ZOMBIE_ACTIONS`` key) and the scrape that shows the
    zombie: the running gauge and the generation-token counter still moving after the client left."""
    action = ZOMBIE_ACTIONS[kind][1]
    req = {"prompt": _PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
           "stream": action.streams, **(body or {})}
    auth = "".join(f" -H {shlex.quote(f'{k}: {v}')}" for k, v in (headers or {}).items())
    watch = (f"for i in 1 2 3 4 5; do sleep 1; curl -s{auth} {base_url}/metrics | grep -E "
             "'num_requests_running|num_running_reqs|generation_tokens_total|requests_processing' | grep -v '^#'; done")
    if kind == "refused":
        req["prompt"] = [req["prompt"], "hi " * 40000]  # over any max_model_len up to 40k tokens
        return (f"curl -s {base_url}/v1/completions -H 'Content-Type: application/json'{auth} "
                f"-d {shlex.quote(json.dumps(req))}  # HTTP 400: the second prompt is too long\n{watch}")
    if kind == "abort-waiting":
        return ("python - <<'EOF'\nimport httpx\n"
                f"try:\n    httpx.post('{base_url}/v1/completions', json={json.dumps(req)}, "
                f"headers={json.dumps(headers or {})}, timeout=httpx.Timeout(10, read=0.01))"
                "  # gives up 10 ms after sending\n"
                "except httpx.TimeoutException:\n    pass\nEOF\n" + watch)
    if kind == "abort-prefill":
        return ("python - <<'EOF'\nimport httpx\n"
                f"with httpx.stream('POST', '{base_url}/v1/completions', json={json.dumps(req)}, "
                f"headers={json.dumps(headers or {})}, timeout=60) as r:\n"
                "    print('HTTP', r.status_code)  # headers read; closed here, before the first token\nEOF\n" + watch)
    head = f"curl -sN {base_url}/v1/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(json.dumps(req))}"
    if kind == "disconnect-stream":
        return f"{head} | head -n {2 * action.after_tokens}  # closes after {action.after_tokens} chunks\n{watch}"
    return f"{head} --max-time {timeout_s or action.timeout_s}  # the client times out\n{watch}"


def zombie_check_blackbox(conn, *, kinds: tuple[str, ...] = tuple(ZOMBIE_ACTIONS), repeats: int = 1,
                          max_tokens: int = DEFAULT_MAX_TOKENS, threshold_tokens: int = DEFAULT_THRESHOLD_TOKENS,
                          threshold_s: float = DEFAULT_THRESHOLD_S, drain_timeout_s: float = 60.0,
                          scrape_s: float = 0.05, seed: int = 0,
                          threshold_steps: int = DEFAULT_THRESHOLD_STEPS) -> dict:
    """Send early-leaving requests one at a time and measure what the server does after each client left.

    Args:
        conn: a ``connection.Connection``.
        kinds: ``ZOMBIE_ACTIONS`` keys to try. repeats: requests per kind.
        max_tokens: the early leavers' max_tokens (long, so that a zombie outlives its client).
        threshold_tokens / threshold_s / threshold_steps: a request is a ZOMBIE when the server
            generated more than ``threshold_tokens`` tokens after its client left, or kept it
            running longer than ``max(threshold_s, (threshold_steps + 1) x p99 ITL)`` seconds and
            half a complete request's time (module docstring).
        drain_timeout_s: the longest wait for idle before and after each request.
        scrape_s: scrape period, seconds.

    Returns:
        ``{"requests": [...], "actions": [...], "zombies": [...], "client_aborts", "server_aborts",
        "abort_counter", "notes", "max_tokens", "threshold_tokens", "threshold_s", "threshold_steps",
        "itl_p99_s", "running_bound_s", "reference"}``; ``itl_p99_s``: the p99 gap between the
        reference request's chunks (s, None when it did not run); ``running_bound_s``: the longest
        a request may stay running after its client left. ``actions``:
        one row per kind (worst request); ``zombies``: the actions found ZOMBIE, each with its
        reproducer.

    Raises:
        ValueError: an unknown kind.
    """
    for k in kinds:
        if k not in ZOMBIE_ACTIONS:
            raise ValueError(f"unknown zombie client action {k!r}; known: {', '.join(ZOMBIE_ACTIONS)}")
    driver = BlackboxDriver(conn, NullProbe(), 1, drain_timeout_s)
    rows: list[dict] = []
    notes: list[str] = []
    limit = _max_model_len(conn)
    if limit and max_tokens > limit - 64:  # the prompt needs room (vLLM and vlite refuse a longer request)
        notes.append(f"max_tokens {max_tokens} capped at {max(16, limit - 64)}: the server's max_model_len is {limit}")
        max_tokens = max(16, limit - 64)

    timing: dict = {}

    async def reference(client: httpx.AsyncClient) -> None:
        """One complete streamed request of max_tokens: its time to the first chunk and in all (so
        that the non-streaming client times out between the two), and the gaps between its chunks
        (the server's pace: its p99 inter-token latency scales the running bound)."""
        if await driver.wait_idle(client) is None:
            return
        body = {"prompt": f"vlite-zombie-reference {_PROMPT}", "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, **conn.body}
        t0, first, chunks = time.monotonic(), None, []
        try:
            async with client.stream("POST", f"{conn.base}/v1/completions", json=body, headers=conn.headers,
                                     timeout=max(60.0, drain_timeout_s)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"text"' in line:
                        chunks.append(time.monotonic())
                        if first is None:
                            first = chunks[0] - t0
        except httpx.HTTPError as exc:
            notes.append(f"the reference request failed ({type(exc).__name__}); the client timeout stays at 1 s")
            return
        timing.update(ttft_s=round(first or 0.0, 4), full_s=round(time.monotonic() - t0, 4))
        gaps = [b - a for a, b in zip(chunks, chunks[1:])]
        itl = quantile(gaps, 0.99)
        if itl is not None:
            timing["itl_p99_s"] = round(itl, 4)
            timing["itl_median_s"] = round(quantile(gaps, 0.5), 5)

    async def _poke(client: httpx.AsyncClient) -> str | None:
        body = {"prompt": "probe", "max_tokens": 1, "temperature": 0.0, **conn.body}
        try:
            await client.post(f"{conn.base}/v1/completions", json=body, headers=conn.headers, timeout=60)
        except httpx.HTTPError as exc:
            return f"a 1-token probe to refresh a stale running gauge failed: {type(exc).__name__}"
        return None

    async def one(kind: str, i: int, client: httpx.AsyncClient, timeout_s: float | None = None) -> bool:
        """One early leaver; False when the client did not leave early (the request finished first)."""
        words, action = ZOMBIE_ACTIONS[kind]
        if timeout_s is not None:
            action = ClientAction("client-timeout", timeout_s=round(max(0.02, timeout_s), 3))
        idle = await driver.wait_idle(client)
        if idle is None:
            notes.append(f"{words}: the server was not idle within {drain_timeout_s:g} s; request not sent")
            return True
        before = _Scrape(time.time(), idle.num_running, idle.num_waiting, idle.generation_tokens, idle.aborted)
        rid = f"vlite-zombie-{kind}-{i}-{int(time.time() * 1000) % 10**8}"
        spec = RequestSpec(rid, 0.0, f"{rid} {_PROMPT}", len(_PROMPT.split()) + 1, max_tokens, action=action,
                           temperature=0.0, ignore_eos=True,
                           extra_prompts=(OVER_MAX_MODEL_LEN,) if kind == "refused" else ())
        res = RequestResult(rid, action.kind, action.label, time.time())
        scraper = _Scraper(lambda: driver.read(client), scrape_s)
        task = asyncio.ensure_future(scraper.run())
        try:
            await send_request(conn.base, spec, res, conn.headers, conn.body, max_model_len=limit)
            left = res.abort_time
            settle_s = max(MIN_SETTLE_S, 2 * timing.get("ttft_s", 0.0))
            if left is not None:  # follow the server until it is idle again
                deadline = time.monotonic() + drain_timeout_s
                poked = None  # when the 1-token probe ended
                while time.monotonic() < deadline:
                    await asyncio.sleep(scrape_s)
                    tail = scraper.rows[-3:]
                    # idle only once the server had time to admit it: a request it is still
                    # admitting is in no gauge yet
                    if len(tail) == 3 and all(r.t > left and r.running == 0 and r.waiting == 0 for r in tail) \
                            and tail[-1].t - left >= settle_s:
                        # the API server counts a finish after the engine is idle: let the counters catch up
                        await asyncio.sleep(COUNTER_GRACE_S)
                        break
                    if poked is None and _frozen(scraper.rows, left, STALE_S):
                        # vLLM refreshes its gauges only when the engine steps: a 1-token request makes
                        # it step, so a running gauge left stale by an abort reads 0 again
                        row_note = await _poke(client)
                        poked = time.time()
                        if row_note:
                            notes.append(row_note)
        finally:
            scraper.stop()
            await task
        row = {"request_id": rid, "client_action": action.label if kind == "client-timeout" else words,
               "kind": kind, "outcome": res.outcome,
               "left_at": left, "max_tokens": max_tokens, "client_tokens": res.num_output_tokens}
        if left is None:
            why = ("the server did not refuse a prompt over its max_model_len" if kind == "refused" else
                   "raise --zombie-max-tokens")
            row.update(zombie=False, note=f"the client did not leave early ({res.outcome}: {res.detail or ''}); {why}")
            rows.append(row)
            return False
        if kind == "refused":
            row["answer"] = res.detail
        row.update(_measure(scraper.rows, before, left))
        # a zombie runs on to max_tokens: most of a complete request's time, and longer than the
        # server's pace allows an abort to take (threshold_s, or a few of its slowest steps)
        min_running_s = running_bound()
        # ... and most of max_tokens: a fast server makes a few dozen tokens before it notices a cut
        min_tokens = max(threshold_tokens, max_tokens // 4)
        row["stale_gauge"], row["zombie"] = judge(row, left, poked, min_tokens, min_running_s)
        row["still_running"] = row["running_s"] is None
        row.update(steps_after_leaving(row, timing.get("itl_median_s"), drain_timeout_s, max_tokens))
        rows.append(row)
        return True

    def running_bound() -> float:
        return max(wall_clock_bound(threshold_s, threshold_steps, timing.get("itl_p99_s")),
                   0.5 * timing.get("full_s", 0.0))

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            if kinds:
                await reference(client)
            for kind in kinds:
                for i in range(repeats):
                    if kind != "client-timeout" or not timing:
                        await one(kind, i, client)
                        continue
                    # time out a quarter of the way from the first token to the end of a complete
                    # request; if the request still finished first (a loaded machine), try shorter
                    t = timing["ttft_s"] + 0.25 * max(0.0, timing["full_s"] - timing["ttft_s"])
                    for _ in range(3):
                        if await one(kind, i, client, t):
                            break
                        t /= 2

    asyncio.run(main())
    left = [r for r in rows if r.get("left_at") is not None]
    # a refused request was never the client's abort: it is not in the abort accounting
    aborted = [r for r in left if r["kind"] != "refused"]
    counted = [r["abort_counted"] for r in aborted if r.get("abort_counted") is not None]
    has_counter = conn.adapter.kind not in NO_ABORT_COUNTER
    if not has_counter:
        notes.append(NO_ABORT_COUNTER[conn.adapter.kind])
    actions = []
    for kind in kinds:
        mine = [r for r in left if r["kind"] == kind]
        if not mine:
            continue
        worst = max(mine, key=lambda r: (r["zombie"], r.get("tokens_after_leaving") or 0, r.get("running_s") or 1e9))
        act = {"client_action": ZOMBIE_ACTIONS[kind][0], "kind": kind, "requests": len(mine),
               "zombies": sum(r["zombie"] for r in mine), "tokens_after_leaving": worst.get("tokens_after_leaving"),
               "generating_s": worst.get("generating_s"), "running_s": worst.get("running_s"),
               "still_running": worst.get("still_running"), "steps_after_leaving": worst.get("steps_after_leaving"),
               "steps_estimated": worst.get("steps_estimated"),
               "aborts_counted": (sum(r["abort_counted"] or 0 for r in mine)
                                  if has_counter and counted and kind != "refused" else None),
               "request_id": worst["request_id"]}
        if act["zombies"]:
            act["reproducer"] = reproducer(kind, conn.base, max_tokens, conn.headers, conn.body,
                                           timeout_s=_timeout_of(worst))
        actions.append(act)
    return {"requests": rows, "actions": actions, "zombies": [a for a in actions if a["zombies"]],
            "client_aborts": len(aborted), "server_aborts": sum(counted) if has_counter and counted else None,
            "abort_counter": has_counter, "max_tokens": max_tokens,
            "threshold_tokens": max(threshold_tokens, max_tokens // 4),
            "threshold_s": threshold_s, "threshold_steps": threshold_steps, "itl_p99_s": timing.get("itl_p99_s"),
            "itl_median_s": timing.get("itl_median_s"),
            "running_bound_s": round(running_bound(), 3), "reference": timing, "notes": notes}


def zombie_summary(z: dict) -> str | None:
    """The ZOMBIE verdict line for the worst zombie action, or None when there is none."""
    if not z or not z["zombies"]:
        return None
    a = max(z["zombies"], key=lambda a: a.get("tokens_after_leaving") or 0)
    tokens = ("" if a["tokens_after_leaving"] is None or a["tokens_after_leaving"] <= z["threshold_tokens"]
              else f"generated {a['tokens_after_leaving']} tokens and ")
    # judged on its running time alone: name the bound and the option that sets it
    bound = ("" if tokens else f" (more than the {z.get('running_bound_s', z['threshold_s']):g} s bound; "
             "--zombie-threshold-s)")
    running = ("the request is still running" if a["still_running"] else
               f"kept it running {a['running_s']:g} s{bound}")
    steps = a.get("steps_after_leaving")
    steps = ("" if steps is None else f", {steps} steps" if not a.get("steps_estimated") else
             f", about {steps} steps at its {1000 * (z.get('itl_median_s') or 0):.3g} ms median inter-token latency")
    counted = ("" if a["aborts_counted"] is None else
               f"; its abort counter counted {a['aborts_counted']} of {a['requests']}")
    others = [b["client_action"] for b in z["zombies"] if b is not a]
    also = f" (also: {', '.join(others)})" if others else ""
    subject = "the server " if tokens or not a["still_running"] else ""
    after = "after the client got its answer" if a.get("kind") == "refused" else "after the client left"
    return (f"ZOMBIE: {a['client_action']}: request {a['request_id']}: {after} {subject}{tokens}"
            f"{running}{steps} (max_tokens {z['max_tokens']}){counted}{also}")


def rule(z: dict) -> str:
    """The zombie rule of this check, with its thresholds, the measured pace and the options."""
    parts = [f"--zombie-threshold-s {z['threshold_s']:g} s"]
    if z.get("itl_p99_s") is not None:
        parts.append(f"{z.get('threshold_steps', DEFAULT_THRESHOLD_STEPS) + 1} x the p99 inter-token latency "
                     f"{z['itl_p99_s']:.3g} s")
    if (z.get("reference") or {}).get("full_s"):
        parts.append(f"half a complete request's {z['reference']['full_s']:.3g} s")
    bound = z.get("running_bound_s", z["threshold_s"])
    return (f"a request is a ZOMBIE when the server generated more than {z['threshold_tokens']} tokens after its "
            f"client left (a quarter of max_tokens, --zombie-max-tokens), or kept it running more than {bound:g} s "
            f"= max({', '.join(parts)})")


def lines(z: dict | None) -> list[str]:
    """Console / report.md lines: one per client action, the rule, then the abort counters."""
    if not z:
        return []
    out = []
    for a in z["actions"]:
        state = "ZOMBIE" if a["zombies"] else "ok"
        run = ("still running" if a["still_running"] else
               "running gauge not read" if a["running_s"] is None else f"running {a['running_s']} s")
        tokens = ("tokens generated: not counted by this server" if a["tokens_after_leaving"] is None else
                  f"{a['tokens_after_leaving']} tokens generated over {a['generating_s']} s")
        named = f" ({a['request_id']})" if a["zombies"] else ""
        out.append(f"{state}: {a['client_action']}: {a['requests']} request(s) of max_tokens {z['max_tokens']}{named}; "
                   f"{'after the answer' if a.get('kind') == 'refused' else 'after the client left'}: {tokens}, {run}; "
                   f"aborts counted by the server: {a['aborts_counted'] if a['aborts_counted'] is not None else 'n/a'}")
    if z["actions"]:
        out.append(rule(z))
    if z["server_aborts"] is not None:
        before = ("; a request whose client left while it was admitted may be cancelled before the engine sees it, "
                  "with no abort to count" if any(a.get("kind") == "abort-waiting" for a in z["actions"]) else "")
        out.append(f"aborts: the client left {z['client_aborts']} requests early, the server's abort counter rose by "
                   f"{z['server_aborts']}{before}")
    out += [f"note: {n}" for n in z["notes"]]
    return out


def apply_to(res, z: dict) -> None:
    """Fold the zombie check into a ``BlackboxResult``: a CLEAN result with a zombie becomes ZOMBIE
    (exit 1); a LEAK stays LEAK, the zombies listed beside it."""
    res.zombies = z
    summary = zombie_summary(z)
    if summary and res.verdict == Verdict.CLEAN:
        res.verdict, res.summary = Verdict.ZOMBIE, summary
    elif summary:
        res.notes.append(summary)
