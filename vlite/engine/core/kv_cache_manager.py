"""KVCacheManager: each sequence's block table over the ``BlockPool`` (vLLM V1's ``KVCacheManager``).

Follows vLLM's paged KV cache (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023): the cache is cut into fixed-size physical
blocks of ``block_size`` tokens (``block_pool``); each sequence owns a block table mapping its
logical blocks to physical ones.

Every allocation is written to the ``BlockLedger`` (``ledger``: owner, site, step, time) and
every free clears it, so a block still held when the engine is idle can be named by its owner.

Sharing (ref_count > 1) comes from three places: prefix caching (a full block whose tokens and
prefix match is reused; the key is a hash chained over the parent block's hash and the block's
token ids, as in vLLM's automatic prefix caching, with token equality confirmed on a hit),
fork (parallel sampling n > 1 and beam search: a child shares all its parent's blocks), and
copy-on-write (the first write into a shared partial block copies it first).
"""

from __future__ import annotations

import time
from collections import Counter

from vlite.engine.core.block_pool import BlockPool, FreeBlockQueue
from vlite.engine.core.ledger import (
    DOUBLE_FREE,
    AllocationSite,
    BlockLedger,
    FreeRecord,
    LedgerAnomaly,
    LedgerEntry,
    ReleaseRecord,
    code_path,
)
from vlite.engine.core.sequence import Sequence
from vlite.engine.metrics import BlockStats


