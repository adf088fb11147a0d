"""Leak detection: drain invariant, trough trend, ledger attribution and CPU-side state.

1. Drain invariant at quiescence: num_free_blocks + num_cached_blocks (evictable) ==
   num_total_blocks. A deficit is a leak (blocks nobody will free); an excess (or a ref_count
   below 0, or a "double free" ledger anomaly) is a double free or a double count.
2. Trend: used blocks (and RSS) at idle points regressed on requests completed; a clean
   engine's troughs return to the baseline (slope ~ 0 blocks/request).
3. Attribution: every block still held, through the ledger, with its owner's origin, grouped
   by client action and allocation site.
4. CPU-side state: block tables and per-request entries left behind by finished sequences.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import pandas as pd

from vlite.diagnostics.checks.snapshot import Snapshot
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.workload.replay import IdlePoint, RequestResult


@dataclass
class DrainCheck:
    """The drain invariant at quiescence (all counts in blocks).

    mismatch_blocks = free + cached - total (signed); deficit_blocks = leaked blocks;
    excess_frees = frees beyond allocations (double free / double count).
    """

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    mismatch_blocks: int
    deficit_blocks: int
    excess_frees: int
    negative_ref_counts: int
    sign: str  # balanced | deficit | excess | deficit+excess
    quiescent: bool

    @property
    def ok(self) -> bool:
        return self.sign == "balanced"


@dataclass
class Trend:
    """Least-squares line of a trough series on requests completed.

    slope: units per request (blocks/request or bytes/request); ci95: (low, high) of the slope;
    r2: coefficient of determination; n: idle points used. None fields when n < 3.
    y_unit: the troughs' unit where it is not the metric's own (tokens, percent of the pool);
    x_unit: what one step of the x axis counts ("request"; "idle stretch" for a stats log).
    """

    metric: str
    n: int
    slope: float | None = None
    intercept: float | None = None
    ci95: tuple[float, float] | None = None
    r2: float | None = None
    baseline: float | None = None
    last: float | None = None
    threshold: float = 0.0  # units per request the CI must clear to count as rising
    y_unit: str | None = None
    x_unit: str = "request"

    @property
    def rising(self) -> bool:
        """The troughs climb: the CI of the slope lies above ``threshold`` (0 for blocks)."""
        return self.ci95 is not None and self.ci95[0] > self.threshold


def _slope(test: dict) -> float:
    """Bytes per request a host-memory test judged: after the step where it found one, else its late half's."""
    step = test.get("step") or {}
    return step["after_slope"] if step.get("after_slope") is not None else test["late_slope"]


