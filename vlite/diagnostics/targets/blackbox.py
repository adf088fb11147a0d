"""Black-box leak check of any OpenAI-compatible server: only ``/metrics`` and process memory.

No ledger and no ``/debug/blocks``: the server is read through its adapter
(``readers/adapters.py``), and the replay is designed so that the numbers alone can say which
client action leaves KV cache behind.

1. **Waves** whose mix of client actions differs from wave to wave (seeded). After each wave the
   client waits until ``running == waiting == 0`` for ``IDLE_SCRAPES`` scrapes in a row (bounded
   by ``drain_timeout_s``; a server that never drains gives INCONCLUSIVE), then sends a **probe**:
   a 1-token request that forces the engine to step (vLLM refreshes its gauges only when it steps),
   waits for idle again and reads the **residual**: KV used minus the baseline before the first wave.
2. **Verdict**: the final residual is confirmed by more probes for up to ``drain_timeout_s``
   (SGLang's idle gauges lag); it is a LEAK only if it stays above the baseline. Evictable
   prefix-cache entries are free in every adapter, so prefix-cache occupancy is never a leak.
3. **Attribution**: the residual increments of the waves are fitted on the per-wave counts of
   each client action kind by non-negative least squares (``scipy.optimize.nnls``; numpy's lstsq
   clipped at 0 when scipy is missing), with a 95% bootstrap interval over waves: KV units left
   per request, by client action.
4. **Bisection**: for each suspected kind, its requests are replayed (fresh request ids, and a
   unique first word so that a prefix-cache hit on a leaked block cannot hide a new leak) and
   halved while a half still leaves usage behind, within ``bisect_budget_s``: the minimal set is
   the reproducer (``reproducer.jsonl``, replayable with ``--workload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx
import numpy as np
import pandas as pd

from vlite.diagnostics.checks.cardinality import cardinality_check, series_counts
from vlite.diagnostics.checks.cardinality import describe as describe_cardinality
from vlite.diagnostics.checks.detect import Trend, trough_trend
from vlite.diagnostics.checks.probe_census import describe as describe_probe_census
from vlite.diagnostics.checks.probe_census import probe_census_check
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.readers.probe_series import ProbeReader, session_dir
from vlite.diagnostics.readers.process import ProcessTreeProbe, is_local_url, listening_pid
from vlite.diagnostics.readers.samplers import Sampler
from vlite.diagnostics.targets.base import TargetError, TargetPlan, TargetRun
from vlite.diagnostics.targets.connection import IDLE_SCRAPES, BlackboxDriver, Connection, NullProbe
from vlite.diagnostics.targets.zombie_blackbox import apply_to, zombie_check_blackbox
from vlite.diagnostics.workload.actions import ABORT_KINDS, ACTION_KINDS, ClientAction, plan_action
from vlite.diagnostics.workload.replay import IdlePoint, ReplayResult, RequestResult
from vlite.diagnostics.workload.sources import RequestSpec


def action_text(a: ClientAction) -> str:
    """The trace spelling of an action (``disconnect-stream:3``, ``client-timeout:0.5``)."""
    if a.kind in ("abort-after-tokens", "disconnect-stream"):
        return f"{a.kind}:{a.after_tokens}"
    if a.kind == "client-timeout":
        return f"{a.kind}:{a.timeout_s}"
    return a.kind


def design_waves(specs: list[RequestSpec], num_waves: int, seed: int, abort_rate: float,
                 kinds: tuple[str, ...] = ABORT_KINDS) -> list[list[RequestSpec]]:
    """Split ``specs`` into ``num_waves`` waves and redraw each request's client action so that the
    mix differs from wave to wave: wave w aborts with rate ``abort_rate`` x U(0.4, 1.6) (capped at 1)
    and picks abort kinds with weights from a Dirichlet(0.6) draw. Seeded, hence reproducible.
    With ``abort_rate`` 0 every request completes.
    """
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    num_waves = max(1, min(num_waves, len(specs)))
    size = -(-len(specs) // num_waves)
    waves = []
    for w in range(num_waves):
        chunk = specs[w * size:(w + 1) * size]
        if not chunk:
            break
        rate = min(1.0, abort_rate * rng.uniform(0.4, 1.6))
        weights = nprng.dirichlet([0.6] * len(kinds))
        out = []
        for s in chunk:
            if rng.random() < rate:
                kind = kinds[int(nprng.choice(len(kinds), p=weights))]
                action = plan_action(rng, 1.0, kind, s.max_tokens)
            else:
                action = ClientAction()
            out.append(replace(s, action=action, arrival_s=0.0))
        waves.append(out)
    return waves


def split_waves(specs: list[RequestSpec], idle_every: int) -> list[list[RequestSpec]]:
    """Waves of ``idle_every`` requests, actions as given (a trace replays as written)."""
    step = idle_every or len(specs)
    return [specs[i:i + step] for i in range(0, len(specs), step)]


def fit_leak_per_action(counts: np.ndarray, increments: np.ndarray, kinds: list[str], seed: int = 0,
                        n_boot: int = 300) -> list[dict]:
    """Fit residual increments (units per wave) on per-wave action counts: units left per request.

    Non-negative least squares (``scipy.optimize.nnls``; numpy least squares clipped at 0 when
    scipy is missing). The interval is the 2.5-97.5 percentile of the same fit on waves resampled
    with replacement. Returns one row per kind: ``client_action``, ``per_request``, ``ci95``,
    ``requests`` (how many were sent).
    """
    counts = np.asarray(counts, dtype=float)
    y = np.asarray(increments, dtype=float)
    try:
        from scipy.optimize import nnls

        def solve(a, b):
            return nnls(a, b)[0]
    except ImportError:  # pragma: no cover - scipy is a dependency; kept for installs without it
        def solve(a, b):
            return np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0, None)
    coef = solve(counts, y) if len(y) else np.zeros(len(kinds))
    rng = np.random.default_rng(seed)
    boots = []
    if len(y) >= 2:
        for _ in range(n_boot):
            idx = rng.integers(0, len(y), len(y))
            boots.append(solve(counts[idx], y[idx]))
    lo = np.percentile(boots, 2.5, axis=0) if boots else coef
    hi = np.percentile(boots, 97.5, axis=0) if boots else coef
    return [{"client_action": k, "per_request": float(coef[i]), "ci95": [float(lo[i]), float(hi[i])],
             "requests": int(counts[:, i].sum())} for i, k in enumerate(kinds)]


@dataclass
class BlackboxResult:
    """A black-box leak check (or a ``--from-log`` post-mortem).

    verdict: CLEAN | LEAK | ZOMBIE | INCONCLUSIVE (exit 0 / 1 / 1 / 3). kv values in ``unit`` (blocks, tokens
    or a fraction). residual = final - baseline. probes: every 1-token probe (time, wave, KV
    before and after). suspects: one per client action kind found leaking (``client_action``,
    ``blocks_per_request`` or ``tokens_per_request``, ``ci95``, ``request_ids`` of the minimal set).
    """

    verdict: str
    summary: str
    server_kind: str
    unit: str
    block_size: int | None
    kv_total: float | None
    baseline: float | None
    final: float | None
    trends: list[Trend]
    samples: pd.DataFrame
    replay: ReplayResult
    info: dict = field(default_factory=dict)
    probes: list[dict] = field(default_factory=list)
    fit: list[dict] = field(default_factory=list)
    suspects: list[dict] = field(default_factory=list)
    bisection: list[dict] = field(default_factory=list)
    reproducer: list[RequestSpec] = field(default_factory=list)
    process_tree: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source: str = "blackbox"  # blackbox | log
    zombies: dict | None = None  # the zombie check (zombie_blackbox.py), when it ran
    headline_not_exercised: bool = False  # CLEAN, but the waves sent no client abort: exit 4 (base.py)
    cardinality: dict | None = None  # /metrics series per family over the idle points (cardinality.py)
    drained: bool = True  # every wave drained (False: the server stopped going idle)
    storm: dict | None = None  # the wedge probe and output canary after the abort storm (storm.py), when run
    # KV used (``unit``) when the whole check ended: bisection, zombie and storm requests run
    # after ``final`` was read and may leak more
    kv_at_end: float | None = None
    probe: dict | None = None  # the vlite probe's census inside the server (checks/probe_census.py), if loaded

    @property
    def residual(self) -> float | None:
        return None if self.final is None or self.baseline is None else self.final - self.baseline

    @property
    def exit_code(self) -> int:
        return self.as_target_run(self.source).exit_code

    def as_target_run(self, kind: str) -> TargetRun:
        """This result as the ``TargetRun`` of a target of ``kind`` ("blackbox" or "log")."""
        return TargetRun(kind, self.verdict, self.summary, self, self.samples, self.info, self.notes, self.replay,
                         headline_not_exercised=self.headline_not_exercised)


def _rss(memory) -> int | None:
    return memory.read().get("rss_bytes")


async def _replay_waves(driver: BlackboxDriver, waves: list[list[RequestSpec]], results: dict[str, RequestResult],
                        out: ReplayResult, series: list | None = None, probe: ProbeReader | None = None,
                        probe_points: list | None = None,
                        quiet: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                        ) -> tuple[list[float], bool]:
    """Replay every wave with a confirmed idle point after each. Returns (KV used at each idle
    point, baseline first) and whether every wave drained. ``series`` gets, per idle point,
    (requests served, the page's series per family: ``cardinality.series_counts``);
    ``probe_points`` gets (requests served, the probe's census: ``probe.at_idle_point``, read
    inside ``quiet()``: the run's own sampling paused, so the server can go idle)."""
    series = [] if series is None else series
    probe_points = [] if probe_points is None else probe_points
    used: list[float] = []
    completed = 0
    async with httpx.AsyncClient(timeout=30.0) as client:
        base = await driver.idle_point(client, "baseline")
        if base is None:
            return used, False
        used.append(base.kv_used)
        out.idle_points.append(IdlePoint(time.time(), 0, base.kv_used, _rss(driver.memory)))
        series.append((0, series_counts(driver.conn.metrics_text())))
        if probe is not None:
            probe_points.append((0, probe.at_idle_point(baseline=True)))
        for w, wave in enumerate(waves):
            for s in wave:
                results[s.request_id].arrival_time = time.time()
            if not await driver.send(wave, results, driver.wave_timeout_s):
                out.notes.append(f"wave {w + 1} did not finish within {driver.wave_timeout_s:g} s (requests "
                                 "cancelled: their connections were closed)")
            completed += len(wave)
            state = await driver.idle_point(client, f"wave {w + 1}")
            if state is None:
                return used, False
            used.append(state.kv_used)
            out.idle_points.append(IdlePoint(time.time(), completed, state.kv_used, _rss(driver.memory)))
            series.append((completed, series_counts(driver.conn.metrics_text())))
            if probe is not None:
                with quiet():
                    probe_points.append((completed, probe.at_idle_point()))
    return used, True


async def _confirm(driver: BlackboxDriver, baseline: float, last: float, budget_s: float) -> float:
    """Probe twice more, then (servers whose idle gauges lag, ``adapter.gauge_lag_s``) every 2 s
    for up to min(lag, ``budget_s``) while KV stays above the baseline: a lagging gauge comes back,
    a leak does not. Returns the last KV used read."""
    budget_s = min(budget_s, driver.conn.adapter.gauge_lag_s)
    deadline = time.monotonic() + budget_s
    async with httpx.AsyncClient(timeout=30.0) as client:
        for _ in range(2):  # at least two more probes
            state = await driver.probe(client, "confirmation")
            if state is not None:
                last = state.kv_used
        while last > baseline and time.monotonic() < deadline:
            await asyncio.sleep(2.0)
            state = await driver.probe(client, "confirmation")
            if state is not None:
                last = state.kv_used
    return last


async def _leaks(driver: BlackboxDriver, specs: list[RequestSpec], tag: str, tol: float, deadline: float
                 ) -> tuple[bool, float]:
    """Replay ``specs`` (fresh ids) between two confirmed idle points: does KV stay above?
    A replay still running at ``deadline`` (time.monotonic) is cancelled and counts as no."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        before = await driver.idle_point(client, f"bisection {tag} (before)")
        if before is None:
            return False, 0.0
        # A unique first word per replay: a prefix-cache hit on a leaked block would hide a new leak.
        fresh = [replace(s, request_id=f"{s.request_id}-{tag}", prompt=f"{tag} {s.prompt}") for s in specs]
        results = {s.request_id: RequestResult(s.request_id, s.action.kind, s.action.label, time.time()) for s in fresh}
        if not await driver.send(fresh, results, deadline - time.monotonic()):
            return False, 0.0
        after = await driver.idle_point(client, f"bisection {tag}")
        if after is None:
            return False, 0.0
        delta = after.kv_used - before.kv_used
        return abs(delta) > tol, delta


async def _bisect(driver: BlackboxDriver, candidates: list[RequestSpec], deadline: float, tol: float, label: str
                  ) -> tuple[list[RequestSpec], list[dict]]:
    """Halve ``candidates`` while one half alone still leaves usage behind (delta debugging)."""
    log = []
    n = 0

    async def test(subset):
        nonlocal n
        n += 1
        leaked, delta = await _leaks(driver, subset, f"{label}{n}", tol, deadline)
        log.append({"suspect": label, "tested": [s.request_id for s in subset], "leaked": leaked, "delta": delta})
        return leaked

    if not candidates or time.monotonic() > deadline or not await test(candidates):
        return [], log
    current = candidates
    while len(current) > 1 and time.monotonic() < deadline:
        half = len(current) // 2
        a, b = current[:half], current[half:]
        if await test(a):
            current = a
        elif time.monotonic() < deadline and await test(b):
            current = b
        else:
            break  # the leak needs requests from both halves (or the budget ran out)
    return current, log


def _suspects(fit: list[dict], unit: str, min_per_request: float) -> list[dict]:
    key = f"{unit}_per_request" if unit in ("blocks", "tokens") else "per_request"
    out = []
    for row in sorted(fit, key=lambda r: -r["per_request"]):
        if row["per_request"] >= min_per_request and row["requests"] > 0:
            out.append({"client_action": row["client_action"], key: round(row["per_request"], 4),
                        "ci95": [round(x, 4) for x in row["ci95"]], "requests_sent": row["requests"],
                        "request_ids": []})
    return out


def run_blackbox(conn: Connection, waves: list[list[RequestSpec]], *, max_concurrency: int = 32,
                 drain_timeout_s: float = 60.0, bisect_budget_s: float = 60.0, sample_interval_s: float = 0.1,
                 server_pid: int | None = None, url: str | None = None, seed: int = 0,
                 info: dict | None = None, memory=None) -> BlackboxResult:
    """Replay ``waves`` against ``conn`` with idle points and probes, then verdict, attribution,
    bisection and the reproducer. Never raises for a server that does not drain: INCONCLUSIVE."""
    url = url or conn.base
    notes: list[str] = []
    if memory is None:
        pid = server_pid if server_pid is not None else (listening_pid(url) if is_local_url(url) else None)
        if pid is None:
            memory = NullProbe()
            notes.append("remote server: metrics only (no process memory)" if not is_local_url(url) else
                         "the server's process was not found on this host (pass --server-pid): metrics only")
        else:
            memory = ProcessTreeProbe(pid)
            if memory.note:
                notes.append(memory.note)
    else:
        pid = server_pid

    def source() -> dict:
        return conn.state().row()

    specs = [s for wave in waves for s in wave]
    results = {s.request_id: RequestResult(s.request_id, s.action.kind, s.action.label, 0.0) for s in specs}
    out = ReplayResult([results[s.request_id] for s in specs], start_time=time.time())
    driver = BlackboxDriver(conn, memory, max_concurrency, drain_timeout_s)
    first = conn.state()
    unit, tol = first.unit, (1e-6 if first.unit == "fraction" else 0.0)
    sampler = Sampler(source, memory, sample_interval_s).start()
    t0 = time.time()
    suspects, fit, bis_log, repro = [], [], [], []
    series: list = []
    probe, probe_points = ProbeReader(conn.metrics_text, session_dir(pid)), []
    try:
        used, drained = asyncio.run(_replay_waves(driver, waves, results, out, series, probe, probe_points,
                                                         quiet=sampler.paused))
        out.end_time = time.time()
        baseline = used[0] if used else None
        final = used[-1] if used else None
        if first.kv_used is None:
            verdict = Verdict.INCONCLUSIVE
            summary = (f"INCONCLUSIVE: this {conn.adapter.kind} server exports no KV-cache gauge "
                       f"({conn.adapter.caveat}); only process memory was sampled")
        elif not drained and len(used) >= 2 and used[-1] - baseline > tol:
            verdict = Verdict.LEAK
            summary = (f"LEAK: {used[-1] - baseline:g} {unit} of KV cache still used at the idle point after wave "
                       f"{len(used) - 1} (after a probe; baseline {baseline:g}); then the server stopped draining "
                       f"within --drain-timeout {drain_timeout_s:g} s (the leak may have exhausted the pool)")
        elif not drained:
            verdict = Verdict.INCONCLUSIVE
            summary = (f"INCONCLUSIVE: the server did not drain (running == waiting == 0 for {IDLE_SCRAPES} "
                       f"scrapes) within --drain-timeout {drain_timeout_s:g} s after "
                       f"{'the baseline' if not used else f'wave {len(used) - 1}'}; no verdict on a busy server")
        else:
            if abs(final - baseline) > tol:
                final = asyncio.run(_confirm(driver, baseline, final, drain_timeout_s))
            residual = final - baseline
            if residual < -tol:
                verdict = Verdict.LEAK
                summary = (f"LEAK (excess): {-residual:g} {unit} fewer in use at idle than at the baseline "
                           f"({baseline:g} -> {final:g} {unit}): blocks freed twice (double free) or a double count")
            elif residual > tol:
                verdict = Verdict.LEAK
                summary = (f"LEAK: {residual:g} {unit} of KV cache still used at idle after the {len(used) - 1} "
                           f"waves (KV used at idle: baseline {baseline:g} -> {final:g} {unit}, read before "
                           "any bisection)")
            else:
                verdict = Verdict.CLEAN
                summary = (f"CLEAN: KV cache back to its baseline ({baseline:g} {unit}) at every idle point, "
                           f"confirmed by {len(driver.probes)} 1-token probes")
        if verdict == Verdict.LEAK and len(used) >= 2:
            kinds = sorted({s.action.kind for s in specs}, key=list(ACTION_KINDS).index)
            counts = np.array([[sum(s.action.kind == k for s in wave) for k in kinds] for wave in waves[:len(used) - 1]])
            increments = np.abs(np.diff(np.array(used, dtype=float)))  # an excess counts as much as a deficit
            fit = fit_leak_per_action(counts, increments, kinds, seed=seed)
            min_per = 0.25 if unit == "blocks" else (1.0 if unit == "tokens" else 1e-4)
            suspects = _suspects(fit, unit, min_per)
            deadline = time.monotonic() + bisect_budget_s
            for sus in suspects:
                last = driver.probes[-1]["kv_used_after"] if driver.probes else None
                if first.kv_total and last is not None and last >= 0.9 * first.kv_total:
                    notes.append(f"bisection stopped: the leak holds {last:g} of {first.kv_total:g} {unit}, the "
                                 "pool is nearly exhausted (restart the server to bisect further)")
                    break
                cands = [s for s in specs if s.action.kind == sus["client_action"]]
                minimal, log = asyncio.run(_bisect(driver, cands, deadline, tol, f"b{len(bis_log)}-"))
                bis_log.extend(log)
                sus["request_ids"] = [s.request_id for s in minimal]
                sus["reproduced"] = bool(minimal)
                repro.extend(minimal)
            if suspects and not repro:
                notes.append("bisection did not reproduce the leak within --bisect-budget: the suspects rest "
                             "on the fit alone")
    finally:
        sampler.stop()
    sampler.sample()
    cardinality = cardinality_check(series)
    if cardinality["verdict"] == Verdict.LEAK:  # one series per client value: a leak whatever the KV cache says
        growth = "/metrics series growing with requests: " + describe_cardinality(cardinality)
        summary = f"{summary}; {growth}" if verdict == Verdict.LEAK else f"LEAK: {growth}"
        verdict = Verdict.LEAK
    census = probe_census_check(probe_points)
    if census is not None and census["verdict"] == Verdict.LEAK:  # request state kept in a server process
        held = "request ids kept in the server's processes (vlite probe): " + describe_probe_census(census)
        summary = f"{summary}; {held}" if verdict == Verdict.LEAK else f"LEAK: {held}"
        verdict = Verdict.LEAK
    elif census is not None and verdict == Verdict.CLEAN and census["verdict"] == Verdict.CLEAN:
        summary += f"; no container in the server's {len(census['processes'])} probed processes kept request ids"
    verdict, summary = _with_server_errors(verdict, summary, out, driver.errors)
    block_size = first.block_size
    trends = [replace(trough_trend(out.idle_points), y_unit=unit), trough_trend(out.idle_points, "rss_bytes")]
    facts = {"target": "blackbox", "url": conn.base, "server_kind": conn.adapter.kind, "server_pid": pid,
             "unit": unit, "block_size": block_size, "kv_total": first.kv_total,
             "num_requests": len(specs), "num_waves": len(waves), "gpu_source": getattr(memory, "gpu_source", None),
             "replay_s": round(time.time() - t0, 2), "sampler_errors": sampler.errors,
             "drain_timeout_s": drain_timeout_s, "bisect_budget_s": bisect_budget_s, **(info or {})}
    notes.extend(out.notes)
    notes.append(f"{conn.adapter.kind}: {conn.adapter.caveat}")
    # a black box shows no engine path, but whether the waves sent a client abort it knows
    no_abort = verdict == Verdict.CLEAN and not any(s.action.is_abort for s in specs)
    if no_abort:
        summary = summary.replace("CLEAN: ", "CLEAN, but no client abort was sent (--abort-rate 0): ", 1)
    return BlackboxResult(verdict, summary, conn.adapter.kind, unit, block_size, first.kv_total, baseline, final,
                          trends, sampler.frame(), out, facts, driver.probes, fit, suspects, bis_log, repro,
                          list(getattr(memory, "last_tree", [])), notes, headline_not_exercised=no_abort,
                          cardinality=cardinality, drained=drained, kv_at_end=_kv_now(conn), probe=census)


def _kv_now(conn: Connection) -> float | None:
    """KV used now, in the server's unit (None: ``/metrics`` not read)."""
    try:
        return conn.state().kv_used
    except TargetError:
        return None


def _with_server_errors(verdict: str, summary: str, out: ReplayResult, errors: list[dict]) -> tuple[str, str]:
    """Fold the control requests that got a 5xx or lost their connection into the replay's
    ``engine_errors`` and the verdict: a CLEAN run becomes ENGINE-ERROR, another names them."""
    if not errors:
        return verdict, summary
    from vlite.diagnostics.checks.engine_errors import describe

    out.engine_errors.extend(errors)
    words = describe(errors).replace("from the engine", "from the server")
    if verdict == "CLEAN":
        return "ENGINE-ERROR", f"ENGINE-ERROR: {words}; the KV cache was back to its baseline at every idle point"
    return verdict, f"{summary}; {words}"


class BlackboxTarget:
    """Any OpenAI-compatible server behind ``conn``, read only through its ``/metrics`` and its
    process memory: the ``LeakCheckTarget`` around ``run_blackbox``, then the zombie check
    (``zombie_blackbox.py``) when the replay reached a verdict.

    Args:
        conn: the server (``connection.connect``).
        url: the URL the user gave (default ``conn.base``): a local one lets the process be found.
        drain_timeout_s: how long to wait for the server to go idle (else INCONCLUSIVE).
        bisect_budget_s: seconds for bisecting the leaking requests.
        server_pid: the server's root process (default: the one listening on the port).
        zombie_max_tokens: max_tokens of the zombie check's early leavers (0: no zombie check).
        storm_requests: requests in the abort storm after the waves, followed by the wedge probe
            and the output canary (``storm.py``; 0: none of the three).
        wedge_timeout_s: the wedge probe's bound in seconds (None: from the probe's latencies
            before any abort, ``checks/storm.wedge_bound``).
    """

    kind = "blackbox"
    interruptible = None

    def __init__(self, conn: Connection, *, url: str | None = None, drain_timeout_s: float = 60.0,
                 bisect_budget_s: float = 60.0, server_pid: int | None = None, zombie_max_tokens: int = 0,
                 storm_requests: int = 0, wedge_timeout_s: float | None = None) -> None:
        self.conn, self.url = conn, url
        self.drain_timeout_s, self.bisect_budget_s = drain_timeout_s, bisect_budget_s
        self.server_pid, self.zombie_max_tokens = server_pid, zombie_max_tokens
        self.storm_requests, self.wedge_timeout_s = storm_requests, wedge_timeout_s

    def describe(self) -> str:
        return f"{self.conn.adapter.kind} at {self.conn.base}"

    def waves(self, plan: TargetPlan) -> list[list[RequestSpec]]:
        """The plan's specs in waves: a trace's as written (``plan.idle_every`` each, default an
        eighth of the trace), else ``design_waves`` (``plan.idle_every`` each, default 10 waves)."""
        specs, every = plan.specs, plan.idle_every
        if plan.trace:
            return split_waves(specs, every if every is not None else max(1, -(-len(specs) // 8)))
        num_waves = -(-len(specs) // every) if every else min(10, len(specs))
        kinds = ABORT_KINDS if plan.abort_mode == "mix" else (plan.abort_mode,)
        return design_waves(specs, num_waves, plan.seed, plan.abort_rate, kinds)

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """Replay the plan in waves (``run_blackbox``), then the zombie check. ``stop`` is not
        watched: a black-box run has no partial verdict.

        Raises:
            TargetError: ``/metrics`` cannot be read any more.
        """
        waves, n = self.waves(plan), len(plan.specs)
        first = self.conn.state()
        pool = f", pool {first.kv_total:g} {first.unit}" if first.kv_total else ""
        bs = f", block_size {first.block_size} tokens" if first.block_size else ""
        plan.on_line(f"leak-check (black-box): {n} request{'s' if n != 1 else ''} in {len(waves)} "
                     f"wave{'s' if len(waves) != 1 else ''} against {self.describe()}{bs}{pool}")
        info = dict(plan.info, idle_every=len(waves[0]) if waves else 0)
        before = None
        if self.storm_requests:
            from vlite.diagnostics.targets.storm import PROBE_RUNS, measure_before

            plan.on_line(f"storm checks: the wedge probe's request ({PROBE_RUNS} times) and the output canary "
                         "(twice) before any client abort")
            before = measure_before(self.conn.client, self.conn.base, headers=self.conn.headers, body=self.conn.body)
        res = run_blackbox(self.conn, waves, max_concurrency=plan.max_concurrency,
                           drain_timeout_s=self.drain_timeout_s, bisect_budget_s=self.bisect_budget_s,
                           sample_interval_s=plan.sample_interval_s, server_pid=self.server_pid, url=self.url,
                           seed=plan.seed, info=info)
        if self.zombie_max_tokens and res.verdict != Verdict.INCONCLUSIVE and res.drained:
            plan.on_line(f"zombie check: one early-leaving request per client action, max_tokens "
                         f"{self.zombie_max_tokens}")
            zopts = plan.zombie_options or {}
            apply_to(res, zombie_check_blackbox(self.conn, max_tokens=self.zombie_max_tokens,
                                                threshold_s=zopts.get("threshold_s", 1.0),
                                                threshold_steps=zopts.get("threshold_steps", 2),
                                                drain_timeout_s=self.drain_timeout_s))
        if before is not None:
            self._storm_checks(res, before, plan)
        res.kv_at_end = _kv_now(self.conn)
        return res.as_target_run(self.kind)

    def _storm_checks(self, res: BlackboxResult, before: dict, plan: TargetPlan) -> None:
        """The abort storm (unless the waves already stopped the server draining: they were the
        storm), the wedge probe and the output canary, folded into ``res`` (``storm.apply_to``)."""
        from vlite.diagnostics.checks.storm import wedge_bound
        from vlite.diagnostics.targets import storm

        conn = self.conn
        bound = wedge_bound(before["probe_latencies_s"], override_s=self.wedge_timeout_s)
        sent = None
        if res.drained:
            max_tokens = storm.fit_max_tokens(conn.client, conn.base, conn.headers)
            plan.on_line(f"abort storm: {self.storm_requests} streamed requests at once, all cut together; then "
                         f"the wedge probe (bound {bound:.3g} s) and the output canary")
            sent = asyncio.run(storm.abort_storm(conn.base, self.storm_requests, headers=conn.headers,
                                                 body=conn.body, max_tokens=max_tokens))
        else:
            plan.on_line(f"the server stopped draining after the waves' client aborts: wedge probe (bound "
                         f"{bound:.3g} s)")
        storm.apply_to(res, storm.judge_after(conn.client, conn.base, before, bound, sent, headers=conn.headers,
                                              body=conn.body))
