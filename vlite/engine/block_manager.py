"""KV-cache block manager: physical blocks, free block queue, block tables and the ledger.

Follows vLLM's paged KV cache (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023): the cache is cut into fixed-size physical
blocks of ``block_size`` tokens; each sequence owns a block table mapping its logical blocks
to physical ones; a block returns to the free block queue when its ref_count reaches 0.

Every allocation is written to the ``BlockLedger`` (owner, site, step, time) and every free
clears it, so a block still held when the engine is idle can be named by its owner.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from dataclasses import dataclass

from vlite.engine.faults import FaultSet
from vlite.engine.sequence import Sequence


class AllocationSite(str, enum.Enum):
    """The code path that allocated a block (recorded in the ledger)."""

    PREFILL = "prefill"
    DECODE_APPEND = "decode append"
    FORK = "fork"
    COPY_ON_WRITE = "copy-on-write"


class PhysicalBlock:
    """One physical KV block: ``block_size`` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0


class FreeBlockQueue:
    """Free physical blocks in least-recently-freed-first order; O(1) popleft, append, remove."""

    def __init__(self, block_ids: range) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def popleft(self) -> int:
        return self._queue.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def __len__(self) -> int:
        return len(self._queue)


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


@dataclass(frozen=True)
class LedgerAnomaly:
    """A free the block manager could not account for (e.g. ref_count went below 0)."""

    kind: str
    block_id: int
    seq_id: int
    request_id: str
    step: int
    time: float


class BlockLedger:
    """Allocation ledger: (seq_id, block_id) -> LedgerEntry for every block reference held."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: dict[tuple[int, int], LedgerEntry] = {}
        self._anomalies: list[LedgerAnomaly] = []

    def record(self, entry: LedgerEntry) -> None:
        if self.enabled:
            self._held[(entry.seq_id, entry.block_id)] = entry

    def clear(self, seq_id: int, block_id: int) -> None:
        if self.enabled:
            self._held.pop((seq_id, block_id), None)

    def record_anomaly(self, anomaly: LedgerAnomaly) -> None:
        self._anomalies.append(anomaly)

    def held(self) -> list[LedgerEntry]:
        """A copy of every entry still held, oldest first."""
        return sorted(self._held.values(), key=lambda e: (e.step, e.time, e.block_id))

    def anomalies(self) -> list[LedgerAnomaly]:
        return list(self._anomalies)

    def __len__(self) -> int:
        return len(self._held)


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of the block manager's counters (blocks, and the usage fraction 0..1)."""

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    num_block_tables: int
    num_ledger_entries: int


class BlockManager:
    """Owns the KV cache's physical blocks.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block.
        enable_ledger: record every allocation (on by default; off only to measure its cost).
        faults: planted faults for the leak checker's self-test.

    Block tables map ``seq_id`` to the list of physical block ids for logical blocks 0, 1, ...
    A token at position p of a sequence lives in slot ``table[p // block_size] * block_size
    + p % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_ledger: bool = True,
                 faults: FaultSet | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [PhysicalBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.ledger = BlockLedger(enable_ledger)
        self.faults = faults or FaultSet()
        self.current_step = 0

    # ---- queries -------------------------------------------------------------------------
    def num_required_blocks(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of blocks held by live sequences (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_total_blocks

    def stats(self) -> BlockStats:
        return BlockStats(
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_blocks=0,
            kv_cache_usage=self.kv_cache_usage,
            num_block_tables=len(self.block_tables),
            num_ledger_entries=len(self.ledger),
        )

    def get_block_table(self, seq_id: int) -> list[int]:
        """The block table of a sequence (empty if it holds none). Do not mutate."""
        return self.block_tables.get(seq_id, [])

    def ref_counts(self) -> list[int]:
        """ref_count of every physical block, indexed by block id (a copy)."""
        return [b.ref_count for b in self.blocks]

    def num_blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` still needs for its next ``num_new_tokens`` tokens."""
        needed = self.num_required_blocks(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(self.block_tables.get(seq.seq_id, ())))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the next ``num_new_tokens`` of ``seq`` fit in the free blocks."""
        return self.num_blocks_to_grow(seq, num_new_tokens) <= self.num_free_blocks

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, site: AllocationSite) -> bool:
        """Grow ``seq``'s block table to cover ``num_new_tokens`` more tokens.

        All or nothing: returns False, allocating nothing, when the free blocks do not suffice.
        """
        num_new_blocks = self.num_blocks_to_grow(seq, num_new_tokens)
        if num_new_blocks > self.num_free_blocks:
            return False
        table = self.block_tables.setdefault(seq.seq_id, [])
        now = time.time()
        for _ in range(num_new_blocks):
            block = self.blocks[self.free_block_queue.popleft()]
            block.ref_count = 1
            table.append(block.block_id)
            self.ledger.record(LedgerEntry(block.block_id, seq.seq_id, seq.request_id, site,
                                           self.current_step, now))
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Allocate blocks for a prefill chunk of ``num_new_tokens`` tokens (site: prefill)."""
        return self.allocate_slots(seq, num_new_tokens, AllocationSite.PREFILL)

    def append_slot(self, seq: Sequence) -> bool:
        """Make room for one decode token (site: decode append); False if no block is free."""
        return self.allocate_slots(seq, 1, AllocationSite.DECODE_APPEND)

    def free(self, seq: Sequence) -> int:
        """Release every block of ``seq``: the one free path for every way a sequence ends.

        Safe to call twice (the second call finds no table and frees nothing). Returns the
        number of block references dropped.
        """
        if self.faults.active("orphan-block-table"):
            table = self.block_tables.get(seq.seq_id, [])
            if not table:
                return 0
            table = list(table)  # blocks released, the table entry left behind
        else:
            table = self.block_tables.pop(seq.seq_id, None)
            if not table:
                return 0
        for block_id in reversed(table):
            self._release(block_id, seq)
        if self.faults.active("double-free"):
            self._release(table[-1], seq)
        return len(table)

    def _release(self, block_id: int, seq: Sequence) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        self.ledger.clear(seq.seq_id, block_id)
        if block.ref_count == 0:
            self.free_block_queue.append(block_id)
        elif block.ref_count < 0:
            self.ledger.record_anomaly(LedgerAnomaly("double free", block_id, seq.seq_id, seq.request_id,
                                                     self.current_step, time.time()))