@dataclass
class Findings:
    """Everything detection found; ``leak`` is the verdict (exit code 1)."""

    drain: DrainCheck
    trends: list[Trend]
    leaked_blocks: list[dict]
    by_request: list[dict]
    by_action: list[dict]
    by_site: list[dict]
    anomalies: list[dict]
    cpu_state: dict
    unattributed_blocks: int
    attribution_available: bool
    notes: list[str] = field(default_factory=list)
    # Coverage of engine paths, zombie requests, per-request registries, blocks the
    # ledger cannot name (see coverage.py, zombie.py, registries.py, evidence.py).
    coverage: dict | None = None
    zombies: dict | None = None
    registries: dict | None = None
    unattributed: list[dict] = field(default_factory=list)
    # The run was stopped early (Ctrl-C): what happened, in words (client.ReplayResult.interrupted).
    interrupted: str | None = None
    # Containers reachable from the engine that still hold ended requests (census.py)
    census: dict | None = None
    host_memory: dict | None = None  # host_memory.host_memory_check: its own verdict, HOST-LEAK
    # /metrics families whose series count grows with requests served (cardinality.py)
    cardinality: dict | None = None
    # CUDA allocation sites whose live bytes grew (readers/gpu_alloc_trace.py); names, never judges
    gpu_allocations: dict | None = None
    # The wedge probe and output canary after an abort storm (targets/storm.py, --url)
    storm: dict | None = None
    # exceptions the engine raised on a path the run drove (checks/engine_errors.py)
    engine_errors: list[dict] = field(default_factory=list)

    @property
    def host_leak(self) -> bool:
        """Host memory keeps its slope past warm-up (host_memory.py)."""
        return bool(self.host_memory and self.host_memory["verdict"] == Verdict.HOST_LEAK)

    @property
    def leak(self) -> bool:
        return (not self.drain.ok or bool(self.leaked_blocks) or bool(self.anomalies)
                or self.cpu_state["num_leftover_entries"] > 0 or bool(self.unattributed)
                or bool(self.registries and (self.registries["leftover"] or self.registries["over_bound"]))
                or bool(self.census and self.census["held"]) or self.census_overdue
                or bool(self.cardinality and self.cardinality["verdict"] == Verdict.LEAK))

    @property
    def census_overdue(self) -> bool:
        """A server's census was kept from its idle points although the engine had drained (a
        census a leak switched off); with the engine still busy, the drain check and
        the zombie check speak instead."""
        return bool(self.census and self.census.get("overdue") and self.drain.quiescent)

    @property
    def zombie(self) -> bool:
        """Some request outlived its client beyond the threshold (zombie.py)."""
        return bool(self.zombies and self.zombies["zombies"])

    @property
    def inconclusive(self) -> bool:
        """Every sequence the engine finished ended in an engine error ("error"): nothing was
        generated, so a clean drain proves nothing about the paths the workload meant to walk."""
        finishes = (self.coverage or {}).get("finish_reasons") or {}
        return bool(finishes) and set(finishes) == {"error"}

    @property
    def interrupted_verdict(self) -> bool:
        """The run was stopped early and shows no leak on a drained engine: its verdict is
        INTERRUPTED (a leak seen at quiescence is still a LEAK, whatever stopped the run)."""
        return self.interrupted is not None and not (self.leak and self.drain.quiescent)

    @property
    def verdict(self) -> str:
        """LEAK, HOST-LEAK (blocks and per-request state clean, host memory keeps growing past
        warm-up), ZOMBIE (no leak, but requests outlived their clients), ENGINE-ERROR (no
        leak, but the engine raised on a path the run drove: ``engine_errors``), INCONCLUSIVE (no leak
        seen, but every request failed in the engine), INTERRUPTED (stopped by Ctrl-C before the
        workload ended; the partial findings are reported, not a verdict) or CLEAN. The CLI exits
        0 for CLEAN, 1 for LEAK, ENGINE-ERROR, HOST-LEAK and ZOMBIE, 3 for INCONCLUSIVE (as the black-box
        check), 130 for INTERRUPTED."""
        if self.interrupted_verdict:
            return Verdict.INTERRUPTED
        if self.leak:  # a storm verdict beside a leak is named in its summary (the leak is the cause to fix)
            return Verdict.LEAK
        if self.engine_errors:  # the engine raised on a path the run drove, and nothing leaked from it
            return Verdict.ENGINE_ERROR
        if self.storm and self.storm.get("verdict"):  # WEDGED, EMPTY-OUTPUT, OUTPUT-DRIFT (checks/storm.py)
            return self.storm["verdict"]
        if self.host_leak:
            return Verdict.HOST_LEAK
        return Verdict.ZOMBIE if self.zombie else Verdict.INCONCLUSIVE if self.inconclusive else Verdict.CLEAN

    def _zombie_part(self) -> str:
        """"3 requests outlived their clients by more than 2 engine steps (--zombie-threshold-steps)
        (zombies)": the count, and the bound each was judged by with the option that sets it."""
        z = self.zombies
        rows = z["zombies"]
        bounds = []
        if any(r["outlived_steps"] is not None for r in rows):
            over_http = z.get("step_source") == "sampled" or z.get("gauge_lag_steps") is not None
            bounds.append(f"{z['threshold_steps']} engine steps (--zombie-threshold-steps)"
                          + (f" and {z['threshold_s']:g} s (--zombie-threshold-s)" if over_http else ""))
        if any(r["outlived_steps"] is None for r in rows):
            bounds.append(f"{z.get('bound_s', z['threshold_s']):g} s (--zombie-threshold-s)")
        who = "1 request outlived its client" if len(rows) == 1 else f"{len(rows)} requests outlived their clients"
        return f"{who} by more than {' or '.join(bounds)} (zombies)"

    @property
    def not_exercised(self) -> list[str]:
        """Checklist paths the run did not walk (coverage.py); empty where coverage is unknown."""
        return list((self.coverage or {}).get("not_exercised") or [])

    @property
    def headline_not_exercised(self) -> bool:
        """A CLEAN run that walked none of the headline paths (a client abort while waiting,
        during prefill or during decode: ``coverage.HEADLINE``): the command exits 4
        (``targets/base.py``), not 0."""
        from vlite.diagnostics.checks.coverage import no_client_abort

        return self.verdict == Verdict.CLEAN and self.coverage is not None and no_client_abort(self.not_exercised)

    def summary(self, caveat: bool = True) -> str:
        """The verdict line, e.g. "LEAK: 12 blocks held by 4 finished requests; ...". With
        ``caveat``, a run that left checklist paths unwalked says so on it: a CLEAN one right
        after the verdict word ("CLEAN, but abort during decode was not exercised: ..."), a
        LEAK, ZOMBIE or HOST-LEAK one at the end; a fixed scenario, which walks one path on
        purpose, passes False."""
        from vlite.diagnostics.checks.coverage import caveat as coverage_caveat

        line = self._verdict_summary()
        verdict = self.verdict
        if verdict == Verdict.LEAK and self.storm and self.storm.get("verdict"):
            line = f"{line}; after the abort storm: {self.storm['summary']}"
        if self.engine_errors and verdict not in (Verdict.ENGINE_ERROR, Verdict.INTERRUPTED):
            from vlite.diagnostics.checks.engine_errors import describe

            line = f"{line}; {describe(self.engine_errors)}"
        words = coverage_caveat(self.not_exercised) if caveat and verdict not in (Verdict.INTERRUPTED,
                                                                                  Verdict.INCONCLUSIVE) else None
        if words and verdict == Verdict.CLEAN and line.startswith("CLEAN: "):
            line = f"CLEAN, but {words}: {line[len('CLEAN: '):]}"
        elif words:
            line = f"{line}; {words}"
        return line

    def _verdict_summary(self) -> str:
        zombie_part = self._zombie_part() if self.zombie else ""
        if self.interrupted_verdict:
            d = self.drain
            seen = (f"drain of the partial run: {d.sign} ({d.num_free_blocks} free + {d.num_cached_blocks} cached vs "
                    f"{d.num_total_blocks} total blocks{'' if d.quiescent else '; the engine had not drained'})")
            return f"INTERRUPTED: {self.interrupted}; {seen}; not a verdict on the workload, rerun to the end for one"
        if self.engine_errors and not self.leak:
            from vlite.diagnostics.checks.engine_errors import describe

            return (f"ENGINE-ERROR: {describe(self.engine_errors)}; no leaked blocks or per-request state"
                    + (f"; {zombie_part}" if zombie_part else ""))
        if self.storm and self.storm.get("verdict") and not self.leak:
            return self.storm["summary"]
        if not self.leak and self.host_leak:
            grow = self.host_memory["growing"]
            hm = self.host_memory
            kinds = (hm.get("kind_growth") or {}).get("growing") or []
            procs = [n for n, t in (hm.get("processes") or {}).items() if t.get("keeps_growing")]
            what = (", ".join(f"{g['path']} +{g['entries_per_request']} entries/request"
                              + (f" ({g['probe']['kind']})" if g.get("probe") else "") for g in grow) if grow
                    else ", ".join(f"{k['process']} +{k['bytes_per_request'] / 1024:.1f} KiB per {k['kind']} request"
                                   for k in kinds) if kinds
                    else ", ".join(f"{n} RssAnon + VmSwap +{_slope(hm['processes'][n]) / 1024:.1f} KiB/request"
                                   for n in procs) if procs
                    else f"RssAnon + VmSwap +{_slope(hm['anon_swap']) / 1024:.1f} KiB/request")
            sites = (self.host_memory.get("allocation_sites") or {}).get("sites")
            if sites:
                what += f"; top growing allocation site {sites[0]['site']} +{sites[0]['bytes_per_request']:.0f} B/request"
            return (f"HOST-LEAK: host memory keeps growing past warm-up ({what}); KV blocks and per-request "
                    "state are clean" + (f"; {zombie_part}" if zombie_part else ""))
        if not self.leak and self.zombie:
            return "ZOMBIE: " + zombie_part
        if not self.leak and self.inconclusive:
            return (f"INCONCLUSIVE: every request ended in an engine error ({self.coverage['finish_reasons']['error']} "
                    f"sequences); no leak seen, but nothing ran (the engine log says why)")
        if not self.leak:
            host = (self.host_memory or {}).get("verdict")
            no_host_verdict = {
                "too short": ("; host memory: no verdict, the run is too short to tell warm-up or a one-time step "
                              "from a leak (the host-memory line says how many requests it needs)"),
                "inconclusive": ("; host memory: no verdict, its growth cannot be told from noise in this run (the "
                                 "host-memory line says what narrows it)")}
            return (f"CLEAN: drain invariant holds ({self.drain.num_free_blocks} free + {self.drain.num_cached_blocks} "
                    f"cached == {self.drain.num_total_blocks} total blocks); no per-request state left behind"
                    + no_host_verdict.get(host, ""))
        parts = []
        if self.drain.deficit_blocks or self.leaked_blocks:
            reqs = {b["request_id"] for b in self.leaked_blocks}
            parts.append(f"{self.drain.deficit_blocks} blocks leaked (deficit), held by {len(reqs)} finished requests")
        if self.drain.excess_frees:
            first = next((a for a in self.anomalies if a.get("release_sites")), None)
            sites = (f": block {first['block_id']} released by {' and again by '.join(first['release_sites'])}"
                     if first else "")
            parts.append(f"{self.drain.excess_frees} excess frees (double free{sites})")
        second = [a for a in self.anomalies if a.get("allocation_sites")]
        if second:  # one sequence took a block twice (ledger.SECOND_REFERENCE): name both allocations
            a = second[0]
            parts.append(f"{len(second)} second references by the same holder: block {a['block_id']} taken by "
                         f"seq {a['seq_id']} ({a['request_id']}) at {' and again at '.join(a['allocation_sites'])}")
        cpu = self.cpu_state
        if cpu["orphan_block_tables"]:
            parts.append(f"{len(cpu['orphan_block_tables'])} orphan block tables")
        if cpu["leftover_requests"]:
            parts.append(f"{len(cpu['leftover_requests'])} per-request entries left behind")
        if self.unattributed:
            parts.append(f"{len(self.unattributed)} unattributed blocks (not free, no ledger entry)")
        if self.registries and self.registries["leftover"]:
            parts.append("registries not empty at idle: " + ", ".join(
                f"{r['registry']} {r['entries']}" for r in self.registries["leftover"]))
        if self.registries and self.registries["over_bound"]:
            parts.append("histories over bound: " + ", ".join(h["history"] for h in self.registries["over_bound"]))
        if self.census and self.census["held"]:
            parts.append("ended requests still held at idle (census): " + ", ".join(
                f"{h['path']} {h['num_entries']}" for h in self.census["held"]))
        for o in (self.census or {}).get("overdue") if self.census_overdue else []:  # kept from its idle points
            parts.append(f"{o['process']} census overdue {o['seconds']:.0f} s, blocked by {', '.join(o['blocked_by'])}")
        if self.cardinality and self.cardinality["verdict"] == Verdict.LEAK:
            from vlite.diagnostics.checks.cardinality import describe

            parts.append("/metrics series growing with requests: " + describe(self.cardinality))
        if zombie_part:
            parts.append(zombie_part)
        return "LEAK: " + "; ".join(parts or ["see the report"])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        d["summary"] = self.summary()
        for t, td in zip(self.trends, d["trends"]):
            td["rising"] = t.rising
        return d


