"""The request-id census of an engine in this process at the drained idle point, as the
leak-check report shows it (``InProcessTarget``; ``EngineView.request_census``)."""

from __future__ import annotations

import time


def census_findings(view, requests, workers: bool = False) -> dict:
    """The request-id census at the drained idle point (``EngineView.request_census``), each
    container's requests joined with what their clients did; ``elapsed_ms`` is its cost.

    ``workers``: also the census inside each tensor-parallel worker (``EngineView.worker_census``):
    its containers join ``held`` with their path prefixed by the rank (``tp_rank1:worker.x``)
    and ``process`` naming rank and pid; ``workers`` lists each rank's pid, objects visited
    and cost (ms)."""
    actions = {r.request_id: r.action_label for r in requests}
    t0 = time.perf_counter()
    result = view.request_census(set(actions))
    out = result.to_dict()
    out["elapsed_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    if workers:
        out["workers"] = []
        for w in view.worker_census(set(actions)):
            out["workers"].append({k: w[k] for k in ("rank", "pid", "objects_visited", "truncated", "elapsed_ms")})
            out["truncated"] = out["truncated"] or w["truncated"]
            out["held"] += [h | {"path": f"tp_rank{w['rank']}:{h['path']}",
                                 "process": f"tp_rank{w['rank']} (pid {w['pid']})"} for h in w["held"]]
    for h in out["held"]:
        h["client_actions"] = sorted({actions.get(rid, "?") for rid in h["request_ids"]})
    return out
