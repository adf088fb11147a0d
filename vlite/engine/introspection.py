"""EngineView: one read-only introspection point of the engine for diagnostics.

The leak checker (in process) and ``/debug/blocks`` (over HTTP) read the engine's per-request
registries, its coverage counters and the ledger's release history only through this view,
so a new registry is added to the checks in one place. Every method returns a frozen copy;
nothing here changes the engine. Call it while the engine is not stepping (between steps, on
the engine thread for a served engine) for a consistent picture; the sizes alone are safe to
sample from another thread (they are ``len()`` reads).

Registries (per-request state that must be empty once the engine is idle):

=========================  ==================================================================
``scheduler.requests``     live ``Request`` objects by request id
``scheduler.waiting``      waiting (and preempted) sequences
``scheduler.running``      running sequences
``scheduler.live_sequences`` live sequences of all live requests (``Request.live``)
``block_tables``           block tables by sequence id
``prefix_hash_progress``   full blocks already hashed, by sequence id (prefix caching)
``pending_copies``         copy-on-write copies not yet applied
``ledger.held``            block references held (the allocation ledger)
``structured_output...``   sequences with a grammar matcher (``structured_output.matchers``)
``async.live``             the async engine's requests in flight (a served engine only)
``server.metrics_...``     the server's per-request last-token times (``/debug/blocks`` only)
=========================  ==================================================================

Bounded, documented histories (allowed to be non-empty at idle, never above their bound):
``engine.records`` (the ``RequestRecord`` of every live sequence plus the finished history)
and ``engine.finished_order`` (``Scheduler.finished_records``: ``EngineConfig.finished_history``
finished sequences, kept for attribution), ``ledger.released`` (``RELEASE_HISTORY`` released block
references), ``ledger.frees`` (as many calls of the free path), and ``prefix_cache.index`` (one entry per cached block: at idle it must equal
``num_cached_blocks``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from vlite.engine.census import CensusResult, module_roots, request_census
from vlite.engine.core.ledger import FreeRecord, LedgerAnomaly, ReleaseRecord
from vlite.engine.core.request import RequestRecord
from vlite.engine.core.sequence import RequestOrigin, SeqId, Sequence
from vlite.engine.metrics import EngineStats

# Registry name -> what it holds; empty at idle.
REGISTRIES: dict[str, str] = {
    "scheduler.requests": "live Request objects by request id",
    "scheduler.waiting": "waiting and preempted sequences",
    "scheduler.running": "running sequences",
    "scheduler.live_sequences": "live sequences of the live requests (Request.live)",
    "block_tables": "block tables by sequence id",
    "prefix_hash_progress": "hashed full blocks by sequence id (prefix caching)",
    "pending_copies": "copy-on-write copies not applied yet",
    "ledger.held": "block references held (allocation ledger)",
    "structured_output.matchers": "grammar matcher states by sequence id (structured output)",
}
ASYNC_REGISTRIES: dict[str, str] = {
    "async.live": "the async engine's requests in flight",
    "server.metrics_last_token": "the server's per-request last-token times (inter-token latency)",
}
# History name -> what it holds; bounded, allowed at idle.
HISTORIES: dict[str, str] = {
    "engine.records": "request records of live and recently finished sequences (attribution)",
    "engine.finished_order": "recently finished sequences, oldest first (bounded by finished_history)",
    "ledger.released": "released block references (bounded release history)",
    "ledger.frees": "calls of the free path (bounded, as the release history)",
    "prefix_cache.index": "prefix-cache hash index (one entry per cached block)",
}


@dataclass(frozen=True)
class Coverage:
    """Which engine paths a run exercised (counts since the engine started).

    allocation_sites: block references allocated, by ledger site ("prefill", "decode append",
        "prefix cache hit", "fork", "copy-on-write").
    finish_reasons: sequences ended, by kind ("stop:eos", "stop:stop_token",
        "stop:stop_string", "stop:beam_pruned", "stop:grammar", "stop", "length", "abort", "error").
    abort_states: aborted sequences by the state they were in ("waiting", "prefill",
        "decode", "preempted", "resumed").
    preemptions, resumptions: recompute preemptions, and preempted sequences scheduled again.
    preemptions_in_prefill: preemptions of a sequence with no output token yet (its prefill,
        chunked or not, was dropped).
    prefix_hit_tokens: prompt tokens served from the prefix cache (tokens).
    forks: fork calls (n > 1 samples, beam search); copy_on_write: block copies;
    beam_prunes: beams dropped by beam search.
    features: requests admitted, by request-API feature (``core/request_features.py``:
        "structured:json", "logprobs", "logit_bias", "n > 1", ...).
    aborts_by_family: aborted sequences by "<family>: <state>" ("n > 1: prefill",
        "beam search: decode", "structured output: decode", "single: waiting", ...).
    rejections: requests refused, by stage: "at admission" (``add_request`` raised
        RequestRejectedError), "sibling rejected" (admitted by ``add_requests``, then aborted
        because another request of its group was refused: a multi-prompt completion), "after
        scheduling" (sequences ended for the request's own parameters once running).
    """

    allocation_sites: Mapping[str, int]
    finish_reasons: Mapping[str, int]
    abort_states: Mapping[str, int]
    preemptions: int
    resumptions: int
    prefix_hit_tokens: int
    forks: int
    copy_on_write: int
    beam_prunes: int
    features: Mapping[str, int] = field(default_factory=dict)
    aborts_by_family: Mapping[str, int] = field(default_factory=dict)
    preemptions_in_prefill: int = 0
    rejections: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"allocation_sites": dict(self.allocation_sites), "finish_reasons": dict(self.finish_reasons),
                "abort_states": dict(self.abort_states), "preemptions": self.preemptions,
                "resumptions": self.resumptions, "prefix_hit_tokens": self.prefix_hit_tokens, "forks": self.forks,
                "copy_on_write": self.copy_on_write, "beam_prunes": self.beam_prunes,
                "features": dict(self.features), "aborts_by_family": dict(self.aborts_by_family),
                "preemptions_in_prefill": self.preemptions_in_prefill, "rejections": dict(self.rejections)}


@dataclass(frozen=True)
class LedgerRecord:
    """A block reference still held, joined with its owner's origin and final state
    (``age_s``: seconds since it was taken; ``step``: the engine step that took it)."""

    block_id: int
    seq_id: int
    request_id: str
    site: str
    step: int
    age_s: float
    origin: RequestOrigin | None
    status: str | None
    finish_reason: str | None


@dataclass(frozen=True)
class HistorySize:
    """A bounded history's size and bound (entries)."""

    size: int
    bound: int


