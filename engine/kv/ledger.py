"""The KV manager's state and the only way to change it: primitives that log their inverse.

`KVLedger` holds what the core and its components share: the device `BlockPool`, the host
`HostPool`, every request's `BlockTable`, the `KVCopy`s recorded for the next step and the
`UndoLog`. Each primitive below makes one change and pushes its undo, so any sequence of
them, by the core or by a component, can be rolled back to a mark. Outside a transaction the
log is off and a primitive only pays for one `active` check (FCFS's allocations stay as cheap
as plain list appends).

Components receive the ledger when they are attached and must not change tables, pools or
copies any other way; their own state they log themselves (`undo.push`).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv.block_pool import Block, BlockPool
from engine.kv.block_table import BlockTable, HostEntry
from engine.kv.copies import CopyKind, KVCopy
from engine.kv.host_pool import HostPool
from engine.kv.undo import UndoLog


class KVLedger:
    def __init__(self, pool: BlockPool, block_size: int, bytes_per_token: int, host: HostPool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token  # prices copies (`KVCopy.nbytes`)
        self.host = host
        self.tables: dict[str, BlockTable] = {}
        self.copies: list[KVCopy] = []  # recorded since the last `take_copies`, causal order
        self.swap_bytes = 0  # bytes of `copies` that cross host <-> device
        self.undo = UndoLog()

    # -- tables ---------------------------------------------------------------------------

    def add_table(self, rid: str, table: BlockTable) -> None:
        self.tables[rid] = table
        if self.undo.active:
            self.undo.push(lambda: self.tables.pop(rid))

    def drop_table(self, rid: str) -> None:
        table = self.tables.pop(rid)
        if self.undo.active:
            self.undo.push(lambda: self.tables.__setitem__(rid, table))

    def append_entries(self, table: BlockTable, blocks: Sequence[Block]) -> None:
        """Append forward entries for `blocks`."""
        table.extend(blocks)
        if self.undo.active:
            n = len(blocks)
            self.undo.push(lambda: _truncate(table, len(table) - n))

    def append_entry(self, table: BlockTable, block: Block, rev: bool) -> None:
        table.blocks.append(block)
        table.ids.append(block.block_id)
        table.rev.append(rev)
        if self.undo.active:

            def undo() -> None:
                table.blocks.pop(), table.ids.pop(), table.rev.pop()

            self.undo.push(undo)

    def pop_entry(self, table: BlockTable) -> None:
        """Remove the last entry, which must hold neither a device block nor a host block."""
        e = len(table) - 1
        assert table.blocks[e] is None and e not in table.host, (table, e)
        rev = table.rev.pop()
        table.blocks.pop()
        table.ids.pop()

        def undo() -> None:
            table.blocks.append(None), table.ids.append(0), table.rev.append(rev)

        self.undo.push(undo)

    def set_entry(self, table: BlockTable, e: int, block: Block | None, rev: bool | None = None) -> None:
        """Point entry e at `block` (None: no device block); `rev` None keeps its direction."""
        old, old_rev = table.blocks[e], table.rev[e]
        table.blocks[e] = block
        table.ids[e] = 0 if block is None else block.block_id
        if rev is not None:
            table.rev[e] = rev
        if self.undo.active:

            def undo() -> None:
                table.blocks[e] = old
                table.ids[e] = 0 if old is None else old.block_id
                table.rev[e] = old_rev

            self.undo.push(undo)

    def append_empty_entries(self, table: BlockTable, n: int) -> None:
        """Append n entries without a device block of their own (id 0, forward)."""
        table.blocks.extend([None] * n)
        table.ids.extend([0] * n)
        table.rev.extend([False] * n)
        if self.undo.active:
            self.undo.push(lambda: _truncate(table, len(table) - n))

    def hold(self, table: BlockTable, blocks: Sequence[Block]) -> None:
        """The table's owner holds `blocks` (taken from the pool) for the table as a whole."""
        table.held.extend(blocks)
        if self.undo.active:
            n = len(blocks)
            self.undo.push(lambda: table.held.__delitem__(slice(len(table.held) - n, None)))

    def release_held(self, table: BlockTable) -> None:
        """Give every block the table holds as a whole back to the pool."""
        held = list(table.held)
        ranks = [b.free_rank for b in held]
        self.pool.release(reversed(held))
        table.held.clear()
        if self.undo.active:

            def undo() -> None:
                self.pool.acquire(held)
                for b, rank in zip(held, ranks):  # an undone `acquire` before it puts them back there
                    b.free_rank = rank
                table.held.extend(held)

            self.undo.push(undo)

    def set_claimed(self, table: BlockTable, claimed: int) -> None:
        old = table.claimed
        table.claimed = claimed
        if self.undo.active:
            self.undo.push(lambda: setattr(table, "claimed", old))

    def set_transient(self, table: BlockTable, tokens: int) -> None:
        """The next step rebuilds the table's first `tokens` tokens' K/V (partial residency)."""
        old = table.transient
        table.transient = tokens
        if self.undo.active:
            self.undo.push(lambda: setattr(table, "transient", old))

    # -- device blocks ----------------------------------------------------------------------

    def take_free(self, n: int) -> list[Block]:
        """n blocks from the pool's free list (the caller checked `pool.num_free`)."""
        if not self.undo.active:
            return self.pool.allocate(n)
        taken = [(b, b.free_rank, b.block_hash) for b in self.pool.next_allocated(n)]
        blocks = self.pool.allocate(n)
        self.undo.push(lambda: [self.pool.unallocate(*t) for t in reversed(taken)])
        return blocks

    def take_free_block(self) -> Block:
        """One block from the pool's free list (the caller checked `pool.num_free`)."""
        return self.take_free(1)[0]

    def acquire(self, blocks: Sequence[Block]) -> None:
        """Another reference on each block (prefix hits, stolen block ends)."""
        self.pool.acquire(blocks)
        if self.undo.active:
            self.undo.push(lambda: self.pool.unacquire(reversed(blocks)))

    def release(self, block: Block) -> None:
        rank = block.free_rank  # where an undone `acquire` before this puts it back in the LRU order
        self.pool.release([block])
        if self.undo.active:

            def undo() -> None:
                self.pool.acquire([block])
                block.free_rank = rank

            self.undo.push(undo)

    # -- host blocks ------------------------------------------------------------------------

    def take_host(self) -> int | None:
        """A free host block, or None when host space is full."""
        host_block = self.host.allocate()
        if host_block is not None and self.undo.active:
            self.undo.push(lambda: self.host.release(host_block))
        return host_block

    def set_host(self, table: BlockTable, e: int, host_block: int, resident: int) -> HostEntry:
        """Entry e has KV in `host_block`; its offsets [0, resident) are still on device."""
        old = table.host.get(e)
        he = table.host[e] = HostEntry(host_block, resident)
        if self.undo.active:
            self.undo.push(lambda: table.host.__setitem__(e, old) if old is not None else table.host.pop(e))
        return he

    def release_host(self, table: BlockTable, e: int) -> None:
        """Entry e no longer has KV on host; its host block returns to the free list."""
        he = table.host.pop(e)
        self.host.release(he.host_block)

        def undo() -> None:
            self.host.unrelease(he.host_block)
            table.host[e] = he

        self.undo.push(undo)

    def push_host_prefix(self, table: BlockTable, host_block: int) -> None:
        """Entry `len(table.host_prefix)` of the non-resident prefix is kept in `host_block`."""
        table.host_prefix.append(host_block)
        if self.undo.active:
            self.undo.push(table.host_prefix.pop)

    def pop_host_prefix(self, table: BlockTable) -> int:
        """The last host-kept prefix entry leaves host; its host block returns to the free list."""
        host_block = table.host_prefix.pop()
        self.host.release(host_block)

        def undo() -> None:
            self.host.unrelease(host_block)
            table.host_prefix.append(host_block)

        self.undo.push(undo)
        return host_block

    # -- copies -------------------------------------------------------------------------------

    def emit(self, kind: CopyKind, src: list[int], dst: list[int], reason: str, rid: str) -> None:
        """Record a copy of flat slots for the engine to run before the next forward pass."""
        if not src:
            return
        copy = KVCopy(kind, tuple(src), tuple(dst), len(src) * self.bytes_per_token, reason, rid)
        self.copies.append(copy)
        crossing = copy.nbytes if copy.crosses_host else 0
        self.swap_bytes += crossing

        def undo() -> None:
            self.copies.pop()
            self.swap_bytes -= crossing

        self.undo.push(undo)

    def take_copies(self) -> list[KVCopy]:
        copies, self.copies = self.copies, []
        self.swap_bytes = 0
        return copies


def _truncate(table: BlockTable, n: int) -> None:
    del table.blocks[n:], table.ids[n:], table.rev[n:]
