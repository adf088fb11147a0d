"""Continuous-batching scheduler with chunked prefill and recompute preemption.

Each step spends a token budget (``max_num_batched_tokens``): running sequences first (a
decode costs 1 token, an unfinished prefill its next chunk), then waiting sequences in
arrival order while the budget, ``max_num_seqs`` and the free blocks allow. When a running
sequence cannot get a block, the most recently arrived running sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue to be recomputed
(vLLM's recompute preemption; see vLLM docs, "Preemption").

Every way a sequence ends goes through ``finish_sequence``, the one free path.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vlite.engine.block_manager import AllocationSite, BlockManager
from vlite.engine.config import SchedulerConfig
from vlite.engine.faults import FaultSet, PlantedFault
from vlite.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: ``num_new_tokens`` tokens starting at its
    ``num_computed_tokens``; ``sample`` is True when the chunk reaches its last token."""

    seq: Sequence
    num_new_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """What one step runs. ``scheduled`` lists decodes first, then prefill chunks."""

    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and decides each step's batch."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, faults: FaultSet | None = None):
        self.config = config
        self.block_manager = block_manager
        self.faults = faults or FaultSet()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}  # live sequences by request id
        self.step_counter = 0
        self.num_preemptions_total = 0
        self.num_resumptions_total = 0  # preempted sequences scheduled again (recompute)

    # ---- queue management ----------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new request's first sequence."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use by a live request")
        self.requests[seq.request_id] = [seq]
        self.waiting.append(seq)

    def add_forked(self, child: Sequence) -> None:
        """Add a sequence forked from a running one (it already shares the parent's blocks)."""
        self.requests[child.request_id].append(child)
        self.running.append(child)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_counter += 1
        self.block_manager.current_step = self.step_counter
        out = SchedulerOutput(step=self.step_counter)
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' logits
                i += 1
                continue
            site = AllocationSite.PREFILL if seq.in_prefill else AllocationSite.DECODE_APPEND
            while not self.block_manager.allocate_slots(seq, num_new, site):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                item = ScheduledSequence(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens)
                (prefills if seq.in_prefill else decodes).append(item)
                budget -= num_new
                i += 1

        # New work joins only when nothing had to be preempted this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hits = self.block_manager.find_prefix_hits(seq)
            num_cached = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new, AllocationSite.PREFILL, hits):
                break
            if seq.num_computed_tokens == 0:
                self.block_manager.prefix_cache_queries += seq.num_tokens
                self.block_manager.prefix_cache_hits += num_cached
            seq.num_computed_tokens += num_cached
            self.waiting.popleft()
            if seq.status is SequenceStatus.PREEMPTED:
                self.num_resumptions_total += 1
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            prefills.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens))
            budget -= num_new

        if not decodes and not prefills and self.running and self.waiting:
            # Every running sequence is a beam waiting for a sibling that cannot get blocks:
            # preempt them all, so the front of the waiting queue can run (no deadlock).
            for seq in reversed(self.running):
                self._preempt(seq)
                out.preempted.append(seq)
            self.running.clear()
            # Siblings next to each other, so a whole group is admitted together.
            order = {rid: i for i, rid in enumerate(dict.fromkeys(s.request_id for s in self.waiting))}
            self.waiting = deque(sorted(self.waiting, key=lambda s: order[s.request_id]))
        out.scheduled = decodes + prefills
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front of the waiting queue."""
        if self.faults.active("leak-on-preempt"):
            self.block_manager.block_tables.pop(seq.seq_id, None)  # planted: blocks forgotten, not freed
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    # ---- the one exit path ---------------------------------------------------------------
    def finish_sequence(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
                        error: str | None = None) -> None:
        """End ``seq`` for any reason and release its blocks (the one free path).

        Raises:
            PlantedFault: only with the planted ``skip-free-on-abort`` fault.
        """
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error = error
        seq.finished_time = time.time()
        if reason is FinishReason.ABORT and self.faults.active("skip-free-on-abort"):
            raise PlantedFault(f"planted fault skip-free-on-abort: abort of {seq.request_id!r} "
                               "raised before its blocks were released")
        self.block_manager.free(seq)
        live = self.requests[seq.request_id]
        live.remove(seq)
        if not live:
            del self.requests[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every live sequence of a request, in any state (waiting, mid-prefill,
        running, preempted). Returns the aborted sequences (empty if none was live).

        Raises:
            the first exception a sequence's finish raised (e.g. a planted fault), after every
            sequence of the request has been taken out of the queues.
        """
        seqs = list(self.requests.get(request_id, ()))
        errors = []
        for seq in seqs:  # every sequence, even when one's release raises (n > 1, beams)
            try:
                self.finish_sequence(seq, FinishReason.ABORT)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the siblings
                errors.append(exc)
        if errors:
            raise errors[0]
        return seqs
