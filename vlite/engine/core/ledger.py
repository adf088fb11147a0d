"""The allocation ledger: who holds every KV block reference, and a bounded history of releases.

Every allocation is written to the ``BlockLedger`` (owner, site, step, time) and every free
clears it, so a block still held when the engine is idle can be named by its owner (the leak
checker's attribution).
"""

from __future__ import annotations

import enum
import sys
from collections import deque
from dataclasses import dataclass


class AllocationSite(str, enum.Enum):
    """The code path that allocated a block (recorded in the ledger)."""

    PREFILL = "prefill"
    DECODE_APPEND = "decode append"
    PREFIX_HIT = "prefix cache hit"
    FORK = "fork"
    COPY_ON_WRITE = "copy-on-write"


@dataclass(frozen=True)
class LedgerEntry:
    """One held (sequence, block) pair: who allocated it, where, when.

    step: the engine step number at allocation; time: ``time.time()`` seconds.
    """

    block_id: int
    seq_id: int
    request_id: str
    site: AllocationSite
    step: int
    time: float


# The kinds of ``LedgerAnomaly``.
DOUBLE_FREE = "double free"
SECOND_REFERENCE = "second reference by the same holder"


@dataclass(frozen=True)
class LedgerAnomaly:
    """A block reference the block manager could not account for: a free that took ref_count
    below 0 (``DOUBLE_FREE``), or a sequence taking a second reference on a block it already
    holds (``SECOND_REFERENCE``: its table would hold the block twice, and the ledger, keyed by
    (sequence, block), would have overwritten the first record).

    ``release_sites``: for a double free, the releases of this block that the history holds,
    the earlier one first ("Scheduler.finish_sequence -> KVCacheManager.free: seq 12 (req-3),
    finished/stop, step 40"), so the report names both code paths. ``allocation_sites``: for a
    second reference, both allocations, the first one first ("prefill, step 3", "prefix cache
    hit, step 9: Scheduler._schedule_prefill -> KVCacheManager.allocate_slots")."""

    kind: str
    block_id: int
    seq_id: int
    request_id: str
    step: int
    time: float
    release_sites: tuple[str, ...] = ()
    allocation_sites: tuple[str, ...] = ()


@dataclass(slots=True)  # not frozen: built on every release, and a frozen __init__ costs twice as much
class ReleaseRecord:
    """One released block reference, kept in the ledger's bounded release history.

    ``entry`` is the ledger entry that was cleared (None when the reference had none: a
    release the ledger cannot name). ``path`` is the code path that released it ("free" or
    "copy-on-write"); ``seq_status`` and ``finish_reason`` are the releasing sequence's state
    at that moment (a running sequence released by "free" is being preempted);
    ``ref_count_after`` is the block's ref_count after the release. step: engine step;
    time: ``time.time()`` seconds.
    """

    block_id: int
    seq_id: int
    request_id: str
    entry: LedgerEntry | None
    path: str
    seq_status: str
    finish_reason: str | None
    num_preemptions: int
    ref_count_after: int
    step: int
    time: float
    code_path: str = ""  # the two frames that released it, e.g. "Scheduler.finish_sequence -> KVCacheManager.free"

    def describe(self) -> str:
        """One line naming the release: code path, sequence, its state, step."""
        state = self.seq_status + (f"/{self.finish_reason}" if self.finish_reason else "")
        return f"{self.code_path or self.path}: seq {self.seq_id} ({self.request_id}), {state}, step {self.step}"


@dataclass(frozen=True)
class FreeRecord:
    """One call of ``KVCacheManager.free`` (the one free path): which sequence, how many block
    references it dropped, who called it (``code_path``), the sequence's state then, and when
    (engine step). Kept in the ledger's bounded ``frees`` history so a leak report can say
    "no release recorded" from evidence rather than guess."""

    seq_id: int
    request_id: str
    num_released: int
    code_path: str
    seq_status: str
    finish_reason: str | None
    step: int


# A planted fault's subclass (``FaultyScheduler``, ``vlite.engine.core.fault_seams``) stands in
# for the engine class it extends: the path names the engine's method, as without the fault.
_STAND_IN_PREFIX = "Faulty"


def code_path(depth: int) -> str:
    """``"Caller.method -> Callee.method"`` for the two frames ``depth`` levels up (cheap: no
    traceback objects; only taken while the ledger is on). A method that extends the one it
    overrides (``super()``) counts as one frame with it."""
    names: list[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(names) <= depth:
        name = frame.f_code.co_qualname.removeprefix(_STAND_IN_PREFIX)
        if not names or names[-1] != name:
            names.append(name)
        frame = frame.f_back
    if len(names) <= depth:
        return names[-1]
    return f"{names[depth]} -> {names[depth - 1]}"


# Released ledger entries kept for attribution of blocks the ledger no longer names (a bounded,
# documented history: it is not a leak that it is full at idle).
RELEASE_HISTORY = 4096


class BlockLedger:
    """Allocation ledger: (seq_id, block_id) -> LedgerEntry for every block reference held,
    plus a bounded history (``RELEASE_HISTORY`` entries) of released references."""

    def __init__(self, enabled: bool = True, release_history: int = RELEASE_HISTORY) -> None:
        self.enabled = enabled
        self._held: dict[tuple[int, int], LedgerEntry] = {}
        self._anomalies: list[LedgerAnomaly] = []
        self.released: deque[ReleaseRecord] = deque(maxlen=release_history)
        self.frees: deque[FreeRecord] = deque(maxlen=release_history)  # calls of the free path

    def record(self, entry: LedgerEntry) -> None:
        """Record a reference taken. A second reference by the same sequence on a block it
        already holds is a ``SECOND_REFERENCE`` anomaly naming both allocations; the first
        record is kept (the reference the sequence's table took first)."""
        if not self.enabled:
            return
        key = (entry.seq_id, entry.block_id)
        first = self._held.get(key)
        if first is None:
            self._held[key] = entry
            return
        # code_path(3): the allocation path above KVCacheManager._record (rare: taken only here)
        sites = (f"{first.site.value}, step {first.step}",
                 f"{entry.site.value}, step {entry.step}: {code_path(3)}")
        self._anomalies.append(LedgerAnomaly(SECOND_REFERENCE, entry.block_id, entry.seq_id, entry.request_id,
                                             entry.step, entry.time, allocation_sites=sites))

    def clear(self, seq_id: int, block_id: int) -> LedgerEntry | None:
        """Drop the entry of a released reference; returns it (None if there was none)."""
        if self.enabled:
            return self._held.pop((seq_id, block_id), None)
        return None

    def record_release(self, record: ReleaseRecord) -> None:
        if self.enabled:
            self.released.append(record)

    def site_of(self, seq_id: int, block_id: int) -> AllocationSite | None:
        entry = self._held.get((seq_id, block_id))
        return entry.site if entry else None

    def record_anomaly(self, anomaly: LedgerAnomaly) -> None:
        self._anomalies.append(anomaly)

    def held(self) -> list[LedgerEntry]:
        """A copy of every entry still held, oldest first."""
        return sorted(self._held.values(), key=lambda e: (e.step, e.time, e.block_id))

    def anomalies(self) -> list[LedgerAnomaly]:
        return list(self._anomalies)

    def __len__(self) -> int:
        return len(self._held)