@dataclass(frozen=True)
class EngineSnapshot:
    """A frozen picture: step, registry sizes (entries), history sizes and coverage."""

    step: int
    registries: Mapping[str, int]
    histories: Mapping[str, HistorySize]
    coverage: Coverage
    num_cached_blocks: int
    finished_history: int = field(default=0)


@dataclass(frozen=True)
class RequestHistory:
    """What the engine remembers of one request (its sequences together).

    finished_time: when its last sequence ended (``time.time()`` s, None while live);
    released_time / released_step: the last release of one of its block references (from the
    bounded release history; None if none is remembered); num_output_tokens: tokens generated
    by all its sequences; finished_step: the engine step counter when its last sequence ended
    (None while live), the end of a request that held no block.
    """

    request_id: str
    finished: bool
    finish_reasons: tuple[str, ...]
    finished_time: float | None
    released_time: float | None
    released_step: int | None
    num_output_tokens: int  # the most of any of its sequences (tokens)
    num_preemptions: int
    finished_step: int | None = None


@dataclass(frozen=True)
class EngineInfo:
    """Fixed facts of an engine: model name, device ("cpu" | "cuda"), ``block_size`` (tokens
    per block), ``bytes_per_block`` (bytes of K and V of one block over all layers),
    ``num_total_blocks``, the planted faults, ``tensor_parallel_size`` and the PIDs of the
    worker processes on this host that hold the model's ranks (empty when it runs in-process)."""

    model_name: str
    device: str
    block_size: int
    bytes_per_block: int
    num_total_blocks: int
    inject_faults: tuple[str, ...]
    tensor_parallel_size: int = 1
    worker_pids: tuple[int, ...] = ()
    max_model_len: int = 0  # tokens a request (prompt + max_tokens) may take at most