def drain_check(snap: Snapshot) -> DrainCheck:
    """Check free + cached == total on a quiescent snapshot, with the sign of any mismatch."""
    accounted = snap.num_free_blocks + snap.num_cached_blocks
    mismatch = accounted - snap.num_total_blocks
    negative = -sum(rc for rc in snap.ref_counts or [] if rc < 0)
    double_frees = sum(1 for a in snap.anomalies if "double" in str(a.get("kind", "")))
    deficit = max(0, -mismatch)
    excess = max(max(0, mismatch), negative, double_frees)
    sign = ("deficit+excess" if deficit and excess else "deficit" if deficit else "excess" if excess else "balanced")
    return DrainCheck(snap.num_total_blocks, snap.num_free_blocks, snap.num_cached_blocks, mismatch, deficit, excess,
                      negative, sign, quiescent=snap.num_running == 0 and snap.num_waiting == 0)


def trough_trend(points: list[IdlePoint], metric: str = "num_used_blocks") -> Trend:
    """Regress the idle-point troughs of ``metric`` on requests completed (scipy linregress, 95% CI)."""
    xs = [p.requests_completed for p in points if getattr(p, metric) is not None]
    ys = [float(getattr(p, metric)) for p in points if getattr(p, metric) is not None]
    trend = Trend(metric, len(xs), baseline=ys[0] if ys else None, last=ys[-1] if ys else None)
    if len(xs) < 3 or len(set(xs)) < 2:
        return trend
    from scipy import stats

    fit = stats.linregress(xs, ys)
    # A perfectly straight series has stderr 0 (or nan when flat): the CI collapses to the slope.
    half = stats.t.ppf(0.975, len(xs) - 2) * fit.stderr if math.isfinite(fit.stderr) else 0.0
    r2 = fit.rvalue ** 2
    trend.slope, trend.intercept = float(fit.slope), float(fit.intercept)
    trend.ci95 = (float(fit.slope - half), float(fit.slope + half))
    trend.r2 = float(r2) if math.isfinite(r2) else 1.0  # a perfectly flat series has no variance to explain
    return trend


