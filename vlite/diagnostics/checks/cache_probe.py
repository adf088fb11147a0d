"""Cache or leak: the verdict of the cache-versus-leak probe on the containers that kept growing.

The host-memory check (host_memory.py) calls a container that keeps growing per request a
HOST-LEAK. A cache with a size limit grows the same way until it reaches its limit, and a large
one (llama.cpp's host prompt cache, 8 GiB by default, llama.cpp#25740) does not reach it within a
short run. So, for each container the host-memory check named, the probe sends two more kinds of
rounds (the in-process target drives them: ``targets/inprocess.py``), reading the container's
entries at the idle point after each round:

* *repeated*: one round of the run's own requests, sent again and again with the same prompts. A
  container keyed by content stops growing after the first of these rounds (the second round's
  keys are the first's); one that takes an entry per request keeps growing.
* *distinct*: rounds of the same requests with new prompts that no request repeats
  (``--prompt-source distinct``), until the container levels off or the budget of requests is
  spent.

Each container is then one of (``classify``):

=================  =================================================================  ============
kind               evidence                                                           verdict
=================  =================================================================  ============
``bounded-cache``  grew with distinct inputs, then stayed within a few entries for    not a leak;
                   ``LEVEL_ROUNDS`` rounds of distinct inputs (its cap: the most        its size is
                   entries seen)                                                      reported
``content-keyed``  flat under repeated inputs, growing with distinct ones to the end  HOST-LEAK
``per-request``    growing under repeated inputs too (an entry per request)           HOST-LEAK
``not fed``        neither kind of round grew it (the requests that grow it did not   HOST-LEAK
                   recur, e.g. a preemption that did not happen again)                (unchanged)
=================  =================================================================  ============

A cache larger than the probe's budget of distinct requests reads as ``content-keyed``: a leak,
as the issue asks (growth keyed by content must look like one); the line says how many entries
it had reached and how to give the probe more requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlite.diagnostics.checks.host_memory import ANON_SLOPE_BYTES, CONTAINER_SLOPE, anon_verdict
from vlite.diagnostics.checks.verdict import Verdict

LEVEL_ROUNDS = 3  # idle points at the end of the distinct rounds that must agree for a level (2 rounds)
LEVEL_TOLERANCE = 0.05  # ... to within this fraction of the level, or LEVEL_MIN_TOLERANCE entries
LEVEL_MIN_TOLERANCE = 2
REPEAT_ROUNDS = 3  # rounds of repeated inputs (the first may add entries: its inputs are new)


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Entries per request from the first point to the last (0 for fewer than 2 points)."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return 0.0
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def levelled(points: Sequence[tuple[float, float]], rounds: int = LEVEL_ROUNDS) -> bool:
    """The last ``rounds`` points (requests sent, entries) agree to within the tolerance and their
    slope is under half of ``CONTAINER_SLOPE`` entries per request: the series has levelled off."""
    if len(points) < rounds:
        return False
    tail = [y for _, y in points[-rounds:]]
    tol = max(LEVEL_MIN_TOLERANCE, LEVEL_TOLERANCE * max(tail))
    return max(tail) - min(tail) <= tol and _slope(points[-rounds:]) < CONTAINER_SLOPE / 2


def classify(repeated: Sequence[tuple[float, float]], distinct: Sequence[tuple[float, float]],
             slope: float = CONTAINER_SLOPE) -> dict:
    """One container's kind from its entries at the probe's idle points.

    repeated: (requests sent by the probe, entries) at its start and after each round of
    repeated inputs; distinct: the same after each round of distinct inputs, starting with the
    last repeated point. ``slope``: entries per request above which a series grows.

    Returns ``kind`` (``bounded-cache``, ``content-keyed``, ``per-request``, ``not fed``),
    ``entries`` (the most seen: a bounded cache's cap), ``repeat_slope`` (entries per request
    over the repeated rounds after the first), ``distinct_slope`` (over all the distinct
    rounds), ``grew_distinct`` (entries the distinct rounds added before the level) and
    ``distinct_requests`` (requests the distinct rounds sent).

    Raises:
        ValueError: an empty series.
    """
    if not repeated or not distinct:
        raise ValueError("classify needs at least one point of each kind of round")
    repeat_slope = _slope(repeated[1:]) if len(repeated) > 2 else 0.0
    distinct_slope = _slope(distinct)
    entries = max(y for _, y in [*repeated, *distinct])
    out = {"entries": int(entries), "repeat_slope": round(repeat_slope, 3), "distinct_slope": round(distinct_slope, 3),
           "grew_distinct": int(max(y for _, y in distinct) - distinct[0][1]),
           "distinct_requests": int(distinct[-1][0] - distinct[0][0])}
    grew = max(y for _, y in distinct) - min(y for _, y in distinct) > max(LEVEL_MIN_TOLERANCE, LEVEL_TOLERANCE * entries)
    if grew and levelled(distinct):
        out["kind"] = "bounded-cache"
    elif repeat_slope >= slope:
        out["kind"] = "per-request"
    elif distinct_slope >= slope or _slope(distinct[-LEVEL_ROUNDS:]) >= slope:
        out["kind"] = "content-keyed"
    else:
        out["kind"] = "not fed"
    return out


def apply_probe(host: dict, series: dict[str, tuple[list, list]], *, rounds: int, round_size: int,
                budget: int, anon_bytes: tuple[int, int] | None = None) -> dict:
    """Judge the probe's series and update the host-memory result ``host`` in place.

    series: container path -> (repeated points, distinct points) as ``classify`` takes them.
    Bounded caches leave ``host["growing"]`` for ``host["bounded_caches"]``; the others stay,
    each with its ``probe`` kind. With no growing container left and anonymous memory not
    growing, the verdict becomes the anonymous-memory test's again (``host_memory.anon_verdict``).
    ``host["cache_probe"]`` records what the probe did
    (rounds, round size, budget, anonymous memory before and after it, bytes). Returns ``host``.
    """
    kinds = {path: classify(rep, dis) for path, (rep, dis) in series.items()}
    bounded, still = [], []
    for g in host.get("growing", []):
        k = kinds.get(g["path"])
        if k is not None and k["kind"] == "bounded-cache":
            bounded.append({"path": g["path"], **k})
        else:
            still.append({**g, "probe": k} if k is not None else g)
    host["growing"] = still
    host["bounded_caches"] = [*(host.get("bounded_caches") or []), *bounded]
    host["cache_probe"] = {"rounds": rounds, "round_size": round_size, "budget_requests": budget,
                           "containers": kinds, "anon_swap_bytes": list(anon_bytes) if anon_bytes else None}
    anon = host.get("anon_swap") or {}
    others = (host.get("kind_growth") or {}).get("growing") or any(
        t.get("keeps_growing") for t in (host.get("processes") or {}).values())
    if host.get("verdict") != Verdict.HOST_LEAK or still or others:
        return host
    if not anon.get("keeps_growing"):
        host["verdict"] = anon_verdict(host)
    elif anon_bytes and rounds * round_size > 0:
        # Anonymous memory grew through the replay while the bounded caches filled. The probe is
        # the same series carried on for rounds x round_size more requests: if it grew less than
        # the threshold per request there, its growth stopped when the caches levelled off.
        per_request = (anon_bytes[1] - anon_bytes[0]) / (rounds * round_size)
        host["cache_probe"]["anon_bytes_per_request"] = round(per_request, 1)
        if per_request < ANON_SLOPE_BYTES:
            host["verdict"] = "warm-up"
    return host


def lines(host: dict | None) -> list[str]:
    """Human lines for the console and report.md: each bounded cache with its size, and what the
    probe found of each container that still grows."""
    probe = (host or {}).get("cache_probe")
    if not probe:
        return []
    out = []
    anon = probe.get("anon_swap_bytes")
    for b in host.get("bounded_caches", []):
        if b.get("declared_cap") is not None:  # said by host_memory.lines
            continue
        size = (f"; host memory (RssAnon + VmSwap) {(anon[1] - anon[0]) / 2**20:+.1f} MiB over the probe"
                if anon else "")
        out.append(f"bounded cache (not a leak): {b['path']} levelled off at {b['entries']} entries after "
                   f"{b['distinct_requests']} requests with distinct prompts (+{b['grew_distinct']} entries in them, "
                   f"then flat for {LEVEL_ROUNDS - 1} rounds){size}")
    per_request = probe.get("anon_bytes_per_request")
    if per_request is not None:
        out.append(f"anonymous memory over the probe's {probe['rounds'] * probe['round_size']} requests: "
                   f"{per_request / 1024:+.1f} KiB/request (the replay's growth "
                   f"{'stopped with the bounded caches' if per_request < ANON_SLOPE_BYTES else 'went on'})")
    for g in host.get("growing", []):
        k = g.get("probe")
        if k is None:
            continue
        if k["kind"] == "content-keyed":
            out.append(f"cache probe: {g['path']} is keyed by content: flat under repeated prompts "
                       f"({k['repeat_slope']} entries/request), +{k['distinct_slope']} entries/request with distinct "
                       f"ones, still growing at {k['entries']} entries after {k['distinct_requests']} of them (a leak, "
                       f"or a cache larger than that: --cache-probe-requests sends more)")
        elif k["kind"] == "per-request":
            out.append(f"cache probe: {g['path']} takes an entry per request, repeated prompts too "
                       f"(+{k['repeat_slope']} entries/request): a leak, not a cache of content")
        else:
            out.append(f"cache probe: the probe's requests did not grow {g['path']} (the requests that grew it "
                       "did not recur); the host-memory verdict stands")
    return out
