"""Evidence for leaked blocks: suspected code paths read from the ledger and its release
history, and a description of blocks the ledger cannot name.

A suspected path is derived from what the engine recorded, not from the planted faults:
whether the owner is still registered, whether the block is still in its block table, which
site replaced a table entry, which of the sequence's other references were released (by which
path, at which step, after which finish reason or at a preemption), and how often it was
preempted. When the evidence does not single out a path the answer is "unknown", with the
evidence shown.

Release records (``vlite.engine.core.kv_cache_manager.ReleaseRecord`` as plain dicts): a release by
path "free" of a sequence whose status was still "running" is a preemption (the scheduler
frees before it marks the sequence preempted); one of a "finished" sequence is its finish.
"""

from __future__ import annotations

from collections import defaultdict


def _release_phase(r: dict) -> str:
    if r["path"] != "free":
        return r["path"]
    if r["seq_status"] == "running":
        return "preemption"
    return f"finish ({r['finish_reason']})" if r["finish_reason"] else f"free while {r['seq_status']}"


def suspected_paths(snap, rows: list[dict]) -> None:
    """Set ``suspected_path`` and ``evidence`` on every held-block row (in place).

    Recorded facts come first: the finish path the sequence took and an exception that cut its
    release short (``RequestRecord.finish_path`` / ``release_error``), and whether the free path
    ran for it at all (``BlockLedger.frees``). Only without them is the path read from the
    release history."""
    released_by_seq: dict[int, list[dict]] = defaultdict(list)
    for r in snap.released:
        released_by_seq[r["seq_id"]].append(r)
    frees_by_seq: dict[int, list[dict]] = defaultdict(list)
    for f in getattr(snap, "frees", []) or []:
        frees_by_seq[f["seq_id"]].append(f)
    held_by_seq: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        held_by_seq[row["seq_id"]].append(row)
    live = set(snap.live_state.get("live_request_ids", []))
    frees = getattr(snap, "frees", None) or []
    for row in rows:
        held = held_by_seq[row["seq_id"]]
        path, ev = _suspect(row, snap, released_by_seq[row["seq_id"]], held, live)
        # "no free recorded" is evidence only if the bounded history reaches back to this allocation
        covered = bool(frees) and frees[0]["step"] <= row["step"]
        recorded, extra = _recorded(row, frees_by_seq[row["seq_id"]], len(held), covered)
        row["suspected_path"] = recorded or path
        row["evidence"] = f"{ev}; {extra}" if extra else ev


def _recorded(row: dict, frees: list[dict], num_held: int, has_frees: bool) -> tuple[str | None, str]:
    """(the path the engine's records prove, or None; evidence text to add)."""
    finish, error = row.get("finish_path"), row.get("release_error")
    finished_by = f"finished by {finish}" if finish else None
    if error:
        return (f"sequence {finished_by or 'finished'}; its release raised before the blocks were freed ({error})",
                "")
    if row.get("status") == "finished" and finish is None and row.get("finish_reason") is None:
        return "sequence marked finished without passing the finish path (no finish recorded)", ""
    if frees:
        f = frees[-1]
        return None, (f"free path ran {len(frees)}x, last {f['code_path']} at step {f['step']} "
                      f"({f['num_released']} references)")
    if finished_by and has_frees:
        return (f"sequence {finished_by}; no release recorded for its {num_held} block{'s' if num_held != 1 else ''} "
                "(the free path never ran for it)", "")
    return None, ""


def _suspect(row: dict, snap, released: list[dict], held: list[dict], live: set[str]) -> tuple[str, str]:
    table = snap.block_tables.get(row["seq_id"])
    status, reason, site = row.get("status"), row.get("finish_reason"), row.get("site")
    ev = [f"owner {status or 'unknown'}" + (f" ({reason})" if reason else ""), f"allocated at {site}, step {row['step']}"]
    if row.get("num_preemptions"):
        ev.append(f"preempted {row['num_preemptions']}x")
    phases = sorted({_release_phase(r) for r in released})
    if released:
        ev.append(f"{len(released)} other references of this sequence released ({', '.join(phases)}, last at step "
                  f"{released[-1]['step']})")
    else:
        ev.append("no release of this sequence remembered")
    evidence = "; ".join(ev)
    if status == "finished" and row["request_id"] in live:
        what = "the abort/disconnect path" if reason == "abort" else "the finish path"
        return f"{what} raised before the release (request entry kept)", evidence
    if table is not None and row["block_id"] in table:
        if status == "finished":
            return "the free path kept this sequence's block table (finished, table not released)", evidence
        return "held by a live sequence at quiescence (stuck request)", evidence
    if table is not None:
        newer = [h for h in held if h["block_id"] in table and h["step"] >= row["step"]]
        sites = sorted({h["site"] for h in newer})
        if sites:
            return (f"{'/'.join(sites)} replaced this block-table entry without releasing the old block",
                    evidence + f"; the table now holds a {'/'.join(sites)} block from step {newer[0]['step']}")
        return "dropped from the block table without a release", evidence
    older = [r for r in released if r["alloc_step"] is not None and r["alloc_step"] <= row["step"]]
    if row.get("num_preemptions") and not older:
        return ("dropped at preemption without a release: the sequence was preempted, and only blocks allocated "
                "after this one were released", evidence)
    if released:
        return (f"the {'/'.join(phases)} release skipped this {site} reference (others of the same sequence were "
                f"released)", evidence)
    if status == "finished":
        return f"a finished sequence's {site} reference was never released (free path)", evidence
    return "unknown", evidence


def unattributed(snap) -> list[dict]:
    """Blocks not free at idle that no ledger entry names: block id, ref_count, and the last
    holders from the release history (who released it, by which path, at which step)."""
    named = {r["block_id"] for r in snap.ledger}
    by_block: dict[int, list[dict]] = defaultdict(list)
    for r in snap.released:
        by_block[r["block_id"]].append(r)
    out = []
    for b in snap.blocks_not_free:
        if b["block_id"] in named:
            continue
        last = by_block.get(b["block_id"], [])[-3:]
        holders = [{"request_id": r["request_id"], "seq_id": r["seq_id"], "alloc_site": r["alloc_site"],
                    "released_by": _release_phase(r), "step": r["step"], "ref_count_after": r["ref_count_after"]}
                   for r in last]
        if last:
            r = last[-1]
            text = (f"last held by {r['request_id']} (seq {r['seq_id']}, allocated at {r['alloc_site']}); its ledger "
                    f"entry was cleared by {_release_phase(r)} at step {r['step']} with ref_count left at "
                    f"{r['ref_count_after']}")
            if r["ref_count_after"] > 0 and r["alloc_site"] is not None:
                text += ": a release cleared the ledger but did not bring the count to 0"
        else:
            text = "no release of this block remembered (allocated without a ledger entry, or history too short)"
        out.append({"block_id": b["block_id"], "ref_count": b["ref_count"], "last_holders": holders, "evidence": text})
    return out
