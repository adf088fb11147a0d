"""A fleet's verdicts: one per replica behind a router, never an average, and the hop where a
client's abort was lost.

Facts come from ``targets/fleet.py``: each replica's KV in use at idle before and after the run,
and probes sent one at a time on an idle fleet, each attributed to the replica that served it.
Per replica:

* LEAK: KV in use at idle after the run exceeds its idle baseline (blocks or tokens, the
  adapter's unit; a 1-token request before each reading, as the black-box check does).
* ZOMBIE: a client that left early (through the router) was not released by the replica that
  served it within the zombie pace rule of ``zombie.py`` (``zombie_check``: steps from the
  replica's step counter where it has one, else ``max(--zombie-threshold-s, (steps + 1) x the
  p99 inter-token latency)``). The verdict names the hop that lost the abort:
  ``router -> replica`` when the replica counted no abort (it ran the request on to its end) and
  the same early leaver sent to the replica directly was released in time; ``replica`` when the
  replica was slow or deaf to the abort on its own as well, or counted the abort but late.
* INCONCLUSIVE: the replica never went idle, or no early-leaving client was routed to it.

The router is reconciled at idle: where it exports an in-flight gauge per worker
(``ROUTER_IN_FLIGHT``), it must read what the replica runs (0 at idle); a router that holds
requests in flight for an idle replica is a LEAK of the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.checks.zombie import DEFAULT_THRESHOLD_S, DEFAULT_THRESHOLD_STEPS, wall_clock_bound, zombie_check
from vlite.diagnostics.workload.replay import RequestResult

# Router series read at idle: an in-flight gauge per worker, and a per-worker routed counter
# (``worker`` label = the replica's URL). vllm-router 0.1.17 names, read from its /metrics page and
# binary; it exports the gauges only for load-aware policies (not round_robin).
ROUTER_IN_FLIGHT = ("vllm_router_running_requests", "vllm_router_worker_load")
ROUTER_ROUTED = "vllm_router_processed_requests_total"
ORDER = (Verdict.LEAK, Verdict.ENGINE_ERROR, Verdict.WEDGED, Verdict.EMPTY_OUTPUT, Verdict.OUTPUT_DRIFT, Verdict.ZOMBIE, Verdict.INCONCLUSIVE, Verdict.CLEAN)
HOP_ROUTER = "router -> replica"
HOP_REPLICA = "replica"


@dataclass
class Probe:
    """One request sent alone on an idle fleet.

    path: "router" (through the router) or "direct" (to ``replica`` itself, the control).
    action: "disconnect-stream" (left after 2 streamed tokens), "abort-prefill" (left once a
        replica held the request, before its first token) or "complete".
    replica: the URL of the replica that served it (None: no replica counted it).
    left_at / ended_at: ``time.time()`` s the client left, and of the first scrape where the
        replica counted the request ended (None: not seen ending before the drain timeout).
    end_step: the replica's engine step counter at ``ended_at`` (None: no step counter).
    timeline: the replica's ``(time.time() s, step counter)`` reads during the probe.
    aborted: the replica's abort counter moved (None: the replica has no abort counter).
    router_worker: the worker whose routed counter the router moved (None: no such counter).
    """

    probe_id: str
    path: str
    action: str
    replica: str | None
    left_at: float | None
    ended_at: float | None = None
    end_step: int | None = None
    timeline: list[tuple[float, int]] = field(default_factory=list)
    aborted: bool | None = None
    router_worker: str | None = None


@dataclass
class ReplicaFacts:
    """What was read from one replica: its URL and kind, KV in use (``unit``) at idle before and
    after the run (None: never idle), and the p99 inter-token latency (s) during the run."""

    url: str
    kind: str
    unit: str
    kv_idle_before: float | None
    kv_idle_after: float | None
    step_time_s: float | None = None
    routed: float | None = None  # the router's routed-counter delta for this worker over the run
    ended: float | None = None  # the replica's ended-request counter delta over the run


def judge_probe(p: Probe, step_time_s: float | None, threshold_s: float, threshold_steps: int) -> dict:
    """The zombie rule of ``zombie.py`` applied to one early leaver ``p`` (``step_time_s``: the
    replica's p99 inter-token latency, s); its row, ``zombie`` True/False (``never_ended``: the
    replica was not seen ending it)."""
    res = RequestResult(p.probe_id, p.action, p.action, p.left_at or 0.0, outcome="aborted", abort_time=p.left_at)
    hist = {p.probe_id: {"finished": p.ended_at is not None, "finished_time": p.ended_at, "finished_step": p.end_step}}
    z = zombie_check([res], hist, threshold_s=threshold_s, threshold_steps=threshold_steps,
                     step_timeline=p.timeline, step_time_s=step_time_s)
    if z["not_released"]:
        return {"request_id": p.probe_id, "client_action": p.action, "outlived_s": None, "outlived_steps": None,
                "zombie": True, "never_ended": True}
    row = dict(z["requests"][0])
    row["never_ended"] = False
    return row


def judge_fleet(replicas: list[ReplicaFacts], probes: list[Probe], router_in_flight: dict[str, float] | None = None,
                *, threshold_s: float = DEFAULT_THRESHOLD_S, threshold_steps: int = DEFAULT_THRESHOLD_STEPS,
                kv_tolerance: float = 0.0, router_metrics: str | None = None) -> dict:
    """Per-replica verdicts, the router's reconciliation, and the fleet's verdict (the worst).

    Args:
        replicas: one ``ReplicaFacts`` per replica.
        probes: every probe sent (router and direct).
        router_in_flight: the router's in-flight gauge per worker URL at idle (None: not read).
        threshold_s / threshold_steps: the zombie rule's bounds (``zombie.py``).
        kv_tolerance: KV (in the replica's unit) above its idle baseline still counted as clean.
        router_metrics: the router's metrics URL that was read (``--router-metrics``; None: not
            given), so that a missing in-flight gauge is said for what it is.

    Returns:
        ``{"verdict", "replicas": [{"url", "verdict", "hop", "reasons", "served", "left_early",
        "aborts_seen", "zombies", "kv_idle_before", "kv_idle_after", "unit", "bound_s"}],
        "router": {"verdict", "in_flight", "reasons"}, "unattributed": [probe ids]}``.
    """
    out, unattributed = [], [p.probe_id for p in probes if p.path == "router" and p.replica is None
                             and p.left_at is not None]
    for r in replicas:
        mine = [p for p in probes if p.replica == r.url]
        routed = [p for p in mine if p.path == "router"]
        left = [p for p in routed if p.left_at is not None]
        direct = [p for p in mine if p.path == "direct" and p.left_at is not None]
        rows = [(p, judge_probe(p, r.step_time_s, threshold_s, threshold_steps)) for p in left]
        direct_rows = [judge_probe(p, r.step_time_s, threshold_s, threshold_steps) for p in direct]
        direct_ok = bool(direct_rows) and not any(d["zombie"] for d in direct_rows)
        zombies, hops, reasons = [], set(), []
        for p, row in rows:
            if not row["zombie"]:
                continue
            # The abort reached the replica (its counter moved) but late, or the replica drops
            # aborts sent to it directly too: the replica's hop. Otherwise the router's.
            hop = HOP_REPLICA if p.aborted or (direct_rows and not direct_ok) else HOP_ROUTER
            row = {**row, "hop": hop, "abort_counted": p.aborted, "direct_control": (
                None if not direct_rows else "released in time" if direct_ok else "a zombie too")}
            zombies.append(row)
            hops.add(hop)
        verdict = Verdict.CLEAN
        leaked = (r.kv_idle_after - r.kv_idle_before if r.kv_idle_after is not None and r.kv_idle_before is not None
                  else None)
        if r.kv_idle_after is None or r.kv_idle_before is None:
            verdict = Verdict.INCONCLUSIVE
            reasons.append("never idle: KV at idle not read (--drain-timeout)")
        if leaked is not None and leaked > kv_tolerance:
            verdict = Verdict.LEAK
            reasons.append(f"{leaked:g} {r.unit} of KV still in use at idle after the run "
                           f"({r.kv_idle_before:g} before, {r.kv_idle_after:g} after)")
        if zombies:
            verdict = Verdict.LEAK if verdict == Verdict.LEAK else Verdict.ZOMBIE
            for z in zombies:
                how = ("never ended" if z.get("never_ended") else
                       f"released {z['outlived_s']} s" + (f", {z['outlived_steps']} engine steps" if
                                                          z.get("outlived_steps") is not None else "") + " after")
                reasons.append(f"{z['request_id']} ({z['client_action']}): {how} its client left; abort lost at "
                               f"hop {z['hop']} (replica counted an abort: {_yes(z['abort_counted'])}; "
                               f"direct control: {z['direct_control'] or 'not sent'})")
        if not left and verdict == Verdict.CLEAN:
            verdict = Verdict.INCONCLUSIVE
            reasons.append("no early-leaving client was routed to this replica: abort propagation not judged")
        if r.routed is not None and r.ended is not None and r.routed != r.ended:
            reasons.append(f"router routed {r.routed:g} requests here, the replica counted {r.ended:g} ended "
                           "(retries or requests the replica never accounted)")
        out.append({"url": r.url, "kind": r.kind, "verdict": verdict, "hop": sorted(hops)[0] if hops else None,
                    "reasons": reasons, "served": len(routed), "left_early": len(left),
                    "aborts_seen": sum(1 for p in left if p.aborted), "zombies": zombies,
                    "kv_idle_before": r.kv_idle_before, "kv_idle_after": r.kv_idle_after, "unit": r.unit,
                    "bound_s": round(wall_clock_bound(threshold_s, threshold_steps, r.step_time_s), 4),
                    "step_time_s": r.step_time_s, "routed": r.routed, "ended": r.ended})
    router = {"verdict": Verdict.CLEAN, "in_flight": router_in_flight, "reasons": []}
    if router_in_flight is None:
        router["verdict"] = None
        router["reasons"].append(_unreconciled(router_metrics))
    else:
        for url, n in sorted(router_in_flight.items()):
            if n > 0:  # replicas are idle here (checked before reading the router)
                router["verdict"] = Verdict.LEAK
                router["reasons"].append(f"router holds {n:g} requests in flight for {url}, which runs 0")
    verdicts = [r["verdict"] for r in out] + ([router["verdict"]] if router["verdict"] else [])
    fleet = min(verdicts, key=ORDER.index) if verdicts else Verdict.INCONCLUSIVE
    return {"verdict": fleet, "replicas": out, "router": router, "unattributed": unattributed,
            "threshold_s": threshold_s, "threshold_steps": threshold_steps}


def _unreconciled(router_metrics: str | None) -> str:
    """Why the router's in-flight requests were not reconciled with the idle replicas."""
    if not router_metrics:
        return ("router reconciliation needs --router-metrics URL (the router's Prometheus page), which was not "
                "given: its in-flight requests per worker were not read")
    return (f"the router's page at {router_metrics} was unreadable or has no in-flight gauge per worker "
            f"({' or '.join(ROUTER_IN_FLIGHT)} with a worker label): in-flight not reconciled")


