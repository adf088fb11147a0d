"""The engine's state at quiescence, in one plain form for both targets.

Both read the one ``/debug/blocks`` document (``vlite.engine.introspection.blocks_document``):
in process through ``EngineView.blocks_document``, over HTTP from ``GET /debug/blocks`` (or only
``/metrics`` when the debug endpoints are off, in which case attribution is unavailable).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass

from vlite.engine import EngineView


@dataclass
class Snapshot:
    """Block counts (blocks), held block references, anomalies and per-request CPU-side state.

    ledger: one dict per held block reference: block_id, seq_id, request_id, site, step,
        age_s, client_action, client_tag, status, finish_reason, num_preemptions.
    owners: seq_id -> {request_id, client_action, status, finish_reason} for sequences
        named by orphan block tables.
    has_ledger: False when only counters were available (no attribution possible).
    """

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    ledger: list[dict] = field(default_factory=list)
    anomalies: list[dict] = field(default_factory=list)
    live_state: dict = field(default_factory=dict)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    ref_counts: list[int] | None = None
    owners: dict[int, dict] = field(default_factory=dict)
    has_ledger: bool = True
    # From the engine's introspection point (vlite.engine.introspection.EngineView); empty
    # when the target does not expose them.
    registries: dict[str, int] = field(default_factory=dict)
    histories: dict[str, dict] = field(default_factory=dict)  # name -> {size, bound}
    coverage: dict | None = None
    released: list[dict] = field(default_factory=list)  # bounded release history, oldest first
    frees: list[dict] = field(default_factory=list)  # calls of the free path (FreeRecord), oldest first
    blocks_not_free: list[dict] = field(default_factory=list)  # {block_id, ref_count}
    request_history: dict[str, dict] = field(default_factory=dict)  # request_id -> RequestHistory fields


def _origin_fields(origin) -> dict:
    if origin is None:
        return {"client_action": None, "client_tag": None}
    if is_dataclass(origin):
        origin = asdict(origin)
    return {"client_action": origin.get("client_action"), "client_tag": origin.get("client_tag")}


def from_view(view: EngineView) -> Snapshot:
    """Snapshot an in-process engine: the same ``/debug/blocks`` document a server sends
    (``EngineView.blocks_document``), read by ``from_debug_blocks``, so both targets see one
    picture. Call it only while the engine is not stepping."""
    return from_debug_blocks(view.blocks_document())


def apply_view_dict(snap: Snapshot, d: dict) -> Snapshot:
    """Fill the EngineView fields of ``snap`` from the document's ``view`` part (``view_dict``)."""
    snap.registries = dict(d.get("registries") or {})
    snap.histories = dict(d.get("histories") or {})
    snap.coverage = d.get("coverage")
    snap.released = list(d.get("released") or [])
    snap.frees = list(d.get("frees") or [])
    snap.blocks_not_free = list(d.get("blocks_not_free") or [])
    snap.request_history = dict(d.get("request_history") or {})
    return snap


def from_debug_blocks(data: dict) -> Snapshot:
    """Snapshot from a ``GET /debug/blocks`` JSON body (see the serve contract)."""
    seqs = data.get("sequences", [])
    ledger = []
    for r in data.get("ledger", []):
        ledger.append({k: r.get(k) for k in ("block_id", "seq_id", "request_id", "site", "step", "age_s",
                                             "status", "finish_reason", "num_preemptions", "finish_path",
                                             "release_error")}
                      | _origin_fields(r.get("origin")))
        ledger[-1]["age_s"] = round(float(ledger[-1]["age_s"] or 0.0), 3)
    owners = {}
    by_seq = {s.get("seq_id"): s for s in seqs}
    for sid in data.get("live_state", {}).get("orphan_block_tables", []):
        s = by_seq.get(sid, {})
        owners[sid] = {"request_id": s.get("request_id"), **_origin_fields(s.get("origin")),
                       "status": s.get("status"), "finish_reason": s.get("finish_reason")}
    ref_counts = None
    if isinstance(data.get("ref_counts"), dict):  # /debug/blocks sends only the blocks not at 0
        ref_counts = [0] * int(data["num_total_blocks"])
        for block_id, count in data["ref_counts"].items():
            ref_counts[int(block_id)] = int(count)
    anomalies = []
    for a in data.get("anomalies", []):
        if not isinstance(a, dict):
            anomalies.append({"kind": str(a)})
            continue
        anomalies.append({k: a.get(k) for k in ("kind", "block_id", "seq_id", "request_id", "step")}
                         | {"release_sites": list(a.get("release_sites") or []),
                            "allocation_sites": list(a.get("allocation_sites") or [])}
                         | _origin_fields(a.get("origin")))
    snap = Snapshot(int(data["num_total_blocks"]), int(data["num_free_blocks"]),
                    int(data.get("num_used_blocks", data["num_total_blocks"] - data["num_free_blocks"])),
                    int(data.get("num_cached_blocks", 0)), int(data.get("num_running", 0)),
                    int(data.get("num_waiting", 0)), ledger, anomalies, data.get("live_state", {}),
                    {s["seq_id"]: list(s.get("block_table", [])) for s in seqs if "seq_id" in s},
                    ref_counts, owners)
    return apply_view_dict(snap, data.get("view") or {})


def from_metrics(metrics: dict) -> Snapshot:
    """Counters only, from parsed ``/metrics`` gauges (no ledger: attribution unavailable)."""
    total = int(metrics["vlite:num_total_blocks"])
    free = int(metrics["vlite:num_free_blocks"])
    return Snapshot(total, free, total - free, int(metrics.get("vlite:num_cached_blocks", 0)),
                    int(metrics.get("vlite:num_requests_running", 0)), int(metrics.get("vlite:num_requests_waiting", 0)),
                    has_ledger=False)
