"""``GET /debug/blocks`` (only with --enable-debug-endpoints): the block manager's state as JSON.

The snapshot is taken on the engine thread between two steps, through the engine's public
read-only methods, so it is consistent (no half-applied step). Shape::

    {"num_total_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "kv_cache_usage",
     "num_running", "num_waiting",
     "sequences": [{"seq_id", "request_id", "index", "status", "block_table", "origin"}],
     "ledger": [{"block_id", "seq_id", "request_id", "site", "step", "age_s", "origin", "status",
                 "finish_reason"}],
     "anomalies": [{"kind", "block_id", "seq_id", "request_id", "step", "time"}],
     "ref_counts": {"<block_id>": ref_count, ...}   (blocks whose count is not 0; a held block has 1,
                                                  a block shared by n sequences n, a double free < 0)
     "live_state": {...LLMEngine.live_state()},
     "view": {"registries", "histories", "coverage", "released", "blocks_not_free", "request_history"}}

``view`` is the engine's introspection point (vlite.engine.introspection.EngineView, with the
async engine's and the server's registries), as ``vlite.diagnostics.snapshot.view_dict`` writes it.

``sequences`` lists every live sequence, including each sample of an n > 1 request and each
beam (waiting ones with an empty block table), and then every block table whose owner is no
longer live (an orphan, a leak: its seq_id is in ``live_state["orphan_block_tables"]``). ``origin`` is
``{request_id, arrival_time, route, client_tag, client_action}`` or null when unknown.
"""

from __future__ import annotations

import dataclasses

from vlite.engine import LLMEngine, RequestOrigin


def _origin(origin: RequestOrigin | None) -> dict | None:
    return dataclasses.asdict(origin) if origin is not None else None


def blocks_snapshot(engine: LLMEngine, async_engine=None) -> dict:
    """Build the /debug/blocks document; call it on the engine thread (read-only)."""
    from vlite.diagnostics.snapshot import view_dict
    from vlite.engine import EngineView

    stats = engine.stats()
    tables = engine.block_tables_view()
    live = engine.live_state()
    sequences = []
    listed: set[int] = set()
    for seq in engine.sequences_view():
        sequences.append({"seq_id": seq["seq_id"], "request_id": seq["request_id"], "index": seq["index"],
                          "status": seq["status"], "block_table": seq["block_table"],
                          "origin": _origin(seq["origin"])})
        listed.add(seq["seq_id"])
    for seq_id, table in tables.items():
        if seq_id in listed:
            continue
        record = engine.request_record(seq_id)
        sequences.append({"seq_id": seq_id, "request_id": record.origin.request_id if record else None,
                          "index": None, "status": record.status if record else None, "block_table": table,
                          "origin": _origin(record.origin if record else None)})
    ledger = [{"block_id": r.block_id, "seq_id": r.seq_id, "request_id": r.request_id, "site": r.site,
               "step": r.step, "age_s": r.age_s, "origin": _origin(r.origin), "status": r.status,
               "finish_reason": r.finish_reason} for r in engine.ledger()]
    anomalies = [{"kind": a.kind, "block_id": a.block_id, "seq_id": a.seq_id, "request_id": a.request_id,
                  "step": a.step, "time": a.time} for a in engine.ledger_anomalies()]
    return {
        "num_total_blocks": stats.num_total_blocks,
        "num_free_blocks": stats.num_free_blocks,
        "num_used_blocks": stats.num_used_blocks,
        "num_cached_blocks": stats.num_cached_blocks,
        "kv_cache_usage": stats.kv_cache_usage,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "sequences": sequences,
        "ledger": ledger,
        "anomalies": anomalies,
        "ref_counts": {str(block): count for block, count in enumerate(engine.ref_counts()) if count},
        "live_state": live,
        "view": view_dict(EngineView(engine, async_engine)),
    }