class EngineView:
    """Read-only view of an ``LLMEngine`` (and optionally the ``EngineLoop`` serving it)."""

    def __init__(self, engine, loop=None) -> None:
        self._engine = engine
        self._loop = loop  # the EngineLoop serving it (vlite.engine.serving), if any: its ``num_live``

    def blocks_document(self) -> dict:
        """The ``GET /debug/blocks`` document of this engine (``blocks_document``)."""
        return blocks_document(self._engine, self._loop)

    def info(self) -> EngineInfo:
        """The engine's fixed facts (they do not change after start)."""
        e = self._engine
        return EngineInfo(e.model_name, e.device.type, e.block_size, e.bytes_per_block,
                          e.scheduler.kv_cache_manager.num_total_blocks, tuple(e.config.inject_faults),
                          e.config.parallel.tensor_parallel_size, tuple(e.executor.worker_pids()), e.max_model_len)

    def request_record(self, seq_id: int) -> RequestRecord | None:
        """The record (origin, status, finish reason, counts) of a live or remembered sequence."""
        return self._engine.scheduler.request_record(seq_id)

    def registries(self) -> dict[str, int]:
        """Sizes (entries) of every per-request registry; all 0 when the engine is idle."""
        e = self._engine
        sched, bm = e.scheduler, e.scheduler.kv_cache_manager
        sizes = {"scheduler.requests": len(sched.requests), "scheduler.waiting": len(sched.waiting),
                 "scheduler.running": len(sched.running),
                 "scheduler.live_sequences": sum(len(r) for r in list(sched.requests.values())),
                 "block_tables": len(bm.block_tables), "prefix_hash_progress": len(bm._num_hashed),
                 "pending_copies": len(bm.pending_copies), "ledger.held": len(bm.ledger),
                 "structured_output.matchers": len(sched.structured_output.matchers)}
        if self._loop is not None:
            sizes["async.live"] = self._loop.num_live
        return sizes

    def histories(self) -> dict[str, HistorySize]:
        """Sizes and bounds of the bounded histories (allowed to be non-empty at idle)."""
        e = self._engine
        bm = e.scheduler.kv_cache_manager
        sched = e.scheduler
        keep = sched.finished_history
        reqs = list(sched.requests.values())
        live = sum(len(r) for r in reqs)
        # records of live requests not yet in the finished history, plus that history
        num_records = len(sched.finished_records) + sum(
            sum(1 for sid in r.records if sid not in sched.finished_records) for r in reqs)
        return {"engine.records": HistorySize(num_records, keep + live),
                "engine.finished_order": HistorySize(len(sched.finished_records), keep),
                "ledger.released": HistorySize(len(bm.ledger.released), bm.ledger.released.maxlen or 0),
                "ledger.frees": HistorySize(len(bm.ledger.frees), bm.ledger.frees.maxlen or 0),
                "prefix_cache.index": HistorySize(len(bm.cached_blocks), bm.num_total_blocks)}

    def coverage(self) -> Coverage:
        """The coverage counters since the engine started (counts; see ``Coverage``)."""
        e = self._engine
        bm, st = e.scheduler.kv_cache_manager, e.scheduler.make_stats()
        return Coverage(MappingProxyType(dict(bm.allocations_by_site)), MappingProxyType(dict(st.finish_counts)),
                        MappingProxyType(dict(st.abort_states)), st.num_preemptions_total,
                        st.num_resumptions_total, bm.prefix_cache_hits, bm.num_forks, bm.num_copy_on_write,
                        st.num_beam_prunes, MappingProxyType(dict(st.feature_counts)),
                        MappingProxyType(dict(st.aborts_by_family)), st.num_preemptions_in_prefill,
                        MappingProxyType(self._rejections(st.num_rejected_after_scheduling)))

    def _rejections(self, after_scheduling: int) -> dict[str, int]:
        out = dict(getattr(self._engine, "rejection_counts", None) or {})
        if after_scheduling:
            out["after scheduling"] = after_scheduling
        return out

    def snapshot(self) -> EngineSnapshot:
        """Registries, histories and coverage in one frozen object."""
        e = self._engine
        return EngineSnapshot(e.scheduler.step_counter, MappingProxyType(self.registries()),
                              MappingProxyType(self.histories()), self.coverage(),
                              e.scheduler.kv_cache_manager.num_cached_blocks, e.config.finished_history)

    def frees(self) -> tuple[FreeRecord, ...]:
        """The bounded history of calls of the free path (``KVCacheManager.free``), oldest first."""
        return tuple(self._engine.scheduler.kv_cache_manager.ledger.frees)

    def released(self, block_ids: set[int] | None = None) -> tuple[ReleaseRecord, ...]:
        """The release history (oldest first), or only the records of ``block_ids``."""
        hist = self._engine.scheduler.kv_cache_manager.ledger.released
        return tuple(r for r in hist if block_ids is None or r.block_id in block_ids)

    def request_history(self, request_ids: set[str] | None = None) -> dict[str, RequestHistory]:
        """Per request (live or remembered): finish state, last release (time, step), tokens."""
        e = self._engine
        by_req: dict[str, list] = {}
        for rec in self._all_records():
            rid = rec.origin.request_id
            if request_ids is None or rid in request_ids:
                by_req.setdefault(rid, []).append(rec)
        last_release: dict[str, tuple[float, int]] = {}
        for r in e.scheduler.kv_cache_manager.ledger.released:
            if r.request_id in by_req:
                last_release[r.request_id] = (r.time, r.step)
        out = {}
        for rid, recs in by_req.items():
            finished = all(r.finish_reason is not None for r in recs) and rid not in e.scheduler.requests
            times = [r.finished_time for r in recs if r.finished_time is not None]
            steps = [r.finished_step for r in recs if r.finished_step is not None]
            rel = last_release.get(rid)
            out[rid] = RequestHistory(rid, finished, tuple(r.finish_reason for r in recs if r.finish_reason),
                                      max(times) if finished and times else None, rel[0] if rel else None,
                                      rel[1] if rel else None, max(r.num_output_tokens for r in recs),
                                      sum(r.num_preemptions for r in recs),
                                      max(steps) if finished and steps else None)
        return out

    @property
    def step(self) -> int:
        """The engine step counter (steps scheduled since start)."""
        return self._engine.scheduler.step_counter

    def request_tokens(self, request_id: str) -> int:
        """Output tokens of a live request now: the most of any of its live sequences (0 if none)."""
        return max((s.num_output_tokens for s in self._engine.scheduler.requests.get(request_id, ())), default=0)

    def request_census(self, ended_request_ids, *, extra_roots: Mapping[str, object] | None = None,
                       skip: Iterable[object] = (), max_objects: int = 500_000,
                       exclude_modules: tuple[str, ...] = ()) -> CensusResult:
        """Every container reachable from the engine (and the async engine serving it, and
        ``extra_roots``, and the module- and class-level containers of vlite's engine, kernels
        and server modules) that still holds an ended request's id, object or sequence id; with
        the size of every container reached (``CensusResult.container_sizes``).

        Call it at an idle point: a sequence id that is not live counts as ended. The bounded
        histories (``HISTORIES``) are not entered, nor the block pool's blocks and free queue
        (ints only, one per block). Costs one visit per reachable object (ms;
        docs/benchmarks.md, "Request-id census: cost per idle point"), so never call it inside a step. ``skip``: more objects not to enter
        (the caller's own bounded record of ended ids). ``exclude_modules``: packages whose
        module-level containers, and whose objects a callback leads to, another census walks
        (``census.API_SERVER_MODULES`` when the API server shares this process). See
        ``census.request_census``.
        """
        sched = self._engine.scheduler
        bm = sched.kv_cache_manager
        live = self._live_sequences()
        names = {sid: rec.origin.request_id for sid, rec in list(sched.finished_records.items())}
        roots = {"engine": self._engine}
        if self._loop is not None:
            roots["async_engine"] = self._loop
        roots.update(extra_roots or {})
        roots.update(module_roots(exclude=exclude_modules))
        # Not entered either: the block pool's blocks and free queue, one object or entry per
        # block and nothing but ints (PhysicalBlock's fixed __slots__): 131,072 blocks (the tiny
        # model's default pool) made a walk take 1.2 s; per-request block state is in the tables.
        return request_census(roots, ended_request_ids,
                              skip=[sched.finished_records, bm.ledger.released, bm.ledger.frees, bm.cached_blocks,
                                    bm.ledger._anomalies, bm.blocks, bm.free_block_queue,
                                    *skip],  # anomalies are reported as such
                              seq_id_type=SeqId, live_seq_ids=live, seq_names=names, max_objects=max_objects,
                              callbacks_not_followed_into=exclude_modules)

    def worker_census(self, ended_request_ids) -> list[dict]:
        """The request-id census inside each tensor-parallel worker process, rank order (empty
        when the model runs in the engine's process): ``Worker.census`` over the executor's call
        channel, told the engine's live sequences and the request id of every finished record's
        sequence (a rank sees sequence ids only). Each entry: ``rank``, ``pid``, ``held``,
        ``objects_visited``, ``truncated``, ``container_sizes``, ``elapsed_ms``. Call it at an idle
        point (the ranks walk while no step runs).

        Raises:
            WorkerFailedError: a rank died or raised.
        """
        sched = self._engine.scheduler
        names = {int(sid): rec.origin.request_id for sid, rec in list(sched.finished_records.items())}
        return self._engine.executor.worker_census(sorted(ended_request_ids), names,
                                                   [int(s) for s in self._live_sequences()])

    def blocks_not_free(self) -> list[dict]:
        """Every block that is not in the free block queue: block_id and ref_count."""
        bm = self._engine.scheduler.kv_cache_manager
        return [{"block_id": b.block_id, "ref_count": b.ref_count} for b in bm.blocks
                if b.block_id not in bm.free_block_queue or b.ref_count != 0]

    # ---- the engine's read-only methods (LLMEngine delegates here) ------------------------
    def _all_records(self) -> list[RequestRecord]:
        sched = self._engine.scheduler
        recs = {sid: r for req in list(sched.requests.values()) for sid, r in req.records.items()}
        recs.update(sched.finished_records)
        return list(recs.values())

    def _live_sequences(self) -> dict[int, Sequence]:
        return {s.seq_id: s for req in list(self._engine.scheduler.requests.values()) for s in req.live}

    def stats(self) -> EngineStats:
        """Counters and gauges for ``/metrics`` and the logs (see ``EngineStats``)."""
        e = self._engine
        sched = e.scheduler
        st = sched.stats
        return EngineStats(step=sched.step_counter, num_running=sched.num_running, num_waiting=sched.num_waiting,
                           num_preemptions_total=st.num_preemptions_total,
                           prompt_tokens_total=st.prompt_tokens_total,
                           generation_tokens_total=st.generation_tokens_total,
                           num_live_requests=len(sched.requests), blocks=e.scheduler.kv_cache_manager.stats(),
                           coverage=self.coverage())

    def ledger(self) -> list[LedgerRecord]:
        """Every block reference still held, with its owner's origin and current (or final)
        status (oldest first)."""
        e = self._engine
        now = time.time()
        live = self._live_sequences()
        out = []
        for entry in e.scheduler.kv_cache_manager.ledger.held():
            rec = e.scheduler.request_record(entry.seq_id)
            seq = live.get(entry.seq_id)
            status = seq.status.value if seq else (rec.status if rec else None)
            out.append(LedgerRecord(entry.block_id, entry.seq_id, entry.request_id, entry.site.value, entry.step,
                                    now - entry.time, rec.origin if rec else None, status,
                                    rec.finish_reason if rec else None))
        return out

    def ledger_anomalies(self) -> list[LedgerAnomaly]:
        """Anomalies the allocation ledger saw (double frees, frees of unowned blocks, ...)."""
        return self._engine.scheduler.kv_cache_manager.ledger.anomalies()

    def sequences_view(self) -> list[dict]:
        """Every live sequence (all samples and beams of every request): ids, index, status,
        token counts (tokens) and block table. A read-only copy."""
        tables = self._engine.scheduler.kv_cache_manager.block_tables
        return [{"seq_id": s.seq_id, "request_id": s.request_id, "index": s.index, "status": s.status.value,
                 "parent_seq_id": s.parent_seq_id, "num_prompt_tokens": s.num_prompt_tokens,
                 "num_computed_tokens": s.num_computed_tokens, "num_output_tokens": s.num_output_tokens,
                 "num_preemptions": s.num_preemptions, "block_table": list(tables.get(s.seq_id, ())),
                 "origin": s.origin}
                for s in self._live_sequences().values()]

    def live_state(self) -> dict[str, list]:
        """Per-request CPU-side state, for leak checks: ids of live requests and block tables,
        and which block tables belong to sequences that already finished."""
        sched = self._engine.scheduler
        live_seq_ids = set(self._live_sequences())
        tables = list(self._engine.scheduler.kv_cache_manager.block_tables)
        return {"live_request_ids": list(sched.requests), "block_table_seq_ids": tables,
                "orphan_block_tables": [sid for sid in tables if sid not in live_seq_ids],
                "finished_live_requests": [rid for rid, req in sched.requests.items()
                                           if any(s.is_finished for s in req)]}

    def block_tables(self) -> dict[int, list[int]]:
        """Block tables (physical block ids) by sequence id, copied."""
        return {sid: list(t) for sid, t in self._engine.scheduler.kv_cache_manager.block_tables.items()}

    def ref_counts(self) -> list[int]:
        """Reference count of every block, by block id."""
        return self._engine.scheduler.kv_cache_manager.ref_counts()

    def request_progress(self, request_id: str) -> dict[str, int | str] | None:
        """Where a live request is, for clients that inject aborts at a given phase.

        Returns None if no live request has that id; else ``status`` (waiting | running |
        preempted | finished), ``seq_id``, and token counts ``num_prompt_tokens``,
        ``num_computed_tokens`` (K/V in the cache), ``num_output_tokens``, plus
        ``num_preemptions`` and ``num_blocks`` (blocks in its block table).
        """
        req = self._engine.scheduler.requests.get(request_id)
        if not req:
            return None
        seq = req[0]
        return {"status": seq.status.value, "seq_id": seq.seq_id, "num_prompt_tokens": seq.num_prompt_tokens,
                "num_computed_tokens": seq.num_computed_tokens, "num_output_tokens": seq.num_output_tokens,
                "num_preemptions": seq.num_preemptions,
                "num_blocks": len(self._engine.scheduler.kv_cache_manager.get_block_table(seq.seq_id))}


