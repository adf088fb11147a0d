"""The probe's census over a run: containers in another server's processes that keep taking
request ids as requests are served.

At an idle point no request is in flight, so an entry that holds a request id holds an *ended*
request's. The probe (``probe/vlite_probe``) counts them per container in every process at its
idle points; this check fits each container's count against the requests served, with the
container test the in-process host-memory check uses (``host_memory.plateau_test`` and
``keeps_growing_steadily``, ``CONTAINER_SLOPE`` entries per request, at least
``MIN_CONTAINER_GROWTH`` entries over the later half). A container that keeps growing is a LEAK
named by process and container (vLLM's Responses API store, ``response_store``, is one when
``VLLM_ENABLE_RESPONSES_API_STORE=1``: vllm#48275).

A growing container with a cap (a deque with ``maxlen``) is reported as bounded, at or below its
cap, not as a leak.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlite.diagnostics.checks.host_memory import (
    CONTAINER_SLOPE,
    MIN_CONTAINER_GROWTH,
    MIN_POINTS,
    keeps_growing_steadily,
    plateau_test,
)
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.readers.probe_series import ProbeReading


def probe_census_check(points: Sequence[tuple[float, ProbeReading | None]]) -> dict | None:
    """The verdict over idle points ``(requests served so far, the probe's reading)``, baseline
    first; None when the probe never answered.

    Returns ``verdict`` (``LEAK``: a container keeps growing; ``CLEAN``; ``too few idle points``:
    fewer than ``host_memory.MIN_POINTS``), ``growing`` (process, container, entries per request,
    first -> last), ``bounded`` (growing containers with a cap: their cap and last size),
    ``processes`` (each process's last pass: passes, objects, seconds, truncated), ``held``
    (the last reading's containers holding request ids) and ``stale`` (processes that made no
    pass after some idle point: their counts there are left out of the fit).
    """
    pts = [(x, r) for x, r in points if r is not None]
    if not pts:
        return None
    last = pts[-1][1]
    result = {"verdict": "too few idle points", "n": len(pts), "min_points": MIN_POINTS, "growing": [],
              "bounded": [], "processes": last.processes,
              "held": {k: v for k, v in sorted(last.containers.items()) if v.get("ids")}}
    if len(pts) < MIN_POINTS:
        return result
    result["stale"] = sorted({k for _, r in pts for k in r.stale})
    half = len(pts) // 2
    names = set().union(*(set(r.containers) for _, r in pts[half:]))
    for name in sorted(names):
        process = name.partition(": ")[0]
        # a point where this process made no pass after the idle point says nothing about it
        fresh = [(float(x), float((r.containers.get(name) or {}).get("ids") or 0)) for x, r in pts
                 if process not in r.stale]
        if len(fresh) < MIN_POINTS:
            continue
        xs, ys = [x for x, _ in fresh], [y for _, y in fresh]
        half = len(fresh) // 2
        if ys[-1] - ys[half] < MIN_CONTAINER_GROWTH:
            continue
        test = plateau_test(xs, ys, CONTAINER_SLOPE)
        if not (test["keeps_growing"] or keeps_growing_steadily(xs, ys, CONTAINER_SLOPE)):
            continue
        c = last.containers.get(name) or {}
        process, _, container = name.partition(": ")
        row = {"process": process, "container": container, "entries_per_request": round(test["late_slope"], 3),
               "first": int(ys[0]), "last": int(ys[-1])}
        if c.get("maxlen"):
            result["bounded"].append({**row, "maxlen": int(c["maxlen"])})
        else:
            result["growing"].append(row)
    # the entries of a growing container hold the ids too ("store[]"): one finding, the container's
    named = {(g["process"], g["container"]) for g in result["growing"]}
    result["growing"] = [g for g in result["growing"]
                         if not (g["container"].endswith("[]") and (g["process"], g["container"].removesuffix("[]")) in named)]
    result["verdict"] = Verdict.LEAK if result["growing"] else Verdict.CLEAN
    return result


def describe(result: dict) -> str:
    """The verdict line's part: "EngineCore_DP0 (pid 7): vllm...Scheduler.requests +1.00/request (0 -> 40)"."""
    return "; ".join(f"{g['process']}: {g['container']} +{g['entries_per_request']:.2f} request ids/request "
                     f"({g['first']} -> {g['last']})" for g in result["growing"])


def lines(result: dict | None) -> list[str]:
    """Human lines for the console and report.md."""
    if not result:
        return []
    procs = result["processes"]
    where = ", ".join(f"{k} ({int(v.get('passes') or 0)} passes, last {float(v.get('pass_seconds') or 0) * 1000:.0f} ms"
                      f"{', TRUNCATED' if v.get('truncated') else ''})" for k, v in sorted(procs.items()))
    out = [f"probe census: {len(procs)} process{'es' if len(procs) != 1 else ''}: {where}"]
    if result.get("stale"):
        out.append("probe census: no pass after some idle points (busy, or slower than the wait) in "
                   + ", ".join(result["stale"]) + ": those points are left out of its fit")
    if result["verdict"] == "too few idle points":
        out.append(f"probe census: {result['n']} idle points (the growth test needs {result['min_points']}); "
                   "no verdict")
    for g in result["growing"]:
        out.append(f"probe census: LEAK {g['process']}: {g['container']} holds {g['last']} request ids "
                   f"(+{g['entries_per_request']:.2f} per request served, {g['first']} at the baseline)")
    for b in result["bounded"]:
        capped = "at its cap" if b["last"] >= b["maxlen"] else f"below its cap of {b['maxlen']}"
        out.append(f"probe census: bounded {b['process']}: {b['container']} holds {b['last']} request ids, "
                   f"{capped} (not a leak)")
    if result["verdict"] == Verdict.CLEAN:
        held = result["held"]
        out.append("probe census: no container keeps taking request ids" +
                   ("; held at the last idle point: " + ", ".join(f"{k} {int(v['ids'])}" for k, v in held.items())
                    if held else ""))
    return out