def _suspected_path(row: dict, snap: Snapshot, in_tables: set[int]) -> str:
    live = set(snap.live_state.get("live_request_ids", []))
    if row.get("status") == "finished" and row["request_id"] in live:
        why = "the abort/disconnect path" if row.get("finish_reason") == "abort" else "the finish path"
        return f"{why} raised before the release (request entry kept)"
    if row.get("site") == "fork" and row.get("status") == "finished":
        return "a forked sample's reference was never dropped (fork path)"
    if row["block_id"] not in in_tables:
        if row.get("num_preemptions"):
            return "dropped from the block table without a free (at preemption)"
        return "dropped from the block table without a free"
    if row.get("status") == "finished":
        return "finished sequence still holds its block table"
    return "held by a live sequence at quiescence (stuck request)"


def _group(df: pd.DataFrame, key: str) -> list[dict]:
    if df.empty:
        return []
    g = df.groupby(key, dropna=False).agg(blocks=("block_id", "nunique"), references=("block_id", "size"),
                                          requests=("request_id", "nunique"))
    g = g.sort_values("blocks", ascending=False).reset_index()
    return g.astype({key: str}).to_dict("records")


def detect(snap: Snapshot, results: list[RequestResult], idle_points: list[IdlePoint],
           coverage_before: dict | None = None, zombie_options: dict | None = None) -> Findings:
    """Run all checks on a quiescent snapshot and the client's per-request results.

    ``coverage_before``: the target's coverage counts when the replay started (the report
    shows the difference); ``zombie_options``: threshold_s / threshold_steps / gauge_lag_s
    for ``zombie.zombie_check``.
    """
    from vlite.diagnostics.checks import coverage, evidence, registries, zombie

    plan = {r.request_id: r for r in results}
    # a multi-prompt request's engine requests (<id>-<p>) answer to its client's result
    plan |= {eid: r for r in results for eid in (r.engine_request_ids or []) if eid not in plan}
    drain = drain_check(snap)
    in_tables = {b for table in snap.block_tables.values() for b in table}
    leaked = []
    for row in snap.ledger:
        r = dict(row)
        res = plan.get(r["request_id"])
        r["action_kind"] = res.action_kind if res else ("calibration run" if str(r["request_id"]).startswith(
            "calibrate-") else "unknown (not from this workload)")
        r["client_action"] = r.get("client_action") or (res.action_label if res else None)
        r["client_outcome"] = res.detail or res.outcome if res else None
        r["suspected_path"] = _suspected_path(r, snap, in_tables)
        leaked.append(r)
    if snap.released or snap.registries:  # the engine's introspection point is there: derive from evidence
        evidence.suspected_paths(snap, leaked)
    df = pd.DataFrame(leaked)
    anomalies = []
    for a in snap.anomalies:
        a = dict(a)
        res = plan.get(a.get("request_id"))
        a["action_kind"] = res.action_kind if res else None
        a["client_action"] = a.get("client_action") or (res.action_label if res else None)
        anomalies.append(a)
    cpu = cpu_state(snap, plan)
    held_blocks = len({r["block_id"] for r in leaked})
    notes = []
    if not drain.quiescent:
        notes.append(f"the engine was not quiescent at the final snapshot ({snap.num_running} running, "
                     f"{snap.num_waiting} waiting): the drain check is unreliable")
    if not snap.has_ledger:
        notes.append("no ledger (debug endpoints off): counts only, no attribution")
    unattributed = evidence.unattributed(snap) if snap.has_ledger else []
    regs = (registries.registry_check(snap.registries, snap.histories, snap.num_cached_blocks)
            if snap.registries else None)
    zombies = (zombie.zombie_check(results, snap.request_history, **(zombie_options or {}))
               if snap.request_history or (zombie_options or {}).get("gauge_lag_s") is not None else None)
    return Findings(drain, [trough_trend(idle_points), rss_trend(idle_points)], leaked,
                    _by_request(leaked), _group(df, "action_kind"), _group(df, "site"), anomalies, cpu,
                    unattributed_blocks=(max(max(0, drain.deficit_blocks - held_blocks),
                                             sum(1 for u in unattributed if u["ref_count"] > 0))
                                         if snap.has_ledger else 0),
                    attribution_available=snap.has_ledger, notes=notes,
                    coverage=coverage.section(snap.coverage, coverage_before), zombies=zombies, registries=regs,
                    unattributed=unattributed)