def apply_storm(result: dict, storms: dict[str, dict]) -> dict:
    """Fold the storm checks of each replica (``targets/storm.py``'s ``judge_after``, keyed by
    replica URL) into ``judge_fleet``'s result, as ``storm.apply_to`` does for one server: a storm
    verdict (WEDGED, EMPTY-OUTPUT, OUTPUT-DRIFT) replaces CLEAN, ZOMBIE or INCONCLUSIVE (the old
    verdict stays among the reasons); beside a LEAK, the cause to fix, it is added to the reasons.
    The fleet's verdict is the worst again. Returns ``result``, changed in place."""
    for r in result["replicas"]:
        s = storms.get(r["url"])
        if s is None:
            continue
        r["storm"] = s
        if not s["verdict"]:
            continue
        if r["verdict"] == Verdict.LEAK:
            r["reasons"].append(f"after the abort storm: {s['summary']}")
            continue
        if r["verdict"] != Verdict.CLEAN:
            r["reasons"].append(f"before the storm checks: {r['verdict']}")
        r["verdict"] = s["verdict"]
        r["reasons"].append(s["summary"])
    verdicts = [r["verdict"] for r in result["replicas"]] + ([result["router"]["verdict"]]
                                                              if result["router"]["verdict"] else [])
    result["verdict"] = min(verdicts, key=ORDER.index) if verdicts else Verdict.INCONCLUSIVE
    return result