class KVCacheManager:
    """Owns the block tables over a ``BlockPool``: allocation, prefix hits, fork, copy-on-write, free.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block.
        enable_ledger: record every allocation (on by default; off only to measure its cost).
        enable_prefix_caching: keep freed full blocks as evictable cache entries and reuse them.

    Block tables map ``seq_id`` to the list of physical block ids for logical blocks 0, 1, ...
    A token at position p of a sequence lives in slot ``table[p // block_size] * block_size
    + p % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_ledger: bool = True,
                 enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.blocks = self.block_pool.blocks  # read by the copy-on-write test and EngineView
        self.block_tables: dict[int, list[int]] = {}
        self.ledger = BlockLedger(enable_ledger)
        self.current_step = 0
        self.enable_prefix_caching = enable_prefix_caching
        self._num_hashed: dict[int, int] = {}  # seq_id -> leading full blocks already registered
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the runner
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Coverage counters (read through vlite.engine.introspection.EngineView): block
        # references allocated by site, fork calls, copy-on-write copies.
        self.allocations_by_site: Counter[str] = Counter()
        self.num_forks = 0
        self.num_copy_on_write = 0

    # ---- queries -------------------------------------------------------------------------
    def num_required_blocks(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def free_block_queue(self) -> FreeBlockQueue:
        return self.block_pool.free_block_queue

    @property
    def cached_blocks(self) -> dict[int, int]:
        """The prefix-cache hash index (block hash -> block id)."""
        return self.block_pool.cached_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks that hold nothing (cached-evictable ones are counted separately)."""
        return self.block_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached full block (evictable, not leaked)."""
        return self.block_pool.num_evictable

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return self.block_pool.num_allocatable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of blocks held by live sequences (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_total_blocks

    def stats(self) -> BlockStats:
        return BlockStats(
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_blocks=self.num_cached_blocks,
            kv_cache_usage=self.kv_cache_usage,
            num_block_tables=len(self.block_tables),
            num_ledger_entries=len(self.ledger),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def get_block_table(self, seq_id: int) -> list[int]:
        """The block table of a sequence (empty if it holds none). Do not mutate."""
        return self.block_tables.get(seq_id, [])

    def ref_counts(self) -> list[int]:
        """ref_count of every physical block, indexed by block id (a copy)."""
        return self.block_pool.ref_counts()

    def num_blocks_to_grow(self, seq: Sequence, num_new_tokens: int, num_prefix_hits: int = 0) -> int:
        """Blocks ``seq`` still needs for its next ``num_new_tokens`` tokens (after
        ``num_prefix_hits`` cached blocks), counting a copy-on-write of a shared partial block."""
        table = self.block_tables.get(seq.seq_id, ())
        start = seq.num_computed_tokens + num_prefix_hits * self.block_size
        needed = self.num_required_blocks(start + num_new_tokens)
        grow = max(0, needed - len(table) - num_prefix_hits)
        if num_new_tokens and self._needs_copy_on_write(table, start):
            grow += 1
        return grow

    def _needs_copy_on_write(self, table, position: int) -> bool:
        idx = position // self.block_size
        return idx < len(table) and self.blocks[table[idx]].ref_count > 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the next ``num_new_tokens`` of ``seq`` fit in the free and evictable blocks."""
        return self.num_blocks_to_grow(seq, num_new_tokens) <= self.num_allocatable_blocks

    # ---- allocation ----------------------------------------------------------------------
    def find_prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching ``seq``'s leading full blocks (no side effects).

        Stops before the block holding the last token: that token is always computed, so
        its logits exist. Empty unless prefix caching is on and ``seq`` holds no blocks.
        """
        if not self.enable_prefix_caching or seq.seq_id in self.block_tables or seq.num_computed_tokens:
            return []
        hits = []
        tokens = seq.all_token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.block_pool.get_cached_block(self._block_hash(seq, i), chunk)  # confirmed on a hit
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Hash of logical block i: chained over the parent block's hash and its token ids."""
        hashes = seq.block_hashes
        tokens = seq.all_token_ids
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[j - 1] if j else None
            hashes.append(hash((parent, tuple(tokens[j * self.block_size:(j + 1) * self.block_size]))))
        return hashes[i]

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, site: AllocationSite,
                       prefix_hits: list[int] | None = None) -> bool:
        """Grow ``seq``'s block table to cover ``num_new_tokens`` more tokens.

        ``prefix_hits`` (from ``find_prefix_hits``) are taken first; the caller then counts
        them as computed. A shared block about to be written is copied first (copy-on-write;
        the (src, dst) pair is queued in ``pending_copies`` for the model runner).
        All or nothing: returns False, changing nothing, when the blocks do not suffice.
        """
        if num_new_tokens == 1 and not prefix_hits:
            # most decode steps: the token's slot is in a block the sequence holds alone, nothing to do
            table = self.block_tables.get(seq.seq_id)
            idx = seq.num_computed_tokens // self.block_size
            if table is not None and idx < len(table) and self.blocks[table[idx]].ref_count == 1:
                return True
        hits = prefix_hits or []
        num_new_blocks = self.num_blocks_to_grow(seq, num_new_tokens, len(hits))
        hits_from_queue = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if num_new_blocks + hits_from_queue > self.num_allocatable_blocks:
            return False
        table = self.block_tables.setdefault(seq.seq_id, [])
        now = time.time()
        for block_id in hits:
            self.block_pool.touch(block_id)
            table.append(block_id)
            self._record(block_id, seq, AllocationSite.PREFIX_HIT, now)
        if hits:
            self._num_hashed[seq.seq_id] = len(hits)
        start = seq.num_computed_tokens + len(hits) * self.block_size
        if num_new_tokens and self._needs_copy_on_write(table, start):
            idx = start // self.block_size
            src = table[idx]
            dst = self.block_pool.pop_free_block()
            self.pending_copies.append((src, dst))
            table[idx] = dst
            self._release(src, seq, "copy-on-write")
            self._record(dst, seq, AllocationSite.COPY_ON_WRITE, now)
            self.num_copy_on_write += 1
            num_new_blocks -= 1
        for _ in range(num_new_blocks):
            block_id = self.block_pool.pop_free_block()
            table.append(block_id)
            self._record(block_id, seq, site, now)
        return True

    def _record(self, block_id: int, seq: Sequence, site: AllocationSite, now: float) -> None:
        self.allocations_by_site[site.value] += 1
        self.ledger.record(LedgerEntry(block_id, seq.seq_id, seq.request_id, site, self.current_step, now))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        done = self._num_hashed.get(seq.seq_id, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        if full <= done:  # most steps: no block became full
            return
        tokens = seq.all_token_ids
        for i in range(done, full):
            if self.blocks[table[i]].block_hash is None:  # identical content elsewhere: the pool keeps the first copy
                self.block_pool.cache_block(table[i], self._block_hash(seq, i),
                                            tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
        self._num_hashed[seq.seq_id] = max(done, full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks by reference (site: fork). The first write into
        a shared partial block is a copy-on-write."""
        table = list(self.block_tables.get(parent.seq_id, ()))
        self.block_tables[child.seq_id] = table
        self._num_hashed[child.seq_id] = self._num_hashed.get(parent.seq_id, 0)
        self.num_forks += 1
        now = time.time()
        for block_id in table:
            self.blocks[block_id].ref_count += 1
            self._record(block_id, child, AllocationSite.FORK, now)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs to apply before the next forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Allocate blocks for a prefill chunk of ``num_new_tokens`` tokens (site: prefill)."""
        return self.allocate_slots(seq, num_new_tokens, AllocationSite.PREFILL)

    def append_slot(self, seq: Sequence) -> bool:
        """Make room for one decode token (site: decode append); False if no block is free."""
        return self.allocate_slots(seq, 1, AllocationSite.DECODE_APPEND)

    def free(self, seq: Sequence) -> int:
        """Release every block of ``seq``: the one free path for every way a sequence ends.

        Blocks are released tail first, so that with prefix caching the blocks furthest
        from a prompt's start are evicted first. Safe to call twice (the second call finds
        no table and frees nothing). Returns the number of block references dropped.
        """
        self._num_hashed.pop(seq.seq_id, None)
        if self.ledger.enabled:
            self.ledger.frees.append(FreeRecord(seq.seq_id, seq.request_id, len(self.block_tables.get(seq.seq_id, ())),
                                                code_path(2), seq.status.value,
                                                seq.finish_reason.value if seq.finish_reason else None,
                                                self.current_step))
        table = self.block_tables.pop(seq.seq_id, None)
        if not table:
            return 0
        for block_id in reversed(table):
            self._release(block_id, seq)
        return len(table)

    def _release(self, block_id: int, seq: Sequence, path: str = "free") -> None:
        ref_count = self.block_pool.release(block_id)
        entry = self.ledger.clear(seq.seq_id, block_id)
        if self.ledger.enabled:
            self.ledger.record_release(ReleaseRecord(
                block_id, seq.seq_id, seq.request_id, entry, path, seq.status.value,
                seq.finish_reason.value if seq.finish_reason else None, seq.num_preemptions, ref_count,
                self.current_step, time.time(), code_path(2)))
        if ref_count < 0:
            sites = tuple(r.describe() for r in self.ledger.released if r.block_id == block_id)[-2:]
            self.ledger.record_anomaly(LedgerAnomaly(DOUBLE_FREE, block_id, seq.seq_id, seq.request_id,
                                                     self.current_step, time.time(), sites))