# ---- the /debug/blocks document (written here once; diagnostics and the server read it) ------------
def _origin(origin: RequestOrigin | None) -> dict | None:
    return dataclasses.asdict(origin) if origin is not None else None


def release_dict(r: ReleaseRecord) -> dict:
    """One ReleaseRecord as plain data (the allocation entry's site and step flattened)."""
    e = r.entry
    return {"block_id": r.block_id, "seq_id": r.seq_id, "request_id": r.request_id,
            "alloc_site": e.site.value if e else None, "alloc_step": e.step if e else None,
            "path": r.path, "seq_status": r.seq_status, "finish_reason": r.finish_reason,
            "num_preemptions": r.num_preemptions, "ref_count_after": r.ref_count_after, "step": r.step,
            "time": r.time, "code_path": r.code_path}


def view_dict(view: EngineView) -> dict:
    """The EngineView's part of the /debug/blocks document as plain JSON-able data (its ``view`` key)."""
    snap = view.snapshot()
    return {"registries": dict(snap.registries),
            "histories": {k: {"size": h.size, "bound": h.bound} for k, h in snap.histories.items()},
            "coverage": snap.coverage.to_dict(),
            "released": [release_dict(r) for r in view.released()],
            "frees": [asdict(f) for f in view.frees()],
            "blocks_not_free": view.blocks_not_free(),
            "request_history": {rid: asdict(h) for rid, h in view.request_history().items()}}