def rejudge(doc: dict) -> dict:
    """``judge_fleet`` again on what a run recorded (its ``fleet.json``: ``facts``, ``probes``, the
    router's ``in_flight`` and the thresholds); the verdicts of a recorded live fleet, in CI."""
    facts = [ReplicaFacts(**f) for f in doc["facts"]]
    probes = [Probe(**{**p, "timeline": [tuple(x) for x in p["timeline"]]}) for p in doc["probes"]]
    return judge_fleet(facts, probes, doc["router"]["in_flight"], threshold_s=doc["threshold_s"],
                       threshold_steps=doc["threshold_steps"], router_metrics=doc.get("router_metrics"))


def _yes(v: bool | None) -> str:
    return "no counter" if v is None else "yes" if v else "no"


def lines(result: dict) -> list[str]:
    """Console / report.md lines: one verdict line per replica with its reasons, then the router's."""
    out = [f"attribution: {result.get('attribution', 'per-replica counters before and after each probe')}"]
    for r in result["replicas"]:
        hop = f", abort lost at hop {r['hop']}" if r["hop"] else ""
        out.append(f"replica {r['url']} ({r['kind']}): {r['verdict']}{hop} - {r['served']} probes served, "
                   f"{r['left_early']} clients left early, {r['aborts_seen']} aborts counted there; KV at idle "
                   f"{_num(r['kv_idle_before'])} -> {_num(r['kv_idle_after'])} {r['unit']}; zombie bound "
                   f"{r['bound_s']:g} s")
        out += [f"  {why}" for why in r["reasons"]]
        if r.get("storm"):
            from vlite.diagnostics.checks.storm import lines as storm_lines

            out += [f"  storm check: {line}" for line in storm_lines(r["storm"])]
    rt = result["router"]
    flight = ("" if rt["in_flight"] is None else " - in flight at idle: "
              + ", ".join(f"{u} {n:g}" for u, n in sorted(rt["in_flight"].items())))
    out.append(f"router: {rt['verdict'] or 'not reconciled'}{flight}" + "".join(f"; {w}" for w in rt["reasons"]))
    if result["unattributed"]:
        out.append(f"{len(result['unattributed'])} early leavers no replica counted (left before the router "
                   f"forwarded them?): {', '.join(result['unattributed'][:6])}")
    return out


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:g}"


def summary(result: dict) -> str:
    """The fleet's one-line verdict: the fleet's verdict, each replica's (with the hop that lost
    an abort) and the router's."""
    per = ", ".join(f"{r['url']} {r['verdict']}" + (f" (hop {r['hop']})" if r["hop"] else "")
                    for r in result["replicas"])
    return f"{result['verdict']} - {per}; router {result['router']['verdict'] or 'not reconciled'}"


@dataclass
class FleetResult:
    """The detail of a fleet's ``targets/base.TargetRun``: ``doc`` is
    ``judge_fleet``'s result plus what the run recorded (``targets/fleet.py``), or, for a run a
    Ctrl-C stopped, ``{"verdict": "INTERRUPTED", "probes": [...]}``. It is also written as
    fleet.json, which ``rejudge`` reads back."""

    doc: dict

