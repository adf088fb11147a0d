"""Host-memory check: growth per request served, with a warm-up plateau test, and its own verdict.

Process RSS rises on every clean run (allocator warm-up, caches filling), so a fit over the whole
run cannot tell warm-up from a leak (llama.cpp#28933 was such a false alarm). The plateau test
fits only the later half of the idle points: growth that stops there is warm-up; growth that
keeps its slope is a leak (vllm#44175 grew 0.57 GiB over 12 h at a steady slope).

A one-time step (a long prompt's buffers, an allocator arena that grows once, more often on a
loaded machine) is not a slope either, but a fit over a few idle points reads it as one. So where
one interval stands out (``largest_step``), anonymous memory is judged by the idle points after
that step alone (``step_test``): they must keep growing, with a 95% CI above the threshold. A run
with too few idle points after the step says so ("too short") and how to make it long enough.
Growth in several steps with flat stretches between them (a buffer that doubles, each new request
kind's first buffers) is a slope to a fit, but not a leak when the median interval stays below the
threshold and the steps shrink ("steps").

Two series are tested, both read at the idle points (``IdlePoint.host``):

* ``containers``: the size (entries) of every container reachable from the engine, by path (the
  request-id census walk, ``EngineView.request_census``). A container that keeps growing per
  request is a host leak named by where it lives, e.g. a list of block ids that nobody empties
  (vllm#44175's ``new_block_ids``) or a per-request cache. Exact, so a few entries per request
  are a verdict.
* ``anon_swap_bytes``: anonymous RSS plus swap of the engine's processes (``RssAnon`` + ``VmSwap``
  from ``/proc/PID/status``, summed over the process and its workers): growth hidden in swap
  counts too (Ollama#18106). Noisy at small scale, so its threshold is in KiB per request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from vlite.diagnostics.checks.verdict import Verdict

# A container keeps growing when it gained at least MIN_CONTAINER_GROWTH entries over the late half
# and either its late slope's 95% CI stays above this (entries/request) or it grew by at least this
# much in every late interval without tapering (keeps_growing_steadily).
CONTAINER_SLOPE = 0.2
MIN_CONTAINER_GROWTH = 5
# Anonymous RSS + swap keeps growing when its late slope's 95% CI stays above this (bytes/request).
ANON_SLOPE_BYTES = 64 * 1024
MIN_POINTS = 5  # idle points for a plateau test: 2 for the early slope, 3 (2 intervals) in the later half
# A one-time step (a long prompt's buffers, an allocator arena that grows once) is one interval
# whose growth is at least STEP_FACTOR times the median of the other intervals' and at least one
# interval's worth of growth at the threshold. Growth counts as a leak only where the idle points
# after the step keep growing: MIN_AFTER_STEP of them (3 intervals, 2 degrees of freedom for a CI).
STEP_FACTOR = 3.0
MIN_AFTER_STEP = 4
# Anonymous memory: a slope over the later half needs MIN_LATE_POINTS idle points there (2 degrees
# of freedom): three nearly collinear points give a narrow CI by chance, and allocator warm-up that
# settles slowly (growth per request falling from interval to interval) looks linear over three.
MIN_LATE_POINTS = 4
# Growth still settling: the later half's per-interval rates fall at every interval, and the last
# is below TAPER_RATIO of the first interval's rate. A longer run tells it from a leak.
TAPER_RATIO = 0.75
# Growth in steps: where the median interval grows less than the threshold per request, the growth
# comes from a few intervals with flat stretches between them. Steps that shrink (the last below
# TAPER_RATIO of the first), or fewer than MIN_EQUAL_STEPS of them, are allocator high-water marks
# (an arena or a buffer that doubles); MIN_EQUAL_STEPS steps of about one size are a leak of some
# requests (one kind of request that comes now and then).
MIN_EQUAL_STEPS = 3


def anon_swap_bytes(pids: Iterable[int]) -> int | None:
    """``RssAnon`` + ``VmSwap`` (bytes) summed over ``pids`` from ``/proc/PID/status``; None where
    /proc is not there (not Linux) or a process is gone."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            return None
        for key in ("RssAnon", "VmSwap"):
            if key in fields:
                total += int(fields[key].split()[0]) * 1024  # kB in /proc
    return total


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    """(slope, ci95 low, ci95 high) of ys on xs; None when xs do not vary."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    from scipy import stats

    fit = stats.linregress(xs, ys)
    half = stats.t.ppf(0.975, len(xs) - 2) * fit.stderr if math.isfinite(fit.stderr) else 0.0
    return float(fit.slope), float(fit.slope - half), float(fit.slope + half)


def plateau_test(xs: list[float], ys: list[float], threshold: float) -> dict:
    """Fit the whole series and its later half (by idle point). ``keeps_growing``: the later
    half's slope CI lies above ``threshold``; ``inconclusive``: that CI straddles ``threshold``
    (the run cannot tell a leak from noise); ``warm_up``: the whole run rises but the later
    half's CI lies below ``threshold`` (it levelled off). Slopes are in y-units per x-unit (per
    request served)."""
    out = {"n": len(xs), "first": ys[0] if ys else None, "last": ys[-1] if ys else None,
           "slope": None, "late_slope": None, "late_ci95": None, "keeps_growing": False, "inconclusive": False,
           "warm_up": False}
    whole = _fit(xs, ys)
    half = len(xs) // 2
    late = _fit(xs[half:], ys[half:])
    if whole is not None:
        out["slope"] = whole[0]
    if late is not None:
        out["late_slope"], out["late_ci95"] = late[0], (late[1], late[2])
        out["keeps_growing"] = late[1] > threshold
        out["inconclusive"] = late[1] <= threshold <= late[2]
        out["warm_up"] = late[2] < threshold and whole is not None and whole[1] > threshold
    return out


def largest_step(xs: list[float], ys: list[float], threshold: float) -> int | None:
    """Index ``j`` of the interval ``xs[j] -> xs[j+1]`` that is a one-time step (see STEP_FACTOR),
    or None where no interval stands out from the others (steady growth, or noise below the
    threshold). ``threshold`` in y-units per x-unit."""
    if len(xs) < 3:
        return None
    import numpy as np

    rises = np.diff(np.asarray(ys, dtype=float))
    j = int(np.argmax(rises))
    others = np.delete(rises, j)
    if rises[j] < threshold * float(np.median(np.diff(xs))):
        return None
    return j if rises[j] >= STEP_FACTOR * max(0.0, float(np.median(others))) else None


def step_test(xs: list[float], ys: list[float], threshold: float) -> dict:
    """``plateau_test`` that does not read a one-time step as a slope.

    Where the late half keeps growing or cannot tell (``inconclusive``) and one interval is a step
    (``largest_step``), the verdict comes from the idle points after the step alone: their slope's
    95% CI must lie above ``threshold`` for ``keeps_growing``; a CI below it sets ``step_only``
    (one step, then no growth); a CI across it, ``inconclusive``. With fewer than
    ``MIN_AFTER_STEP`` points after the step, or too few (or still settling) for a slope over
    the later half of them (``_too_short_for_a_slope``), ``too_short``: the run cannot tell a
    step from a leak. A ``keeps_growing`` whose growth came in a few steps that shrink, flat
    between them (``_steps_not_a_slope``), becomes ``steps_only`` (``steps`` says which). ``step``: {from_requests, to_requests, rise, after_points, after_slope, after_ci95,
    requests_per_point} (y-units; slopes per x-unit) or None.
    """
    out = plateau_test(xs, ys, threshold)
    out.update(step=None, step_only=False, too_short=False, min_after_step=MIN_AFTER_STEP, settling=None,
               steps_only=False, steps=None)
    if not (out["keeps_growing"] or out["inconclusive"]):
        return out
    j = largest_step(xs, ys, threshold)
    if j is None:
        if out["keeps_growing"]:
            _too_short_for_a_slope(xs, ys, out)
        if out["keeps_growing"]:
            half = len(xs) // 2
            _steps_not_a_slope(xs[half:], ys[half:], threshold, out)
        return out
    after = _fit(xs[j + 1:], ys[j + 1:]) if len(xs) - j - 1 >= MIN_AFTER_STEP else None
    gaps = sorted(b - a for a, b in zip(xs, xs[1:]))
    out["step"] = {"from_requests": xs[j], "to_requests": xs[j + 1], "rise": ys[j + 1] - ys[j],
                   "after_points": len(xs) - j - 1, "after_slope": after[0] if after else None,
                   "after_ci95": (after[1], after[2]) if after else None,
                   "requests_per_point": gaps[len(gaps) // 2]}
    out["keeps_growing"] = out["inconclusive"] = False
    if after is None:
        out["too_short"] = True
    elif after[1] > threshold:
        out["keeps_growing"] = True
        _too_short_for_a_slope(xs[j + 1:], ys[j + 1:], out, after_step=True)
        if out["keeps_growing"]:
            _steps_not_a_slope(xs[j + 1:], ys[j + 1:], threshold, out)
    elif after[2] < threshold:
        out["step_only"] = True
    else:
        out["inconclusive"] = True
    return out


def _steps_not_a_slope(xs: list[float], ys: list[float], threshold: float, out: dict) -> None:
    """Turn a ``keeps_growing`` of the segment ``xs, ys`` into ``steps_only`` where its growth came
    in steps that shrink, or too few steps, with the median interval below ``threshold`` (see
    MIN_EQUAL_STEPS). ``steps``: {median_rate (y-units per x-unit), rises (y-units, in order),
    points}."""
    import numpy as np

    spans = [(x1 - x0, y1 - y0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]) if x1 > x0]
    if len(spans) < 2:
        return
    median = float(np.median([dy / dx for dx, dy in spans]))
    if median >= threshold:
        return
    rises = [dy for dx, dy in spans if dy >= threshold * dx]
    if len(rises) >= MIN_EQUAL_STEPS and rises[-1] >= TAPER_RATIO * rises[0]:
        return
    out["keeps_growing"] = False
    out["steps_only"] = True
    out["steps"] = {"median_rate": median, "rises": rises, "points": len(xs)}


def _too_short_for_a_slope(xs: list[float], ys: list[float], out: dict, after_step: bool = False) -> None:
    """Turn a ``keeps_growing`` over too few late points, or over growth still settling, into
    ``too_short`` (``settling`` says which and what the run needs). ``after_step``: ``xs, ys`` are
    the idle points after a one-time step, and the counts in ``settling`` are of those."""
    gaps = sorted(b - a for a, b in zip(xs, xs[1:]))
    rates = [(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]) if x1 > x0]
    late = rates[len(xs) // 2 - 1:] if len(xs) >= 4 else rates
    few = len(xs) - len(xs) // 2 < MIN_LATE_POINTS
    falling = len(late) >= 2 and all(b < a for a, b in zip(late, late[1:])) and late[-1] < TAPER_RATIO * rates[0]
    if not (few or falling):
        return
    out["keeps_growing"] = False
    out["too_short"] = True
    out["settling"] = {"reason": "few late points" if few else "growth per request still falling",
                       "after_step": after_step, "points": len(xs), "points_needed": max(2 * MIN_LATE_POINTS, len(xs) + 3),
                       "requests_per_point": gaps[len(gaps) // 2] if gaps else 0.0,
                       "first_rate": rates[0] if rates else None, "last_rate": rates[-1] if rates else None}


def keeps_growing_steadily(xs: list[float], ys: list[float], threshold: float) -> bool:
    """Exact counts (container entries): the series grew by at least ``threshold`` per x-unit in
    every interval of its later half, and the later half's slope is at least half the earlier
    half's (it kept its slope instead of tapering off). Needs 2 intervals in the later half;
    works where a 95% CI over 3 points is too wide to say anything."""
    half = len(xs) // 2
    late_x, late_y = xs[half:], ys[half:]
    if len(late_x) < 3:
        return False
    steps = list(zip(late_x, late_x[1:], late_y, late_y[1:]))
    if not all(x1 > x0 and (y1 - y0) >= threshold * (x1 - x0) for x0, x1, y0, y1 in steps):
        return False
    early = (ys[half] - ys[0]) / (xs[half] - xs[0]) if xs[half] > xs[0] else 0.0
    late = (late_y[-1] - late_y[0]) / (late_x[-1] - late_x[0])
    return late >= 0.5 * early


def host_memory_check(points: list, served: list[dict] | None = None) -> dict:
    """The host-memory verdict from idle points that carry ``host`` readings.

    Per process: where ``host["processes"]`` names more than one process (the engine and its
    tensor-parallel workers, ``{name: RssAnon + VmSwap bytes}``), each gets its own ``step_test``
    (``processes``), and a worker that keeps growing is a HOST-LEAK named by its rank even when
    the sum over all of them stays inside the noise. ``served``: the requests served per kind
    at each point (``kind_growth.served_by_point``, same order as ``points``): then
    ``kind_growth`` fits each process's growth per request kind (``kind_growth.py``), and a kind
    whose growth lies above its threshold is a HOST-LEAK named by the process and the kind.

    Returns ``verdict``: ``"HOST-LEAK"`` (a container or anonymous memory keeps its slope past
    warm-up), ``"inconclusive"`` (the 95% CI of anonymous memory's late-half slope straddles the
    threshold: no verdict either way), ``"warm-up"`` (anonymous memory rose above the threshold
    over the run but levelled off in its later half: that CI lies below the threshold),
    ``"too short"`` (a one-time step with fewer than ``MIN_AFTER_STEP`` idle points after it, in
    the sum or in one process: no verdict either way), ``"one step"`` (a step, then no growth),
    ``"below threshold"`` or ``"too few idle points"``;
    ``growing``: the containers that keep growing (path, entries per request, first -> last);
    ``bounded_caches``: those that grow but whose type declares a cap (``host["caps"]``: a deque's
    ``maxlen``, an ``lru_cache``'s ``maxsize``) they have not passed: not a leak, whatever the
    run's length, reported with their cap (``declared_cap``) and entries;
    ``anon_swap``: the ``step_test`` of anonymous RSS + swap (bytes); ``n``: idle points used;
    ``processes``: {name: plateau test} (with more than one process); ``kind_growth``: the fit
    per request kind (with ``served``).
    """
    keep = [i for i, p in enumerate(points) if getattr(p, "host", None)]
    pts = [points[i] for i in keep]
    result = {"verdict": "too few idle points", "n": len(pts), "growing": [], "bounded_caches": [], "anon_swap": None,
              "min_points": MIN_POINTS, "processes": {}, "kind_growth": None}
    names = [n for n in (pts[0].host.get("processes") or {})] if pts else []
    if served is not None and pts and names:
        from vlite.diagnostics.checks.kind_growth import kind_growth_check

        result["kind_growth"] = kind_growth_check(
            [served[i] for i in keep], {n: [(p.host.get("processes") or {}).get(n) for p in pts] for n in names})
    if len(pts) < MIN_POINTS:
        return result
    xs = [float(p.requests_completed) for p in pts]
    result["last_requests"] = xs[-1]
    anon = [p.host.get("anon_swap_bytes") for p in pts]
    if all(a is not None for a in anon):
        result["anon_swap"] = step_test(xs, [float(a) for a in anon], ANON_SLOPE_BYTES)
    if len(names) > 1:
        for name in names:
            mem = [(p.host.get("processes") or {}).get(name) for p in pts]
            if all(m is not None for m in mem):
                result["processes"][name] = step_test(xs, [float(m) for m in mem], ANON_SLOPE_BYTES)
    half = len(pts) // 2
    late_paths = set.intersection(*(set(p.host.get("containers", {})) for p in pts[half:]))
    for path in sorted(late_paths):
        sizes = [float(p.host.get("containers", {}).get(path, 0)) for p in pts]
        if sizes[-1] - sizes[half] < MIN_CONTAINER_GROWTH:
            continue
        test = plateau_test(xs, sizes, CONTAINER_SLOPE)
        if test["keeps_growing"] or keeps_growing_steadily(xs, sizes, CONTAINER_SLOPE):
            row = {"path": path, "entries_per_request": round(test["late_slope"], 3),
                   "first": int(sizes[0]), "last": int(sizes[-1])}
            cap = (pts[-1].host.get("caps") or {}).get(path)
            if cap is not None and sizes[-1] <= cap:  # it cannot grow past what its type allows
                result["bounded_caches"].append({**row, "kind": "bounded-cache", "entries": int(sizes[-1]),
                                                 "declared_cap": int(cap)})
            else:
                result["growing"].append(row)
    kinds = result["kind_growth"] or {}
    if result["growing"] or kinds.get("growing") or any(t["keeps_growing"] for t in result["processes"].values()):
        result["verdict"] = Verdict.HOST_LEAK
    else:
        result["verdict"] = anon_verdict(result)
    return result


def anon_verdict(result: dict) -> str:
    """The verdict from anonymous memory alone (the sum, then each process): ``HOST-LEAK``,
    ``too short`` (a step with too few idle points after it, in the sum or in a process),
    ``inconclusive``, ``one step`` (a step, then no growth), ``steps`` (growth in steps that
    shrink, flat between them), ``warm-up`` or ``below threshold``."""
    tests = [result.get("anon_swap") or {}, *(result.get("processes") or {}).values()]
    for flag, verdict in (("keeps_growing", Verdict.HOST_LEAK), ("too_short", "too short"),
                          ("inconclusive", "inconclusive"), ("step_only", "one step"), ("steps_only", "steps"),
                          ("warm_up", "warm-up")):
        if any(t.get(flag) for t in tests):
            return verdict
    return "below threshold"


def lines(result: dict | None) -> list[str]:
    """Human lines for the console and report.md."""
    if not result:
        return []
    if result["verdict"] == "too few idle points":
        return [f"host memory: {result['n']} idle points with host readings (the plateau test needs "
                f"{result['min_points']}); no verdict"]
    out = []
    a = result.get("anon_swap")
    if a and a.get("late_slope") is not None:
        out.append(f"host memory (RssAnon + VmSwap): {a['first'] / 2**20:.1f} -> {a['last'] / 2**20:.1f} MiB; "
                   f"late-half slope {a['late_slope'] / 1024:.1f} KiB/request (95% CI {a['late_ci95'][0] / 1024:.1f}"
                   f" .. {a['late_ci95'][1] / 1024:.1f}; a leak above {ANON_SLOPE_BYTES // 1024} KiB/request)")
    if a and a.get("step"):
        out.append(step_line("host memory (RssAnon + VmSwap)", a))
    for name, t in (result.get("processes") or {}).items():
        if t.get("late_slope") is None:
            continue
        if t.get("step"):
            out.append(step_line(f"host memory of {name}", t))
        out.append(f"{'HOST-LEAK: ' if t['keeps_growing'] else ''}host memory of {name} (RssAnon + VmSwap): "
                   f"{t['first'] / 2**20:.1f} -> {t['last'] / 2**20:.1f} MiB; late-half slope "
                   f"{t['late_slope'] / 1024:.1f} KiB/request (95% CI {t['late_ci95'][0] / 1024:.1f} .. "
                   f"{t['late_ci95'][1] / 1024:.1f})")
    from vlite.diagnostics.checks import kind_growth

    out += kind_growth.lines(result.get("kind_growth"))
    for g in result["growing"]:
        out.append(f"HOST-LEAK: {g['path']} keeps growing: {g['first']} -> {g['last']} entries, "
                   f"{g['entries_per_request']} per request after warm-up")
    for b in result.get("bounded_caches") or []:
        if b.get("declared_cap") is not None:
            full = "at" if b["entries"] >= b["declared_cap"] else "below"
            out.append(f"bounded container (not a leak): {b['path']} grew {b['first']} -> {b['entries']} entries "
                       f"({b['entries_per_request']} per request), {full} the cap its type declares, "
                       f"{b['declared_cap']}: bounded at {b['declared_cap']}")
    limit = f"{ANON_SLOPE_BYTES // 1024} KiB/request"
    anon_words = ("anonymous memory's late-half slope below its threshold" if a and a.get("late_slope") is not None
                  else "anonymous memory (RssAnon + VmSwap) not read")
    verdict = {Verdict.HOST_LEAK: "HOST-LEAK: host memory keeps its slope past warm-up",
               "inconclusive": (f"host memory: inconclusive: the 95% CI of the late-half slope straddles the "
                                f"{limit} threshold (a leak at it cannot be told from noise in this run; more "
                                f"idle points, --num-requests and --idle-every, narrow the interval)"),
               "too short": too_short_line(result) if result["verdict"] == "too short" else "",
               "one step": (f"host memory: one step, then no growth: the idle points after the step grow less "
                            f"than {limit} (95% CI below it); a one-time allocation, not a per-request leak"),
               "steps": steps_line(result) if result["verdict"] == "steps" else "",
               "warm-up": warm_up_line(result) if result["verdict"] == "warm-up" else "",
               "below threshold": (f"host memory: no container reachable from the engine keeps growing "
                                   f"(> {CONTAINER_SLOPE} entries/request); {anon_words}")
               }[result["verdict"]]
    named = result["growing"] or any(t.get("keeps_growing") for t in (result.get("processes") or {}).values()) \
        or (result.get("kind_growth") or {}).get("growing")
    if result["verdict"] != Verdict.HOST_LEAK or not named:
        out.append(verdict)
    trace = result.get("allocation_sites")
    if trace and trace["sites"]:
        out.append(f"host memory: Python allocation sites that grew from {trace['from_requests']} to "
                   f"{trace['to_requests']} requests served (tracemalloc): " + "; ".join(
                       f"{s['site']} +{s['bytes_diff'] / 1024:.1f} KiB in {s['count_diff']:+d} blocks, "
                       f"{s['bytes_per_request']:.0f} B/request" for s in trace["sites"])
                   + " (the engine's bounded histories, such as the ledger's release records, grow on clean runs "
                   "too until they reach their bounds)")
    elif trace is not None:
        out.append("host memory: no Python allocation site grew between the idle points (tracemalloc)")
    return out


def step_line(what: str, t: dict) -> str:
    """"... one step of +66.0 MiB between 32 and 48 requests served; after it: ..." for a test
    with a ``step``."""
    st = t["step"]
    after = (f"the {st['after_points']} idle points after it grow {st['after_slope'] / 1024:.1f} KiB/request "
             f"(95% CI {st['after_ci95'][0] / 1024:.1f} .. {st['after_ci95'][1] / 1024:.1f})"
             if st["after_ci95"] else f"{st['after_points']} idle point(s) after it, too few for a slope")
    return (f"{what}: one step of {st['rise'] / 2**20:+.1f} MiB between {st['from_requests']:.0f} and "
            f"{st['to_requests']:.0f} requests served, judged apart from the slope; {after}")


def warm_up_line(result: dict) -> str:
    """The "warm-up" verdict: levelled off where the later half's slope is near 0 (its CI reaches
    0, or it is under an eighth of the threshold), else slowed to a slope below the threshold."""
    tests = [result.get("anon_swap") or {}, *(result.get("processes") or {}).values()]
    t = next(t for t in tests if t.get("warm_up"))
    limit = f"{ANON_SLOPE_BYTES // 1024} KiB/request"
    lo, hi = t["late_ci95"]
    if lo <= 0 or t["late_slope"] < ANON_SLOPE_BYTES / 8:
        return (f"host memory: growth within warm-up: it levelled off in the later half of the run (the late-half "
                f"slope's 95% CI lies below {limit})")
    return (f"host memory: growth slowed past warm-up to {t['late_slope'] / 1024:.1f} KiB/request in the later half "
            f"(95% CI {lo / 1024:.1f} .. {hi / 1024:.1f}), below the {limit} a leak is called at; a slower leak needs "
            f"a longer run to be told from allocator growth")


def steps_line(result: dict) -> str:
    """The "steps" verdict: the rises, and the median growth per request between them."""
    tests = [result.get("anon_swap") or {}, *(result.get("processes") or {}).values()]
    st = next(t for t in tests if t.get("steps_only"))["steps"]
    rises = ", ".join(f"{r / 2**20:+.1f}" for r in st["rises"])
    return (f"host memory: grows in steps, flat between them: rises of {rises} MiB over {st['points']} idle points, "
            f"a median of {st['median_rate'] / 1024:.1f} KiB/request between them (below "
            f"{ANON_SLOPE_BYTES // 1024} KiB/request); steps that shrink, or too few to keep one size, are allocator "
            f"high-water marks, not a per-request leak (a leak of one request kind: --workload kind-waves)")


def too_short_line(result: dict) -> str:
    """The "too short" verdict: how many idle points the run needs after the step, and the options
    that give them (``--num-requests`` at the run's spacing of idle points, ``--idle-every``)."""
    tests = [result.get("anon_swap") or {}, *(result.get("processes") or {}).values()]
    t = next(t for t in tests if t.get("too_short"))
    if t.get("settling"):
        se = t["settling"]
        every = max(1, int(round(se["requests_per_point"])))
        total = int(math.ceil(result.get("last_requests", 0) + (se["points_needed"] - se["points"]) * every))
        where = " after the one-time step" if se.get("after_step") else ""
        why = (f"{se['points']} idle points{where}, and a slope over the later half of them needs {MIN_LATE_POINTS} there"
               if se["reason"] == "few late points" else
               f"growth per request fell at every idle point ({se['first_rate'] / 1024:.0f} -> "
               f"{se['last_rate'] / 1024:.0f} KiB/request): warm-up still settling, or a leak under it")
        return (f"host memory: too short to tell warm-up from a leak: {why}; rerun with --num-requests {total} "
                f"--idle-every {every} ({se['points_needed']} idle points); no verdict on host memory")
    st, need = t["step"], t["min_after_step"]
    more = need - st["after_points"]
    every = max(1, int(round(st["requests_per_point"])))
    total = int(math.ceil(result.get("last_requests", st["to_requests"]) + more * every))
    return (f"host memory: too short to tell a one-time step from a leak: {st['after_points']} idle point(s) after "
            f"the step, a slope after it needs {need} of them; rerun with --num-requests {total} --idle-every {every} "
            f"(or a smaller --idle-every, at least {more} more idle points after the step); no verdict on host memory")

