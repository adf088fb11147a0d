"""Where the planted faults (``faults.FAULTS``) attach: subclasses of the scheduler and the KV
cache manager that ``LLMEngine`` builds only when ``--inject-fault`` names one of their faults.

Each override plants its defect and otherwise defers to the engine's own method (``super()``),
so the leak checker is tested against the code that serves requests, and the engine's classes
carry no fault. ``raise-in-step`` attaches in the model runner (``prepare_input``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.core.faults import FaultSet, PlantedFault
from vlite.engine.core.kv_cache_manager import KVCacheManager
from vlite.engine.core.ledger import AllocationSite
from vlite.engine.core.request import Request
from vlite.engine.core.sched_output import ForkSamples
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.core.sequence import FinishReason, Sequence, SequenceStatus

# The faults that need FaultyScheduler (and its FaultyKVCacheManager); the others attach elsewhere.
SCHEDULER_FAULTS = frozenset({
    "skip-free-on-abort", "leak-on-preempt", "orphan-block-table", "double-free",
    "refcount-not-decremented-on-fork", "reclaim-on-admission", "empty-output-after-abort",
})


class FaultyKVCacheManager(KVCacheManager):
    """A ``KVCacheManager`` with planted defects in its free path and at admission.

    Args:
        faults: the planted faults (only those of ``SCHEDULER_FAULTS`` act here).
        *args, **kwargs: as for ``KVCacheManager``.

    Raises (from ``free``):
        PlantedFault: an aborted sequence's free, with ``skip-free-on-abort``.
    """

    def __init__(self, *args, faults: FaultSet, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults
        # reclaim-on-admission: aborted sequences whose tables are set aside until an admission
        self.parked: list[tuple[Sequence, list[int]]] = []
        # empty-output-after-abort: blocks released by aborts and not yet reused, and the
        # sequences admitted onto them (they end at their first step with no token)
        self.orphaned_blocks = 0
        self.reused_orphans: set[int] = set()

    def free(self, seq: Sequence) -> int:
        active = self.faults.active
        if seq.status is SequenceStatus.RUNNING and active("leak-on-preempt"):
            # a running sequence's free is its preemption's: the blocks are forgotten, not freed
            self.block_tables.pop(seq.seq_id, None)
            return 0
        if seq.finish_reason is FinishReason.ABORT and not any(s is seq for s, _ in self.parked):
            self._plant_on_abort(seq)
        kept = self.block_tables.get(seq.seq_id)
        n = super().free(seq)
        if kept and active("orphan-block-table"):
            self.block_tables[seq.seq_id] = kept  # blocks released, the table entry left behind
        if kept and active("double-free"):
            self._release(kept[-1], seq)
        return n

    def _plant_on_abort(self, seq: Sequence) -> None:
        """The abort path's faults, before the blocks are released."""
        if self.faults.active("skip-free-on-abort"):
            raise PlantedFault(f"planted fault skip-free-on-abort: abort of {seq.request_id!r} "
                               "raised before its blocks were released")
        if self.faults.active("empty-output-after-abort"):
            self.orphaned_blocks += len(self.block_tables.get(seq.seq_id, ()))
        if self.faults.active("reclaim-on-admission"):
            # the table is set aside (the free finds none); it is freed at the next admission
            self.parked.append((seq, self.block_tables.pop(seq.seq_id, [])))

    def _release(self, block_id: int, seq: Sequence, path: str = "free") -> None:
        if (path == "free" and seq.parent_seq_id is not None and self.faults.active("refcount-not-decremented-on-fork")
                and self.ledger.site_of(seq.seq_id, block_id) is AllocationSite.FORK):
            return  # the reference taken at fork is never dropped
        super()._release(block_id, seq, path)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, site: AllocationSite,
                       prefix_hits: list[int] | None = None) -> bool:
        admitting = seq.status is not SequenceStatus.RUNNING
        if admitting and self.parked and not self._parked_leave_room(seq, num_new_tokens, prefix_hits or []):
            return False  # reclaim-on-admission: the parked blocks are reserved a second time
        if not super().allocate_slots(seq, num_new_tokens, site, prefix_hits):
            return False
        if admitting and self.parked:
            self._reclaim_parked()
        if admitting and self.orphaned_blocks > 0 and seq.status is SequenceStatus.WAITING:
            # empty-output-after-abort: a new request reuses blocks an abort released
            self.orphaned_blocks -= len(self.block_tables.get(seq.seq_id, ()))
            self.reused_orphans.add(seq.seq_id)
        return True

    def _parked_leave_room(self, seq: Sequence, num_new: int, hits: list[int]) -> bool:
        """Admission counts the parked blocks as needed once more, on top of their being held."""
        parked = sum(len(table) for _, table in self.parked)
        return self.num_allocatable_blocks - parked >= self.num_blocks_to_grow(seq, num_new, len(hits))

    def _reclaim_parked(self) -> None:
        """Free the parked blocks (runs only on an admission)."""
        for seq, table in self.parked:
            self.block_tables[seq.seq_id] = table
            self.free(seq)
        self.parked.clear()


class FaultyScheduler(Scheduler):
    """A ``Scheduler`` over a ``FaultyKVCacheManager``; with ``empty-output-after-abort`` a
    sequence admitted onto blocks an abort released ends at its first step with no token.

    Args:
        config, cache_config, num_blocks: as for ``Scheduler``.
        faults: the planted faults.
        **kwargs: as for ``Scheduler``.
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int, *, faults: FaultSet,
                 enable_ledger: bool = True, **kwargs) -> None:
        super().__init__(config, cache_config, num_blocks, enable_ledger=enable_ledger, **kwargs)
        self.faults = faults
        self.kv_cache_manager = FaultyKVCacheManager(num_blocks, cache_config.block_size, enable_ledger=enable_ledger,
                                                     enable_prefix_caching=cache_config.enable_prefix_caching,
                                                     faults=faults)

    def _fork_samples(self, req: Request, parent: Sequence, forks: ForkSamples, now: float) -> None:
        if parent.seq_id in self.kv_cache_manager.reused_orphans:
            return  # it ends with no token below, before any sample is forked
        super()._fork_samples(req, parent, forks, now)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        if seq.seq_id in self.kv_cache_manager.reused_orphans:
            self.kv_cache_manager.reused_orphans.discard(seq.seq_id)
            self.finish_sequence(seq, FinishReason.STOP)
            return
        super()._append_token(seq, token, logprobs, now)


def scheduler_factory(faults: FaultSet) -> Callable[..., Scheduler]:
    """What builds the engine's scheduler (``Scheduler``'s arguments): ``FaultyScheduler`` with
    ``faults`` when they name one of ``SCHEDULER_FAULTS``, else ``Scheduler`` itself."""
    return functools.partial(FaultyScheduler, faults=faults) if faults.names & SCHEDULER_FAULTS else Scheduler
