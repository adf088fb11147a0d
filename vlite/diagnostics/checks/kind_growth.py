"""Per-process memory growth per request kind: which feature a native leak comes with.

A leak in native code (an allocation in a C extension, a tensor kept by a kernel's cache) is
invisible to the census and to tracemalloc; it shows only as a process's anonymous memory
growing with the requests served (vllm#50150, PyTorch#191340). The plateau test
(``host_memory.py``) says *that* a process grows; this check says *with which request kind*.

Kinds (``request_kind``), one per request, by precedence: ``aborted`` (the client aborted,
disconnected or timed out), ``beam``, ``structured``, ``logprobs`` (``logprobs`` or
``prompt_logprobs``), ``n>1``, ``plain``. One kind per request keeps the model additive: a
request's growth is its kind's.

The model (ordinary least squares, no intercept): between two consecutive idle points ``i``,

    growth_i (bytes of RssAnon + VmSwap of one process) = sum_k  beta_k * served_{k,i} + e_i

where ``served_{k,i}`` counts the requests of kind ``k`` that ended in that interval and
``beta_k`` is kind ``k``'s growth in bytes per request. Two things keep it honest:

* **Warm-up is left out by design, not by fit.** The first intervals in which a kind appears
  pay that kind's one-off costs (allocator arenas and high-water marks, compiled grammars,
  lazily built tables); an interval enters the fit only when every kind in it was already
  served in ``WARMUP_INTERVALS`` earlier ones (two: on the tiny model the logprobs path's heap
  still grew 80-200 KiB per request in its second wave, 12-17 KiB from its third on).
* **Identifiability is checked, not assumed.** With fewer intervals than kinds (plus one for the
  noise) or kinds that always come together, ``beta`` cannot be told apart: the check says
  "not identifiable" and how many intervals it had, instead of guessing. The workload
  ``--workload kind-waves`` (``workload/kind_waves.py``) serves waves of one kind at a time in
  rounds, so that the design matrix is diagonal: ``beta_k`` is then the mean growth per request
  of kind ``k``'s later waves, and its 95% confidence interval comes from the t-distribution on
  the residuals' pooled variance (assumed equal across kinds) with ``intervals - kinds``
  degrees of freedom.

A kind *grows* in a process when its 95% CI lies above ``KIND_SLOPE_BYTES`` per request **and**
the process grew by at least that much per request in every fitted interval that served that
kind alone: a HOST-LEAK named by the process and the kind. A leak takes its bytes with every
request; the allocator's high-water marks do not (a logprobs request with a longer prompt than any
before makes glibc's heap grow once by its prompt_len x vocab float32 logits, 12 MiB for 64
tokens of a 49,152-token vocabulary, and never again for shorter ones), so a CI above the
threshold carried by one or two such jumps is *uneven*, not a leak. A CI that straddles the
threshold is *inconclusive*.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from vlite.diagnostics.workload.kind_waves import KINDS

# A kind's growth is a leak when its 95% CI lies above this (bytes per request of that kind): the
# plateau test's threshold (host_memory.ANON_SLOPE_BYTES).
KIND_SLOPE_BYTES = 64 * 1024
WARMUP_INTERVALS = 2  # a kind's first intervals, left out of the fit


def request_kind(spec) -> str:
    """The kind of one ``RequestSpec`` (one of ``KINDS``; precedence as in the module docstring)."""
    extra = getattr(spec, "extra_params", None) or {}
    if spec.action.is_abort:
        return "aborted"
    if spec.beam_width > 1:
        return "beam"
    if extra.get("structured_outputs") or extra.get("response_format") or extra.get("guided_json"):
        return "structured"
    if spec.logprobs is not None or extra.get("prompt_logprobs") is not None:
        return "logprobs"
    if spec.n > 1:
        return "n>1"
    return "plain"


def served_by_point(point_times: list[float], ended: Iterable[tuple[str, float | None]]) -> list[dict[str, int]]:
    """Cumulative requests served per kind at each idle point: ``ended`` gives (kind, end time)
    per request (``time.time()`` seconds; None: never ended); a request counts at the first idle
    point at or after its end. Returns one {kind: count} per point, in ``point_times`` order."""
    ends = sorted((t, k) for k, t in ended if t is not None)
    out, j, running = [], 0, dict.fromkeys(KINDS, 0)
    for t in point_times:
        while j < len(ends) and ends[j][0] <= t:
            running[ends[j][1]] = running.get(ends[j][1], 0) + 1
            j += 1
        out.append(dict(running))
    return out


def kind_fit(served: list[Mapping[str, int]], memory: list[float | None]) -> dict:
    """Fit one process's growth per kind (module docstring).

    Args:
        served: cumulative requests per kind at each idle point (``served_by_point``).
        memory: that process's RssAnon + VmSwap at each idle point (bytes; None: not read).

    Returns ``status``: "fitted" | "not identifiable" | "too few intervals"; ``intervals``:
    intervals fitted (after the warm-up ones); ``kinds``: {kind: {requests (in the fitted
    intervals), bytes_per_request, ci95 (low, high), verdict ("grows" | "uneven" |
    "inconclusive" | "below threshold"), intervals_alone (fitted intervals that served this kind
    only), intervals_below (of those, how many grew less than the threshold per request)}};
    ``dof``: degrees of freedom of the residuals.
    """
    import numpy as np
    from scipy import stats

    rows, seen = [], {}  # kind -> intervals that served it so far
    for i in range(1, len(served)):
        if memory[i] is None or memory[i - 1] is None:
            continue
        delta = {k: served[i].get(k, 0) - served[i - 1].get(k, 0) for k in served[i]}
        present = {k for k, v in delta.items() if v > 0}
        if not present:
            continue
        if all(seen.get(k, 0) >= WARMUP_INTERVALS for k in present):  # every kind in it is past its warm-up
            rows.append((delta, float(memory[i]) - float(memory[i - 1])))
        for k in present:
            seen[k] = seen.get(k, 0) + 1
    kinds = [k for k in KINDS if any(d.get(k, 0) for d, _ in rows)]
    out = {"status": "too few intervals", "intervals": len(rows), "kinds": {}, "dof": 0}
    if not rows or not kinds:
        return out
    x = np.array([[d.get(k, 0) for k in kinds] for d, _ in rows], dtype=float)
    y = np.array([g for _, g in rows], dtype=float)
    dof = len(rows) - len(kinds)
    if dof < 1 or np.linalg.matrix_rank(x) < len(kinds):
        out["status"] = "not identifiable"
        out["dof"] = dof
        return out
    xtx_inv = np.linalg.inv(x.T @ x)
    beta = xtx_inv @ x.T @ y
    resid = y - x @ beta
    sigma2 = float(resid @ resid) / dof
    t = float(stats.t.ppf(0.975, dof))
    for j, k in enumerate(kinds):
        half = t * math.sqrt(max(0.0, sigma2 * xtx_inv[j, j]))
        low, high = float(beta[j] - half), float(beta[j] + half)
        alone = [(g, d[k]) for d, g in rows if d.get(k, 0) and not any(d.get(o, 0) for o in kinds if o != k)]
        steady = all(g >= KIND_SLOPE_BYTES * c for g, c in alone)
        verdict = ("grows" if steady else "uneven") if low > KIND_SLOPE_BYTES else \
            "inconclusive" if high >= KIND_SLOPE_BYTES else "below threshold"
        out["kinds"][k] = {"requests": int(x[:, j].sum()), "bytes_per_request": float(beta[j]),
                           "ci95": (low, high), "verdict": verdict,
                           "intervals_alone": len(alone), "intervals_below": sum(g < KIND_SLOPE_BYTES * c
                                                                                for g, c in alone)}
    out["status"], out["dof"] = "fitted", dof
    return out


def kind_growth_check(served: list[Mapping[str, int]], processes: Mapping[str, list[float | None]]) -> dict:
    """``kind_fit`` for every process (name -> its RssAnon + VmSwap per idle point, bytes).

    Returns ``processes`` ({name: kind_fit result}) and ``growing``: one entry per (process,
    kind) whose growth per request lies above ``KIND_SLOPE_BYTES`` ({process, kind,
    bytes_per_request, ci95, requests}), largest first.
    """
    fits = {name: kind_fit(served, mem) for name, mem in processes.items()}
    growing = [{"process": name, "kind": k, **{f: v[f] for f in ("bytes_per_request", "ci95", "requests")}}
               for name, fit in fits.items() for k, v in fit["kinds"].items() if v["verdict"] == "grows"]
    growing.sort(key=lambda g: -g["bytes_per_request"])
    return {"processes": fits, "growing": growing, "threshold_bytes": KIND_SLOPE_BYTES}


def lines(result: dict | None) -> list[str]:
    """Human lines for the console and report.md."""
    if not result or not result.get("processes"):
        return []
    out = []
    unfitted = {name: fit for name, fit in result["processes"].items() if fit["status"] != "fitted"}
    if unfitted:  # one line for them all: the workload's design, the same for every process
        fit = next(iter(unfitted.values()))
        why = ("its kinds came together, or too few intervals for them" if fit["status"] == "not identifiable"
               else f"no interval past every kind's first {WARMUP_INTERVALS} (warm-up)")
        out.append(f"growth per request kind ({', '.join(unfitted)}): {fit['status']} ({fit['intervals']} intervals "
                   f"past warm-up; {why}; `--workload kind-waves` serves one kind per wave)")
    for name, fit in result["processes"].items():
        if fit["status"] != "fitted":
            continue
        parts = [f"{k} {v['bytes_per_request'] / 1024:+.1f} KiB/request (95% CI {v['ci95'][0] / 1024:.1f} .. "
                 f"{v['ci95'][1] / 1024:.1f}, {v['requests']} requests"
                 + (f"; uneven: below the threshold in {v['intervals_below']} of its {v['intervals_alone']} waves, "
                    "allocator high-water marks rather than a leak" if v["verdict"] == "uneven" else "") + ")"
                 for k, v in fit["kinds"].items()]
        out.append(f"growth per request kind ({name}, RssAnon + VmSwap, {fit['intervals']} intervals past warm-up): "
                   + "; ".join(parts))
    for g in result["growing"]:
        out.append(f"HOST-LEAK: {g['process']} grows {g['bytes_per_request'] / 1024:.1f} KiB per {g['kind']} request "
                   f"(95% CI {g['ci95'][0] / 1024:.1f} .. {g['ci95'][1] / 1024:.1f}; a leak above "
                   f"{result['threshold_bytes'] // 1024} KiB/request)")
    return out
