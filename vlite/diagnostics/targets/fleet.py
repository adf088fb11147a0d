"""``vlite leak-check --url ROUTER --replica URL ...``: a fleet of replicas behind a router, judged
replica by replica (``checks/fleet.py``), with every client abort reconciled hop by hop.

Phases, all through ``/metrics`` of each replica (any server kind with an adapter) and the
router's OpenAI routes:

1. Baseline: each replica drained, a 1-token request sent to it, KV in use at idle read.
2. Load: ``specs`` (a synthetic workload with client aborts) sent through the router.
3. Probes, one at a time on an idle fleet, each with a long ``max_tokens`` (``ignore_eos``): a
   client that leaves after 2 streamed tokens or right after the response headers (before its
   first token), until every replica has served ``probes_per_replica`` of them. Which replica
   served a probe: the one whose ended-request counter (``request_success_total``) moved, or
   whose running gauge rose, between reads before and after the probe; alone on an idle fleet no
   other request moves them. Where the router exports a per-worker routed counter
   (``ROUTER_ROUTED``, with ``--router-metrics``) its own answer is recorded beside it.
   Scrapes every ``scrape_s`` from the client leaving until the replica counted the request
   ended: the time and engine step of the release, for the zombie rule.
4. Control: for a replica with a zombie through the router, the same early leaver sent to the
   replica directly: released in time there means the router lost the abort.
5. Final: each replica drained, a 1-token request, KV in use at idle read again; the router's
   in-flight gauge per worker read at idle.

``FleetTarget`` runs it through the ``LeakCheckTarget`` interface (kind "fleet"), so its report is
printed and written as every target's is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import pandas as pd

from vlite.diagnostics.checks import fleet as judge
from vlite.diagnostics.checks.pace import itl_p99
from vlite.diagnostics.checks.zombie import DEFAULT_THRESHOLD_S, DEFAULT_THRESHOLD_STEPS
from vlite.diagnostics.readers.metrics_text import MetricsFormatError, MetricsPage, parse_page
from vlite.diagnostics.targets.base import TargetError, TargetPlan, TargetRun
from vlite.diagnostics.targets.connection import BlackboxDriver, Connection, NullProbe, connect
from vlite.diagnostics.targets.openai_client import send_request, wait_ready
from vlite.diagnostics.workload.replay import RequestResult
from vlite.diagnostics.workload.sources import RequestSpec

PROBE_ACTIONS = ("disconnect-stream", "abort-prefill")
_PROMPT = "fleet check: please write a long story about a lighthouse keeper and the sea"
# The inter-token latency histogram of each kind (for the zombie bound where no step counter).
_ITL = {"vlite": "vlite:inter_token_latency_seconds", "vllm": "vllm:inter_token_latency_seconds",
        "sglang": "sglang:inter_token_latency_seconds"}
_STEPS = "vlite:engine_steps_total"


@dataclass
class FleetOptions:
    """What to send and how long to wait. ``max_tokens``: the probes' (long, so a zombie outlives
    its client by many steps); ``drain_timeout_s``: the longest wait for a replica to go idle or
    to count a probe ended; ``scrape_s``: the period of the scrapes during a probe."""

    router: str
    replicas: list[str]
    router_metrics: str | None = None
    api_key: str | None = None
    specs: list[RequestSpec] = field(default_factory=list)
    max_concurrency: int = 16
    probes_per_replica: int = 2
    max_tokens: int = 128
    drain_timeout_s: float = 60.0
    threshold_s: float = DEFAULT_THRESHOLD_S
    threshold_steps: int = DEFAULT_THRESHOLD_STEPS
    scrape_s: float = 0.05
    storm_requests: int = 0
    wedge_timeout_s: float | None = None


@dataclass
class _Read:
    t: float
    running: int
    waiting: int
    ended: float | None
    aborted: float | None
    steps: int | None
    kv_used: float | None


def _norm(url: str) -> str:
    return url.rstrip("/").replace("://localhost", "://127.0.0.1")


class FleetRun:
    """One fleet check (async inside; ``run`` is synchronous). ``on_line`` gets progress lines."""

    def __init__(self, opts: FleetOptions, on_line=print) -> None:
        self.opts, self.on_line = opts, on_line
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.router = opts.router.rstrip("/")
        self.conns: dict[str, Connection] = {}
        self.probes: list[judge.Probe] = []
        self._n = 0

    # --- reading -------------------------------------------------------------------------
    async def _page(self, client: httpx.AsyncClient, conn: Connection) -> tuple[float, MetricsPage, str]:
        t = time.time()
        r = await client.get(f"{conn.base}{conn.metrics_path}", headers=conn.headers)
        r.raise_for_status()
        return t, parse_page(r.text), r.text

    async def _read(self, client: httpx.AsyncClient, url: str) -> _Read:
        conn = self.conns[url]
        t, page, _ = await self._page(client, conn)
        m = conn.adapter.read(page, {})
        steps = page.total(_STEPS)
        return _Read(t, m.num_running, m.num_waiting, m.requests_finished, m.aborted,
                     None if steps is None else int(steps), m.kv_used)

    async def _read_all(self, client: httpx.AsyncClient) -> dict[str, _Read]:
        reads = await asyncio.gather(*(self._read(client, u) for u in self.conns))
        return dict(zip(self.conns, reads))

    async def _router_page(self, client: httpx.AsyncClient) -> MetricsPage | None:
        if not self.opts.router_metrics:
            return None
        try:
            r = await client.get(self.opts.router_metrics.rstrip("/") + ("" if self.opts.router_metrics.rstrip("/")
                                                                          .endswith("/metrics") else "/metrics"))
            r.raise_for_status()
            return parse_page(r.text)
        except (httpx.HTTPError, MetricsFormatError):
            return None

    @staticmethod
    def per_worker(page: MetricsPage | None, names: tuple[str, ...]) -> dict[str, float] | None:
        """The first of ``names`` on a router's ``page`` that has a ``worker`` label, summed per
        worker URL (normalised: no trailing slash, localhost as 127.0.0.1); None when absent."""
        if page is None:
            return None
        for name in names:
            s = [x for x in page.series(name) if "worker" in x.labels]
            if s:
                out: dict[str, float] = {}
                for x in s:
                    out[_norm(x.labels["worker"])] = out.get(_norm(x.labels["worker"]), 0.0) + x.value
                return out
        return None

    # --- phases --------------------------------------------------------------------------
    async def _idle_kv(self, client: httpx.AsyncClient, url: str, wave: str) -> float | None:
        drv = BlackboxDriver(self.conns[url], NullProbe(), 1, self.opts.drain_timeout_s)
        state = await drv.idle_point(client, wave)
        return None if state is None else state.kv_used

    async def _wait_fleet_idle(self, client: httpx.AsyncClient) -> bool:
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while time.monotonic() < deadline:
            reads = await self._read_all(client)
            if all(r.running == 0 and r.waiting == 0 for r in reads.values()):
                return True
            await asyncio.sleep(0.1)
        return False

    async def _load(self, client: httpx.AsyncClient) -> dict:
        specs = self.opts.specs
        if not specs:
            return {"sent": 0}
        sem = asyncio.Semaphore(self.opts.max_concurrency)
        results = {s.request_id: RequestResult(s.request_id, s.action.kind, s.action.label, 0.0) for s in specs}

        async def one(spec: RequestSpec) -> None:
            async with sem:
                await send_request(self.router, spec, results[spec.request_id], self.headers, self.body)

        self.on_line(f"load: {len(specs)} requests through the router {self.router}")
        await asyncio.gather(*(one(s) for s in specs))
        outcomes: dict[str, int] = {}
        for r in results.values():
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        return {"sent": len(specs), "outcomes": outcomes}

    async def _probe(self, client: httpx.AsyncClient, base: str, path: str, action: str) -> judge.Probe:
        """One early leaver sent to ``base`` alone on an idle fleet, attributed and timed."""
        self._n += 1
        rid = f"vlite-fleet-{path}-{self._n}-{int(time.time() * 1000) % 10**8}"
        before = await self._read_all(client)
        router_before = self.per_worker(await self._router_page(client), (judge.ROUTER_ROUTED,))
        body = {"prompt": _PROMPT, "max_tokens": self.opts.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, **self.body}
        left_at = None
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as c:  # its own connection
            try:
                async with c.stream("POST", f"{base}/v1/completions", json=body,
                                    headers={"X-Request-Id": rid, **self.headers}) as resp:
                    if resp.status_code == 200 and action == "disconnect-stream":
                        n = 0
                        async for line in resp.aiter_lines():
                            if line.startswith("data: ") and '"text"' in line:
                                n += 1
                                if n >= 2:
                                    break
                    left_at = time.time()
            except httpx.HTTPError as exc:
                self.on_line(f"probe {rid}: {type(exc).__name__}: {exc}")
                left_at = left_at or time.time()
        served, seen, ended_at, end_step, timeline = None, None, None, None, {u: [] for u in self.conns}
        deadline = time.monotonic() + self.opts.drain_timeout_s
        aborted = None
        while time.monotonic() < deadline:
            reads = await self._read_all(client)
            for u, r in reads.items():
                if r.steps is not None:
                    timeline[u].append((r.t, r.steps))
                b = before[u]
                if served is None and r.ended is not None and b.ended is not None and r.ended > b.ended:
                    served, ended_at, end_step = u, r.t, r.steps
                    if r.aborted is not None and b.aborted is not None:
                        aborted = r.aborted > b.aborted
                if seen is None and (r.running > b.running or r.waiting > b.waiting):
                    seen = u
            if served is not None and all(r.running == 0 and r.waiting == 0 for r in reads.values()):
                break
            await asyncio.sleep(self.opts.scrape_s)
        replica = served or seen
        router_after = self.per_worker(await self._router_page(client), (judge.ROUTER_ROUTED,))
        worker = None
        if router_before is not None and router_after is not None:
            moved = [w for w, v in router_after.items() if v > router_before.get(w, 0.0)]
            worker = moved[0] if moved else None
        if path == "direct":
            replica = _norm(base) if replica is None else replica
        return judge.Probe(rid, path, action, replica, left_at, ended_at, end_step,
                           timeline.get(replica, []) if replica else [], aborted, worker)

    async def _main(self) -> dict:
        o = self.opts
        async with httpx.AsyncClient(timeout=10.0) as client:
            pages_before = {u: (await self._page(client, c))[2] for u, c in self.conns.items()}
            kv_before = {u: await self._idle_kv(client, u, "baseline") for u in self.conns}
            ended_before = {u: r.ended for u, r in (await self._read_all(client)).items()}
            rpage = await self._router_page(client)
            if o.router_metrics and rpage is None:
                self.on_line(f"--router-metrics {o.router_metrics}: no Prometheus page there; the router's "
                             "per-worker counts are not read")
            routed_before = self.per_worker(rpage, (judge.ROUTER_ROUTED,))
            load = await self._load(client)
            if not await self._wait_fleet_idle(client):
                self.on_line(f"the fleet did not go idle within {o.drain_timeout_s:g} s after the load")
            need = {u: o.probes_per_replica for u in self.conns}
            for k in range(o.probes_per_replica * len(self.conns) * 3):
                if all(v <= 0 for v in need.values()):
                    break
                p = await self._probe(client, self.router, "router", PROBE_ACTIONS[k % len(PROBE_ACTIONS)])
                self.probes.append(p)
                if p.replica in need:
                    need[p.replica] -= 1
                self.on_line(f"probe {p.probe_id} ({p.action}) through the router: served by {p.replica or 'none'}"
                             + (f" (router says {p.router_worker})" if p.router_worker else "")
                             + (f", ended {p.ended_at - p.left_at:.2f} s after the client left"
                                if p.ended_at and p.left_at else ", not seen ending")
                             + ("" if p.aborted is None else f", abort counted: {'yes' if p.aborted else 'no'}"))
                if not await self._wait_fleet_idle(client):
                    break
            pages_after = {u: (await self._page(client, c))[2] for u, c in self.conns.items()}
            step_time = {u: itl_p99(pages_before[u], pages_after[u], _ITL.get(c.adapter.kind, ""))
                         for u, c in self.conns.items()}
            # the control: the same early leaver sent to the replica directly, where the router lost one
            for u in self.conns:
                mine = [p for p in self.probes if p.replica == u and p.path == "router"]
                rows = [judge.judge_probe(p, step_time[u], o.threshold_s, o.threshold_steps) for p in mine]
                if any(r["zombie"] for r in rows):
                    p = await self._probe(client, u, "direct", PROBE_ACTIONS[0])
                    self.probes.append(p)
                    self.on_line(f"control {p.probe_id} sent to {u} directly: "
                                 + (f"ended {p.ended_at - p.left_at:.2f} s after the client left" if p.ended_at
                                    else "not seen ending"))
                    await self._wait_fleet_idle(client)
            await self._wait_fleet_idle(client)
            # before the final 1-token requests, less the direct controls: what came through the router
            ended_after = {u: None if r.ended is None else r.ended - sum(
                1 for p in self.probes if p.path == "direct" and p.replica == u)
                for u, r in (await self._read_all(client)).items()}
            kv_after = {u: await self._idle_kv(client, u, "final") for u in self.conns}
            rpage = await self._router_page(client)
            routed_after = self.per_worker(rpage, (judge.ROUTER_ROUTED,))
            in_flight = self.per_worker(rpage, judge.ROUTER_IN_FLIGHT)
        facts = []
        for u, c in self.conns.items():
            routed = (routed_after.get(u, 0.0) - (routed_before or {}).get(u, 0.0)
                      if routed_after is not None else None)
            ended = (ended_after[u] - ended_before[u] if ended_after[u] is not None and ended_before[u] is not None
                     else None)
            facts.append(judge.ReplicaFacts(u, c.adapter.kind, self.units[u], kv_before[u], kv_after[u],
                                            step_time[u], routed, ended))
        result = judge.judge_fleet(facts, self.probes, in_flight, threshold_s=o.threshold_s,
                                   threshold_steps=o.threshold_steps, router_metrics=o.router_metrics)
        agree = [p for p in self.probes if p.path == "router" and p.router_worker is not None]
        result["attribution"] = (
            "per-replica counters (request_success_total, running and waiting gauges) read before and after each "
            "probe, one probe at a time on an idle fleet"
            + (f"; the router's {judge.ROUTER_ROUTED}{{worker}} agreed on "
               f"{sum(1 for p in agree if p.router_worker == p.replica)}/{len(agree)} probes" if agree else
               "; the router names no worker in its response headers" + ("" if o.router_metrics else
                                                                        " (no --router-metrics to cross-check)")))
        result["load"] = load
        # everything judged, so that ``checks.fleet.rejudge`` gives the same verdicts from fleet.json
        result["facts"] = [asdict(f) for f in facts]
        result["probes"] = [asdict(p) for p in self.probes]
        result["router_url"] = self.router
        result["router_metrics"] = o.router_metrics
        return result

    def run(self) -> dict:
        """Connect to every replica and the router, run the phases, judge; the result dict of
        ``checks.fleet.judge_fleet`` plus ``attribution``, ``load`` and ``probes``.

        Raises:
            TargetError: a replica or the router cannot be reached or read (one line).
        """
        for u in self.opts.replicas:
            self.conns[_norm(u)] = connect(u, "auto", self.opts.api_key)
        self.units = {u: c.state().unit for u, c in self.conns.items()}
        with httpx.Client(timeout=10.0) as c:
            wait_ready(self.router, c)
        self.body = next(iter(self.conns.values())).body
        try:
            before = self._storm_before() if self.opts.storm_requests else None
            result = asyncio.run(self._main())
            if before is not None:
                judge.apply_storm(result, self._storm_after(before))
            return result
        except (httpx.HTTPError, MetricsFormatError, KeyError) as exc:
            raise TargetError(f"fleet check: {type(exc).__name__}: {exc}") from exc

    # --- the storm checks (targets/storm.py), per replica -------------------------------
    def _storm_before(self) -> dict[str, dict]:
        """Each replica's wedge-probe latencies and output canary, sent to it directly before any
        client leaves (a replica's canary must be compared with its own output)."""
        from vlite.diagnostics.targets.storm import measure_before

        self.on_line(f"storm checks: the wedge probe's request and the output canary on each of the "
                     f"{len(self.conns)} replicas before any client abort")
        with httpx.Client() as client:
            return {u: measure_before(client, u, headers=self.headers, body=self.body) for u in self.conns}

    def _storm_after(self, before: dict[str, dict]) -> dict[str, dict]:
        """The abort storm through the router (a mass disconnect as clients make it), then each
        replica's wedge probe and canary, sent to it directly."""
        from vlite.diagnostics.checks.storm import wedge_bound
        from vlite.diagnostics.targets.storm import abort_storm, fit_max_tokens, judge_after

        with httpx.Client() as client:
            first = next(iter(self.conns))
            max_tokens = fit_max_tokens(client, first, self.headers, self.opts.max_tokens)
            self.on_line(f"abort storm: {self.opts.storm_requests} streamed requests through the router {self.router}, "
                         "cut together")
            storm = asyncio.run(abort_storm(self.router, self.opts.storm_requests, headers=self.headers,
                                            body=self.body, max_tokens=max_tokens))
            out = {}
            for u, b in before.items():
                bound = wedge_bound(b["probe_latencies_s"], override_s=self.opts.wedge_timeout_s)
                out[u] = judge_after(client, u, b, bound, storm, headers=self.headers, body=self.body)
            return out


class FleetTarget:
    """A fleet of replicas behind a router, as a ``LeakCheckTarget`` (kind "fleet"): ``run``
    runs a ``FleetRun`` and returns its ``TargetRun``, whose detail is a ``checks.fleet.FleetResult``.
    A first Ctrl-C ends the run with the probes measured so far, unjudged (INTERRUPTED)."""

    kind = "fleet"
    interruptible = None  # the Ctrl-C is caught in ``run``: the probes so far are kept

    def __init__(self, opts: FleetOptions) -> None:
        self.opts = opts

    def describe(self) -> str:
        return f"{len(self.opts.replicas)} replicas behind the router {self.opts.router.rstrip('/')}"

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """Run the fleet check (``FleetRun.run``); progress lines go to ``plan.on_line``.

        Raises:
            TargetError: a replica or the router cannot be reached or read (one line).
        """
        o = self.opts
        info = dict(plan.info, router=o.router, replicas=", ".join(o.replicas), probes_per_replica=o.probes_per_replica,
                    max_tokens=o.max_tokens, requests=len(o.specs), storm_requests=o.storm_requests)
        fleet = FleetRun(o, on_line=plan.on_line)
        try:
            doc = fleet.run()
        except KeyboardInterrupt:  # keep what was measured: the probes so far, unjudged
            n = len(fleet.probes)
            doc = {"verdict": "INTERRUPTED", "probes": [asdict(p) for p in fleet.probes]}
            return TargetRun(self.kind, "INTERRUPTED", f"INTERRUPTED - {n} probes measured (above), no verdict",
                             judge.FleetResult(doc), pd.DataFrame(), info, [],
                             interrupted=f"interrupted: {n} probes measured, no verdict")
        return TargetRun(self.kind, doc["verdict"], judge.summary(doc), judge.FleetResult(doc), pd.DataFrame(),
                         info, [])
