"""Per-request block tables on top of the block pool, with prefix-cache matching.

The manager owns the mapping request -> blocks. Policies call `match_prefix` and
`allocate` (which either succeeds completely or changes nothing), the engine calls
`commit` after each step to publish newly filled blocks to the prefix cache, and `free`
when a request finishes, aborts or is preempted.

Two-ended (BROS) operations live in `bidirectional.py` and are mixed in here, so every
manager can serve every policy; see docs/engine.md ("KV layout") for the slot mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.bidirectional import BidirectionalMixin
from engine.kv.block_pool import Block, BlockPool
from engine.kv.copies import KVCopy
from engine.kv.host_pool import HostPool
from engine.kv.prefix_hash import hash_block, salt_root
from engine.kv.shares import Share, StealIndex
from engine.kv.undo import UndoLog

if TYPE_CHECKING:
    from engine.scheduling.request import Request


@dataclass
class HostEntry:
    """A logical block with KV on host: offsets [0, resident) are still on device, the rest
    (up to the entry's length) sit in `host_block` at their logical offsets."""

    host_block: int
    resident: int


@dataclass
class BlockTable:
    """A request's blocks in logical order (entry i holds tokens [i*bs, (i+1)*bs)).

    `ids` mirrors `blocks` as plain ints because the runner reads it every step (0, the null
    block, for an entry wholly on host); `rev[i]` says entry i fills its block from the right
    end (offset o at slot bs-1-o). `claimed` counts token positions that own a slot:
    computed tokens plus those reserved for the step being scheduled.
    """

    blocks: list[Block | None] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    rev: list[bool] = field(default_factory=list)
    claimed: int = 0
    host: dict[int, HostEntry] = field(default_factory=dict)

    def extend(self, blocks: Sequence[Block]) -> None:
        self.blocks.extend(blocks)
        self.ids.extend(b.block_id for b in blocks)
        self.rev.extend(False for _ in blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def is_resident(self) -> bool:
        return not self.host


class KVCacheManager(BidirectionalMixin):
    def __init__(
        self, pool: BlockPool, block_size: int, *, bytes_per_token: int = 0, host_blocks: int | None = None
    ) -> None:
        """`bytes_per_token` prices KV copies (`KVCopy.nbytes`); `host_blocks` sizes the swap
        space (default: four times the device pool)."""
        self.pool = pool
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.host = HostPool(4 * pool.num_blocks if host_blocks is None else host_blocks)
        self._tables: dict[str, BlockTable] = {}
        self.shares: dict[int, Share] = {}  # block id -> BE end (+ RT end): the preemption table
        self.steal_index = StealIndex(block_size)
        self.pending_copies: list[KVCopy] = []
        self.pending_swap_bytes = 0
        self.undo = UndoLog()
        # Called with the number of blocks short when an allocation would fail; may free some
        # (the session store releases soft pins) and returns whether it did.
        self.reclaim: Callable[[int], bool] | None = None

    def table(self, request: Request) -> BlockTable:
        return self._tables[request.request_id]

    def capacity_tokens(self) -> int:
        return self.pool.capacity * self.block_size

    def match_prefix(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute: the step needs it to produce logits.
        """
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, prefix: Sequence[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens (after `prefix`, when admitting).

        All or nothing: returns False, with no state changed, when blocks are short.
        """
        table = self._tables.get(request.request_id)
        have = len(table) if table else 0
        computed = request.num_computed_tokens + len(prefix) * self.block_size
        need = -(-(computed + num_new_tokens) // self.block_size) - have - len(prefix)
        if need + self.pool.num_evictable(prefix) > self.pool.num_free and not self._reclaimed(need, prefix):
            return False
        if table is None:
            table = self._tables[request.request_id] = BlockTable()
        self.pool.acquire(prefix)
        table.extend(prefix)
        if need > 0:
            table.extend(self.pool.allocate(need))
        table.claimed = computed + num_new_tokens
        return True

    def _reclaimed(self, need: int, prefix: Sequence[Block]) -> bool:
        short = need + self.pool.num_evictable(prefix) - self.pool.num_free
        if self.reclaim is None or not self.reclaim(short):
            return False
        return need + self.pool.num_evictable(prefix) <= self.pool.num_free

    def commit(self, request: Request) -> None:
        """Publish blocks whose tokens are all computed to the prefix cache.

        Only left-filled blocks are published: a reversed (BE) block's slots are not in
        logical order, so serving it to a reader that expects forward order would be wrong.
        """
        if not self.pool.enable_caching:
            return
        full = request.num_computed_tokens // self.block_size
        table = self._tables[request.request_id]
        hashes = self._block_hashes(request, full)
        for i in range(request.num_registered_blocks, full):
            block = table.blocks[i]
            if block is not None and not table.rev[i] and block.block_id not in self.shares:
                self.pool.register(block, hashes[i])
        request.num_registered_blocks = max(request.num_registered_blocks, full)

    def free(self, request: Request) -> None:
        table = self._tables.get(request.request_id)
        if table is not None:
            self._drop_table(request.request_id, table)
        request.num_registered_blocks = 0

    def holds(self, request: Request) -> bool:
        return request.request_id in self._tables

    def take_copies(self) -> list[KVCopy]:
        """The KV copies recorded since the last call (the engine runs them before the step)."""
        copies, self.pending_copies = self.pending_copies, []
        self.pending_swap_bytes = 0
        return copies

    def block_hashes(self, request: Request, n: int) -> list[bytes]:
        """The request's first n full-block hashes (the prefix-cache keys)."""
        return self._block_hashes(request, n)[:n]

    def _block_hashes(self, request: Request, n: int) -> list[bytes]:
        """The request's first n full-block hashes, extending its memo as tokens accrue."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < n:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_root(request.cache_salt)
            hashes.append(hash_block(parent, request.token_ids[i * bs : (i + 1) * bs]))
        return hashes
