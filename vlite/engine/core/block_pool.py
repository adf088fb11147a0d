"""BlockPool: the KV cache's physical blocks, the free block queue and the prefix-cache hash index
(vLLM V1's ``BlockPool``).

A block returns to the free block queue when its ref_count reaches 0. A freed block that holds
a cached full block (prefix caching) stays in the queue as *evictable* until its slot is needed;
it is counted in ``num_cached_blocks``, not in ``num_free_blocks`` nor in usage. The pool knows
blocks only; which sequence holds which block is the ``KVCacheManager``'s.
"""

from __future__ import annotations

from collections import OrderedDict


class PhysicalBlock:
    """One physical KV block: ``block_size`` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set while the block holds a cached full block (prefix caching).
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


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


class BlockPool:
    """The ``num_blocks`` physical blocks: their ref counts, the free block queue (least recently
    freed first) and ``cached_blocks`` (block hash -> block id) for prefix caching."""

    def __init__(self, num_blocks: int) -> None:
        self.num_total_blocks = num_blocks
        self.blocks = [PhysicalBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.num_evictable = 0  # blocks in the free queue that hold a cached block

    @property
    def num_free_blocks(self) -> int:
        """Free blocks that hold nothing (cached-evictable ones are counted separately)."""
        return len(self.free_block_queue) - self.num_evictable

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self.free_block_queue)

    def ref_counts(self) -> list[int]:
        """ref_count of every physical block, indexed by block id (a copy)."""
        return [b.ref_count for b in self.blocks]

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block with ``block_hash`` whose tokens are ``token_ids`` (confirmed on a hit), or None."""
        block_id = self.cached_blocks.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference to a cached block, out of the free queue if it was evictable."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_queue.remove(block_id)
            self.num_evictable -= 1
        block.ref_count += 1

    def pop_free_block(self) -> int:
        """Take the least recently freed block, evicting its cached content if it has any."""
        block = self.blocks[self.free_block_queue.popleft()]
        if block.block_hash is not None:
            self.num_evictable -= 1
            if self.cached_blocks.get(block.block_hash) == block.block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block.block_id

    def cache_block(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Index a full block under ``block_hash`` (the first block with that content is kept)."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            block.token_ids = token_ids
            self.cached_blocks[block_hash] = block_id

    def release(self, block_id: int) -> int:
        """Drop one reference; at 0 the block goes back to the free queue (evictable if cached).
        Returns the ref_count after (below 0: a double free)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_queue.append(block_id)
            if block.block_hash is not None:
                self.num_evictable += 1
        return block.ref_count
