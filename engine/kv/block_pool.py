"""A fixed set of KV blocks with LRU reuse of freed blocks and a prefix-hash index.

A freed block keeps its contents and its hash: it stays findable by hash (a prefix-cache hit
revives it) until the allocator needs it for something else. Free blocks are kept in LRU
order, so the longest-unused cached blocks are overwritten first. Block 0 is reserved as the
null block: padding in block tables points at it, so kernels never index out of range.

Policy-specific layouts are KV components (engine/kv/component.py: two-ended blocks for
BROS today; hidden-state blocks and partial residency are designed there, not built yet).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free; callers check `num_free` first."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered for reuse
    free_rank: int = 0  # its place in the free list's LRU order while free (smaller: evicted first)


class BlockPool:
    NULL_BLOCK_ID = 0

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (got {num_blocks}); raise the KV cache budget")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        for b in self.blocks:
            b.free_rank = b.block_id
        self._next_rank = num_blocks  # the next rank at the MRU end
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, including evictable cached blocks)."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the LRU end of the free list, evicting their cached contents."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def next_allocated(self, n: int) -> list[Block]:
        """The blocks `allocate(n)` would take, in order, changing nothing (an undo log reads
        their LRU rank and cached hash before they are taken)."""
        return list(itertools.islice(self._free.values(), n))

    def unallocate(self, block: Block, free_rank: int, block_hash: bytes | None) -> None:
        """Undo of `allocate` for one block, newest first: back to the LRU end of the free list
        (where `allocate` took it) with the rank it had there, unreferenced, and findable again
        by the hash `allocate` evicted. Both are state: a rank of its own would misplace it
        once an undone `acquire` puts a revived block back by rank (the next allocations would
        take other blocks), and a dropped hash would lose a prefix-cache hit to a rollback."""
        block.ref_count = 0
        block.free_rank = free_rank
        self._free[block.block_id] = block
        self._free.move_to_end(block.block_id, last=False)
        if block_hash is not None and block.block_hash is None and block_hash not in self._cached:
            self._cached[block_hash] = block
            block.block_hash = block_hash

    def acquire(self, blocks: Iterable[Block]) -> None:
        """Take another reference on cached blocks (prefix hits), reviving free ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference per block; unreferenced blocks go to the MRU end of the free list.

        Callers pass a request's blocks last-first, so a sequence's tail is evicted before
        its head (heads are the most shareable part).
        """
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                block.free_rank = self._next_rank
                self._next_rank += 1
                self._free[block.block_id] = block

    def unacquire(self, blocks: Iterable[Block]) -> None:
        """Undo of `acquire` (call with the same blocks, last first): drop the reference, and a
        block `acquire` revived goes back to its old place in the LRU order, not the MRU end,
        so a rollback leaves the next allocations exactly as they were. O(free) per revived
        block, paid only by rollbacks."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                for later in [b for b in self._free.values() if b.free_rank > block.free_rank]:
                    self._free.move_to_end(later.block_id)

    def register(self, block: Block, block_hash: bytes) -> None:
        """Make a full block findable by its prefix hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            block.block_hash = block_hash

    def unregister(self, block: Block) -> None:
        """Make a block unfindable by hash (its contents turned out invalid)."""
        self._evict(block)

    def num_evictable(self, blocks: Iterable[Block]) -> int:
        """How many of these (cached) blocks currently sit in the free list."""
        return sum(1 for b in blocks if b.ref_count == 0)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