# RSS growth per request below which a rising RSS trend is not even flagged (bytes/request).
# Clean runs here grew 0.4-0.6 MB/request after the first wave, tapering off (allocator pools
# and caches for new batch shapes; the bounded histories until they are full), so a smaller
# threshold would cry wolf on every run; the verdict never rests on RSS.
RSS_THRESHOLD_BYTES_PER_REQUEST = 1 << 20


def rss_trend(points: list[IdlePoint]) -> Trend:
    """The RSS trough trend without warm-up: the baseline (before any request) and the first
    wave's trough are left out, since the first wave grows RSS on any engine (allocator pools,
    tokenizer and kernel caches). ``rising`` needs the CI above
    ``RSS_THRESHOLD_BYTES_PER_REQUEST``; it stays informational."""
    trend = trough_trend(points[2:], "rss_bytes")
    trend.threshold = RSS_THRESHOLD_BYTES_PER_REQUEST
    return trend


def _by_request(leaked: list[dict]) -> list[dict]:
    """One row per owner request: its blocks, sites, first step and oldest age (s)."""
    rows: dict[str, dict] = {}
    for b in leaked:
        r = rows.setdefault(b["request_id"], {k: b.get(k) for k in (
            "request_id", "client_action", "action_kind", "status", "finish_reason", "suspected_path", "evidence")}
                            | {"blocks": 0, "sites": set(), "step": b["step"], "age_s": b["age_s"]})
        r["blocks"] += 1
        r["sites"].add(b["site"])
        r["step"], r["age_s"] = min(r["step"], b["step"]), max(r["age_s"], b["age_s"])
    for r in rows.values():
        r["sites"] = ", ".join(sorted(r["sites"]))
    return sorted(rows.values(), key=lambda r: r["step"])


def cpu_state(snap: Snapshot, plan: dict[str, RequestResult]) -> dict:
    """Block tables of finished sequences and request entries kept after their request ended."""
    live = snap.live_state
    orphans = []
    for sid in live.get("orphan_block_tables", []):
        owner = dict(snap.owners.get(sid, {}))
        res = plan.get(owner.get("request_id"))
        orphans.append({"seq_id": sid, "num_blocks": len(snap.block_tables.get(sid, [])), **owner,
                        "action_kind": res.action_kind if res else None,
                        "client_action": owner.get("client_action") or (res.action_label if res else None)})
    leftovers = []
    finished_live = set(live.get("finished_live_requests", []))
    for rid in live.get("live_request_ids", []):
        res = plan.get(rid)
        leftovers.append({"request_id": rid, "state": "finished but still registered" if rid in finished_live
                          else "never finished", "action_kind": res.action_kind if res else None,
                          "client_action": res.action_label if res else None,
                          "client_outcome": (res.detail or res.outcome) if res else None})
    return {"orphan_block_tables": orphans, "leftover_requests": leftovers,
            "num_block_tables": len(snap.block_tables), "num_leftover_entries": len(orphans) + len(leftovers)}
