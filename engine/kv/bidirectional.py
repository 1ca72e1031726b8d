"""Two-ended KV blocks (BROS §5), mirrored: BE fills blocks from the left, and an RT request
that takes over a BE block's free end fills it from the right. The paper puts RT on the left;
either way the two occupants grow towards each other, and this way round every exclusive
block (nearly all of them) is forward, so attention only pays for reversal in stolen blocks.

Rules (decisions for the paper's gaps are argued in docs/bros.md):
- An RT request takes a free block (forward), or else the right end of the stealable BE block
  with the most empty slots (`StealIndex`; the entry is reversed). Growing into its peer's
  slots checkpoints exactly the BE slots about to be overwritten to host (lazy checkpointing)
  and records them in the share.
- A BE request only takes free blocks; it grows its last block into empty slots and, when the
  RT end is in the way, *relocates* that logical block to a free block (a device-to-device
  copy), so BE never overwrites RT.
- A request runs only when fully resident. `restore` brings back every logical block with
  KV on host into a fresh block (resident part copied device-to-device, the rest
  host-to-device); the old block stays with the RT request that took it.
- `swap_out` moves a whole request to host (last resort under memory pressure).
- Every change goes through the undo log, so a policy can try a candidate and roll back.

The mixin needs `pool`, `block_size`, `bytes_per_token`, `host`, `_tables`, `shares`,
`steal_index`, `pending_copies`, `pending_swap_bytes` and `undo` from `KVCacheManager`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.kv.block_pool import Block
from engine.kv.copies import CopyKind, KVCopy
from engine.kv.shares import Share

if TYPE_CHECKING:
    from engine.kv.kv_cache_manager import BlockTable, HostEntry
    from engine.scheduling.request import Request


class BidirectionalMixin:
    # -- queries ------------------------------------------------------------------------

    def num_host_blocks(self, request: Request) -> int:
        """M^cpu: logical blocks of the request with KV on host (0 when not admitted)."""
        table = self._tables.get(request.request_id)
        return len(table.host) if table else 0

    def host_tokens(self, request: Request) -> int:
        """Tokens a restore would copy host -> device."""
        table = self._tables.get(request.request_id)
        if not table:
            return 0
        return sum(self._entry_len(table, e) - he.resident for e, he in table.host.items())

    def is_resident(self, request: Request) -> bool:
        table = self._tables.get(request.request_id)
        return table is None or not table.host

    def device_blocks(self, request: Request) -> int:
        table = self._tables.get(request.request_id)
        return 0 if table is None else sum(b is not None for b in table.blocks)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Device blocks a restore plus room for `num_tokens` tokens in all would take (a
        lower bound for a request that is not admitted: prefix-cache hits may cover some)."""
        table = self._tables.get(request.request_id)
        if table is None:
            return -(-num_tokens // self.block_size)
        grow = -(-num_tokens // self.block_size) - len(table)
        return (
            max(grow, 0)
            + sum(b is None for b in table.blocks)
            + sum(1 for e in table.host if table.blocks[e] is not None)
        )

    def slot(self, request: Request, position: int) -> int:
        """Physical device slot of a token position (it must be resident)."""
        table = self._tables[request.request_id]
        e, o = divmod(position, self.block_size)
        return table.ids[e] * self.block_size + (self.block_size - 1 - o if table.rev[e] else o)

    # -- operations (all-or-nothing under the caller's undo mark) -------------------------

    def reserve(self, request: Request, num_new_tokens: int, prefix: Sequence[Block] = (), *, be: bool = False) -> bool:
        """Slots for `num_new_tokens` more tokens of a resident request (RT or BE rules).

        Returns False when memory is short; the caller rolls back to its mark."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            table = self._new_table(rid, prefix)
            computed = table.claimed
        elif table.host:
            raise RuntimeError(f"request {rid} must be restored before it runs")
        else:
            computed = request.num_computed_tokens
        target = computed + num_new_tokens
        if target <= table.claimed:
            return True
        if be:
            return self._reserve_be(request.request_id, table, target)
        return self._reserve_rt(request.request_id, table, target)

    def restore(self, request: Request, *, be: bool) -> bool:
        """Bring every logical block with KV on host back into a fresh device block."""
        table = self._tables[request.request_id]
        for e in sorted(table.host):
            if not self._restore_entry(request.request_id, table, e, be):
                return False
        return True

    def swap_out(self, request: Request) -> bool:
        """Move all of the request's device KV to host; False when host space is short."""
        table = self._tables[request.request_id]
        computed = request.num_computed_tokens
        while len(table) > -(-computed // self.block_size):  # reserved, never written: just drop
            self._pop_entry(request.request_id, table)
        self._set_claimed(table, computed)
        for e in range(len(table)):
            if table.blocks[e] is not None and not self._swap_out_entry(request.request_id, table, e):
                return False
        return True

    # -- RT side ------------------------------------------------------------------------

    def _reserve_rt(self, rid: str, table: BlockTable, target: int) -> bool:
        bs = self.block_size
        while len(table) * bs < target:
            taken = self._rt_block(rid, len(table))
            if taken is None:
                return False
            self._append_entry(table, *taken)
        if not self._rt_claim(table, table.claimed, target):
            return False
        self._set_claimed(table, target)
        return True

    def _rt_block(self, rid: str, entry: int) -> tuple[Block, bool] | None:
        """(block, reversed): a free block, else the right end of the stealable BE block with
        the most empty slots."""
        if self.pool.num_free:
            return self._take_free(), False
        share = self.steal_index.best()
        if share is None:
            return None
        block = self.pool.blocks[share.block_id]
        self._acquire(block)
        self._share_set(share, rt_id=rid, rt_entry=entry)
        return block, True

    def _rt_claim(self, table: BlockTable, start: int, end: int) -> bool:
        """Own positions [start, end) of an RT table; checkpoint BE slots in the way."""
        bs = self.block_size
        for e in range(start // bs, -(-end // bs)):
            share = self.shares.get(table.ids[e])
            if share is None:
                continue
            _lo, hi = max(start - e * bs, 0), min(end - e * bs, bs)
            overlap = hi - (bs - share.be_fill)  # the RT end's offsets [bs - be_fill, hi) meet BE data
            if overlap > 0 and not self._checkpoint(share, overlap):
                return False
        return True

    def _checkpoint(self, share: Share, count: int) -> bool:
        """Copy the BE's `count` innermost resident slots of a shared block to host."""
        bs = self.block_size
        be_table = self._tables[share.be_id]
        he = be_table.host.get(share.be_entry)
        if he is None:
            host_block = self._take_host()
            if host_block is None:
                return False
            he = self._set_host(be_table, share.be_entry, host_block, share.be_fill)
        offsets = range(share.be_fill - count, share.be_fill)  # highest offsets sit innermost
        self._emit(
            CopyKind.D2H,
            [share.block_id * bs + o for o in offsets],
            [he.host_block * bs + o for o in offsets],
            "checkpoint",
            share.be_id,
        )
        fill = share.be_fill - count
        self._set_host(be_table, share.be_entry, he.host_block, fill)
        if fill:
            self._share_set(share, be_fill=fill)
        else:  # nothing of the BE request left here: the block is the RT request's alone
            self._leave_share(be_table, share)
        return True

    # -- BE side ------------------------------------------------------------------------

    def _reserve_be(self, rid: str, table: BlockTable, target: int) -> bool:
        bs = self.block_size
        last = self.shares.get(table.ids[-1]) if table.claimed % bs else None
        if last is not None and last.be_id == rid:
            e = len(table) - 1
            if not self._grow_be_last(rid, table, e, min(target - e * bs, bs)):
                return False
        while len(table) * bs < target:
            if not self.pool.num_free:
                return False
            e = len(table)
            block = self._take_free()
            self._append_entry(table, block, rev=False)
            self._add_share(Share(block.block_id, rid, e, 0, 0))
        for e in range(table.claimed // bs, len(table)):
            share = self.shares.get(table.ids[e])
            if share is not None and share.be_id == rid:
                fill = min(target - e * bs, bs)
                self._share_set(share, be_fill=fill, be_len=fill)
        self._set_claimed(table, target)
        return True

    def _grow_be_last(self, rid: str, table: BlockTable, e: int, want: int) -> bool:
        """Make room for `want` slots of the last BE block; relocate it if the RT end is in the way."""
        share = self.shares[table.ids[e]]
        if want <= self.block_size - self._rt_fill(share):
            return True
        if not self.pool.num_free:
            return False
        return self._relocate(rid, table, e, share, share.be_fill)

    def _rt_fill(self, share: Share) -> int:
        if share.rt_id is None:
            return 0
        rt = self._tables[share.rt_id]
        return max(0, min(rt.claimed - share.rt_entry * self.block_size, self.block_size))

    def _relocate(self, rid: str, table: BlockTable, e: int, share: Share, resident: int) -> bool:
        """Move a BE logical block's resident offsets [0, resident) to a free block."""
        bs = self.block_size
        block = self._take_free()
        old = share.block_id
        self._emit(
            CopyKind.D2D,
            [old * bs + o for o in range(resident)],
            [block.block_id * bs + o for o in range(resident)],
            "relocate",
            rid,
        )
        self._leave_share(table, share)
        self._set_entry(table, e, block)
        self._add_share(Share(block.block_id, rid, e, resident, resident))
        return True

    # -- restore / swap -----------------------------------------------------------------

    def _restore_entry(self, rid: str, table: BlockTable, e: int, be: bool) -> bool:
        bs = self.block_size
        he = table.host[e]
        length = self._entry_len(table, e)
        if be:
            if not self.pool.num_free:
                return False
            if table.blocks[e] is not None:  # resident part: moved along, device to device
                self._relocate(rid, table, e, self.shares[table.ids[e]], he.resident)
            else:
                block = self._take_free()
                self._set_entry(table, e, block)
                self._add_share(Share(block.block_id, rid, e, 0, 0))
            share = self.shares[table.ids[e]]
            self._share_set(share, be_fill=length, be_len=length)
            dst = [table.ids[e] * bs + o for o in range(he.resident, length)]
        else:
            taken = self._rt_block(rid, e)
            if taken is None:
                return False
            block, rev = taken
            self._set_entry(table, e, block, rev)
            if not self._rt_claim(table, e * bs, e * bs + length):
                return False
            dst = [block.block_id * bs + (bs - 1 - o if rev else o) for o in range(he.resident, length)]
        self._emit(CopyKind.H2D, [he.host_block * bs + o for o in range(he.resident, length)], dst, "restore", rid)
        self._release_host(table, e)
        return True

    def _swap_out_entry(self, rid: str, table: BlockTable, e: int) -> bool:
        bs = self.block_size
        block = table.blocks[e]
        share = self.shares.get(block.block_id)
        he = table.host.get(e)
        resident = self._entry_len(table, e) if he is None else he.resident
        host_block = he.host_block if he is not None else self._take_host()
        if host_block is None:
            return False
        if table.rev[e]:
            src = [block.block_id * bs + bs - 1 - o for o in range(resident)]
        else:
            src = [block.block_id * bs + o for o in range(resident)]
        self._emit(CopyKind.D2H, src, [host_block * bs + o for o in range(resident)], "swap_out", rid)
        self._set_host(table, e, host_block, 0)
        self._detach(rid, table, e, share)
        return True

    def _detach(self, rid: str, table: BlockTable, e: int, share: Share | None) -> None:
        """Drop the request's hold on entry e's block (its end of a shared block)."""
        if share is not None and share.be_id == rid and share.be_entry == e:
            self._leave_share(table, share)
            return
        if share is not None and share.rt_id == rid:
            self._share_set(share, rt_id=None, rt_entry=-1)
        self._release(table.blocks[e])
        self._set_entry(table, e, None)

    def _leave_share(self, be_table: BlockTable, share: Share) -> None:
        """The BE request leaves a block: drop the share, its reference and its table entry."""
        self._drop_share(share)  # any RT end keeps the block as its plain forward block
        self._release(self.pool.blocks[share.block_id])
        self._set_entry(be_table, share.be_entry, None)

    def _drop_table(self, rid: str, table: BlockTable) -> None:
        """Free everything a request holds (finish, abort, recompute preemption)."""
        for e in reversed(range(len(table))):
            if table.blocks[e] is not None:
                self._detach(rid, table, e, self.shares.get(table.ids[e]))
        for e in list(table.host):
            self._release_host(table, e)
        del self._tables[rid]
        self.undo.push(lambda: self._tables.__setitem__(rid, table))

    def _entry_len(self, table: BlockTable, e: int) -> int:
        return max(0, min(table.claimed - e * self.block_size, self.block_size))

    # -- logged primitives ----------------------------------------------------------------

    def _new_table(self, rid: str, prefix: Sequence[Block]) -> BlockTable:
        from engine.kv.kv_cache_manager import BlockTable

        table = self._tables[rid] = BlockTable()
        self.undo.push(lambda: self._tables.pop(rid))
        for block in prefix:
            self._acquire(block)
            self._append_entry(table, block, rev=False)
        self._set_claimed(table, len(prefix) * self.block_size)
        return table

    def _append_entry(self, table: BlockTable, block: Block, rev: bool) -> None:
        table.blocks.append(block)
        table.ids.append(block.block_id)
        table.rev.append(rev)

        def undo() -> None:
            table.blocks.pop(), table.ids.pop(), table.rev.pop()

        self.undo.push(undo)

    def _pop_entry(self, rid: str, table: BlockTable) -> None:
        e = len(table) - 1
        if table.blocks[e] is not None:
            self._detach(rid, table, e, self.shares.get(table.ids[e]))
        if e in table.host:
            self._release_host(table, e)
        block, rev = table.blocks.pop(), table.rev.pop()
        table.ids.pop()

        def undo() -> None:
            table.blocks.append(block), table.ids.append(0), table.rev.append(rev)

        self.undo.push(undo)

    def _set_entry(self, table: BlockTable, e: int, block: Block | None, rev: bool | None = None) -> None:
        old, old_rev = table.blocks[e], table.rev[e]
        table.blocks[e] = block
        table.ids[e] = 0 if block is None else block.block_id
        if rev is not None:
            table.rev[e] = rev

        def undo() -> None:
            table.blocks[e] = old
            table.ids[e] = 0 if old is None else old.block_id
            table.rev[e] = old_rev

        self.undo.push(undo)

    def _set_claimed(self, table: BlockTable, claimed: int) -> None:
        old = table.claimed
        table.claimed = claimed
        self.undo.push(lambda: setattr(table, "claimed", old))

    def _set_host(self, table: BlockTable, e: int, host_block: int, resident: int) -> HostEntry:
        from engine.kv.kv_cache_manager import HostEntry

        old = table.host.get(e)
        he = table.host[e] = HostEntry(host_block, resident)
        self.undo.push(lambda: table.host.__setitem__(e, old) if old is not None else table.host.pop(e))
        return he

    def _release_host(self, table: BlockTable, e: int) -> None:
        he = table.host.pop(e)
        self.host.release(he.host_block)

        def undo() -> None:
            self.host.unrelease(he.host_block)
            table.host[e] = he

        self.undo.push(undo)

    def _take_host(self) -> int | None:
        host_block = self.host.allocate()
        if host_block is not None:
            self.undo.push(lambda: self.host.release(host_block))
        return host_block

    def _take_free(self) -> Block:
        block = self.pool.allocate(1)[0]
        self.undo.push(lambda: self.pool.unallocate(block))
        return block

    def _acquire(self, block: Block) -> None:
        self.pool.acquire([block])
        self.undo.push(lambda: self.pool.release([block]))

    def _release(self, block: Block) -> None:
        self.pool.release([block])
        self.undo.push(lambda: self.pool.acquire([block]))

    def _add_share(self, share: Share) -> None:
        self.shares[share.block_id] = share
        self.steal_index.update(share, share.rt_id is None)
        self.undo.push(lambda: self._unindex(share))

    def _drop_share(self, share: Share) -> None:
        self._unindex(share)
        self.undo.push(lambda: self._reindex(share))

    def _unindex(self, share: Share) -> None:
        del self.shares[share.block_id]
        self.steal_index.update(share, False)

    def _reindex(self, share: Share) -> None:
        self.shares[share.block_id] = share
        self.steal_index.update(share, share.rt_id is None)

    def _share_set(self, share: Share, **fields) -> None:
        old = {k: getattr(share, k) for k in fields}
        for k, v in fields.items():
            setattr(share, k, v)
        self.steal_index.update(share, share.rt_id is None)

        def undo() -> None:
            for k, v in old.items():
                setattr(share, k, v)
            self.steal_index.update(share, share.rt_id is None and share.block_id in self.shares)

        self.undo.push(undo)

    def _emit(self, kind: CopyKind, src: list[int], dst: list[int], reason: str, rid: str) -> None:
        if not src:
            return
        copy = KVCopy(kind, tuple(src), tuple(dst), len(src) * self.bytes_per_token, reason, rid)
        self.pending_copies.append(copy)
        crossing = copy.nbytes if copy.crosses_host else 0
        self.pending_swap_bytes += crossing

        def undo() -> None:
            self.pending_copies.pop()
            self.pending_swap_bytes -= crossing

        self.undo.push(undo)

    # -- consistency (tests call this after every step) -----------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if tables, shares, reference counts or host space disagree."""
        bs = self.block_size
        refs: dict[int, int] = {}
        for rid, table in self._tables.items():
            assert len(table.blocks) == len(table.ids) == len(table.rev) == -(-table.claimed // bs), rid
            for e, block in enumerate(table.blocks):
                he = table.host.get(e)
                if block is None:
                    assert he is not None and he.resident == 0 and table.ids[e] == 0, (rid, e)
                    continue
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                share = self.shares.get(block.block_id)
                if share is not None and share.be_id == rid and share.be_entry == e:  # a BE end
                    assert not table.rev[e], (rid, e)
                    assert share.be_len == self._entry_len(table, e), (rid, e)
                    assert (he.resident if he else share.be_len) == share.be_fill, (rid, e)
                else:
                    assert he is None, (rid, e)
                    if share is not None:  # the RT end of a BE block (stays reversed once the BE leaves)
                        assert share.rt_id == rid and share.rt_entry == e and table.rev[e], (rid, e)
        for _block_id, share in self.shares.items():
            assert 0 < share.be_fill <= share.be_len <= bs, share
            assert self._rt_fill(share) + share.be_fill <= bs, share
        for block in self.pool.blocks[1:]:
            assert block.ref_count == refs.get(block.block_id, 0), (block, refs.get(block.block_id))
        host_used = [he.host_block for t in self._tables.values() for he in t.host.values()]
        assert len(set(host_used)) == len(host_used) == self.host.num_blocks - self.host.num_free