def blocks_document(engine, loop=None) -> dict:
    """The ``GET /debug/blocks`` document: the block manager's state as JSON-able data.

    Call it between two steps (on the engine loop's thread for a served engine): it reads the
    engine only through its read-only methods, so the picture is consistent. ``loop`` is the
    ``EngineLoop`` serving the engine (its requests in flight appear as ``async.live``). Shape::

        {"num_total_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "kv_cache_usage",
         "num_running", "num_waiting",
         "sequences": [{"seq_id", "request_id", "index", "status", "block_table", "origin"}],
         "ledger": [{"block_id", "seq_id", "request_id", "site", "step", "age_s", "origin", "status",
                     "finish_reason", "num_preemptions", "finish_path", "release_error"}],
         "anomalies": [{"kind", "block_id", "seq_id", "request_id", "step", "time", "release_sites",
                        "allocation_sites", "origin"}],
         "ref_counts": {"<block_id>": ref_count, ...}   (blocks whose count is not 0; a held block has 1,
                                                      a block shared by n sequences n, a double free < 0)
         "live_state": {...LLMEngine.live_state()},
         "view": {"registries", "histories", "coverage", "released", "frees", "blocks_not_free", "request_history"}}

    ``sequences`` lists every live sequence, including each sample of an n > 1 request and each
    beam (waiting ones with an empty block table), and then every block table whose owner is no
    longer live (an orphan, a leak: its seq_id is in ``live_state["orphan_block_tables"]``).
    ``origin`` is ``{request_id, arrival_time, route, client_tag, client_action}`` or null when unknown.
    A ledger entry's ``finish_path`` is the finish path its sequence recorded ("abort in decode",
    "stop:stop_string", ...; null while it runs) and ``release_error`` the exception that cut its
    release short; an anomaly's ``release_sites`` names the releases involved (a double free: both),
    its ``allocation_sites`` the allocations (a second reference by the same sequence: both).
    """
    view = EngineView(engine, loop)
    stats = view.stats()
    tables = view.block_tables()
    live = view.live_state()
    sequences = []
    listed: set[int] = set()
    for seq in view.sequences_view():
        sequences.append({"seq_id": seq["seq_id"], "request_id": seq["request_id"], "index": seq["index"],
                          "status": seq["status"], "block_table": seq["block_table"],
                          "origin": _origin(seq["origin"])})
        listed.add(seq["seq_id"])
    for seq_id, table in tables.items():
        if seq_id in listed:
            continue
        record = view.request_record(seq_id)
        sequences.append({"seq_id": seq_id, "request_id": record.origin.request_id if record else None,
                          "index": None, "status": record.status if record else None, "block_table": table,
                          "origin": _origin(record.origin if record else None)})
    ledger = []
    for r in view.ledger():
        record = view.request_record(r.seq_id)
        ledger.append({"block_id": r.block_id, "seq_id": r.seq_id, "request_id": r.request_id, "site": r.site,
                       "step": r.step, "age_s": r.age_s, "origin": _origin(r.origin), "status": r.status,
                       "finish_reason": r.finish_reason,
                       "num_preemptions": record.num_preemptions if record else None,
                       "finish_path": record.finish_path if record else None,
                       "release_error": record.release_error if record else None})
    anomalies = []
    for a in view.ledger_anomalies():
        record = view.request_record(a.seq_id)
        anomalies.append({"kind": a.kind, "block_id": a.block_id, "seq_id": a.seq_id, "request_id": a.request_id,
                          "step": a.step, "time": a.time, "release_sites": list(a.release_sites),
                          "allocation_sites": list(a.allocation_sites),
                          "origin": _origin(record.origin if record else None)})
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
        "ref_counts": {str(block): count for block, count in enumerate(view.ref_counts()) if count},
        "live_state": live,
        "view": view_dict(view),
    }
