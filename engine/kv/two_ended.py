"""Two-ended KV blocks (BROS §5), mirrored: BE fills blocks from the left, and an RT request
that takes over a BE block's free end fills it from the right. The paper puts RT on the left;
either way the two occupants grow towards each other, and this way round every exclusive
block (nearly all of them) is forward, so attention only pays for reversal in stolen blocks.

Rules (decisions for the paper's gaps are argued in docs/bros.md):
- An RT request takes a free block (forward), or else the right end of the stealable BE block
  with the most empty slots (`StealIndex`; the entry is reversed). Growing into its peer's
  slots checkpoints exactly the BE slots about to be overwritten to host (lazy checkpointing)
  and records them in the share.
- A BE request takes a free block (forward), or else, for the last block of a growth only
  (the paper's FindBlock (i): the partly filled block with the most empty slots), the free
  right end of an RT request's partly filled last block (the BE entry is reversed; the RT
  request keeps its left end and its growth there checkpoints the BE slots in its way, as
  above). Off with `lend_rt_ends=False`. It grows its last block into empty slots and, when
  the RT end is in the way, *relocates* that logical block to a free block (a
  device-to-device copy), so BE never overwrites RT.
- A request runs only when fully resident. Restoring a logical block with KV on host puts it
  into a fresh block (resident part copied device-to-device by `restore_entry`, the rest
  host-to-device by the core); the old block stays with the RT request that took it.

A `KVComponent` (contract in `component.py`): it owns every request of the manager it is
attached to and tells BE from RT with the `is_be` function its policy gives it. Its state is
the preemption table (`shares`, block id -> BE end + RT end) and the `StealIndex`; both are
changed only through the logged helpers at the end of this class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from engine.kv.block_pool import Block
from engine.kv.component import KVComponent
from engine.kv.copies import CopyKind
from engine.kv.shares import Share, StealIndex

if TYPE_CHECKING:
    from engine.kv.block_table import BlockTable
    from engine.kv.ledger import KVLedger
    from engine.scheduling.request import Request


class TwoEndedBlocks(KVComponent):
    name: ClassVar[str] = "two-ended"

    def __init__(self, ledger: KVLedger, *, is_be: Callable[[Request], bool], lend_rt_ends: bool = True) -> None:
        """`is_be(request)`: the request follows the BE rules (lends its blocks' free ends)
        rather than the RT ones (may take them). `lend_rt_ends`: BE may take the free right
        end of an RT request's last block when no block is free."""
        super().__init__(ledger)
        self.is_be = is_be
        self.lend_rt_ends = lend_rt_ends
        self.block_size = ledger.block_size
        self.shares: dict[int, Share] = {}  # block id -> BE end (+ RT end): the preemption table
        self.steal_index = StealIndex(ledger.block_size)

    @property
    def num_stealable(self) -> int:
        """BE blocks whose free end no RT request uses yet."""
        return len(self.steal_index)

    # -- the component contract ---------------------------------------------------------------

    def owns(self, request: Request) -> bool:
        return True

    def grow(self, request: Request, table: BlockTable, target: int) -> bool:
        if self.is_be(request):
            return self._grow_be(request.request_id, table, target)
        return self._grow_rt(request.request_id, table, target)

    def restore_entry(self, request: Request, table: BlockTable, entry: int) -> bool:
        if self.is_be(request):
            return self._restore_be(request.request_id, table, entry)
        taken = self._rt_block(request.request_id, entry)
        if taken is None:
            return False
        self.ledger.set_entry(table, entry, *taken)
        bs = self.block_size
        return self._rt_claim(table, entry * bs, entry * bs + table.entry_len(entry, bs))

    def on_detach(self, rid: str, table: BlockTable, entry: int) -> None:
        share = self.shares.get(table.ids[entry])
        if share is None:
            return
        if share.be_id == rid and share.be_entry == entry:
            self._drop_share(share)  # any RT end keeps the block as its plain forward block
        elif share.rt_id == rid:
            self._share_set(share, rt_id=None, rt_entry=-1)

    def publishable(self, table: BlockTable, entry: int) -> bool:
        return table.ids[entry] not in self.shares  # its RT end may still write into it

    # -- RT side ----------------------------------------------------------------------------------

    def _grow_rt(self, rid: str, table: BlockTable, target: int) -> bool:
        bs = self.block_size
        while len(table) * bs < target:
            taken = self._rt_block(rid, len(table))
            if taken is None:
                return False
            self.ledger.append_entry(table, *taken)
        if not self._rt_claim(table, table.claimed, target):
            return False
        self.ledger.set_claimed(table, target)
        return True

    def _rt_block(self, rid: str, entry: int) -> tuple[Block, bool] | None:
        """(block, reversed): a free block, else the right end of the stealable BE block with
        the most empty slots."""
        if self.ledger.pool.num_free:
            return self.ledger.take_free_block(), False
        share = self.steal_index.best()
        if share is None:
            return None
        block = self.ledger.pool.blocks[share.block_id]
        self.ledger.acquire([block])
        self._share_set(share, rt_id=rid, rt_entry=entry)
        return block, not share.be_rev

    def _rt_claim(self, table: BlockTable, start: int, end: int) -> bool:
        """Own positions [start, end) of an RT table; checkpoint BE slots in the way."""
        bs = self.block_size
        for e in range(start // bs, -(-end // bs)):
            share = self.shares.get(table.ids[e])
            if share is None:
                continue
            hi = min(end - e * bs, bs)
            overlap = hi - (bs - share.be_fill)  # the RT end's offsets [bs - be_fill, hi) meet BE data (either end)
            if overlap > 0 and not self._checkpoint(share, overlap):
                return False
        return True

    def _checkpoint(self, share: Share, count: int) -> bool:
        """Copy the BE's `count` innermost resident slots of a shared block to host."""
        bs, ledger = self.block_size, self.ledger
        be_table = ledger.tables[share.be_id]
        he = be_table.host.get(share.be_entry)
        if he is None:
            host_block = ledger.take_host()
            if host_block is None:
                return False
            he = ledger.set_host(be_table, share.be_entry, host_block, share.be_fill)
        offsets = range(share.be_fill - count, share.be_fill)  # highest offsets sit innermost
        ledger.emit(
            CopyKind.D2H,
            [share.block_id * bs + share.be_slot(o, bs) for o in offsets],
            [he.host_block * bs + o for o in offsets],
            "checkpoint",
            share.be_id,
        )
        fill = share.be_fill - count
        ledger.set_host(be_table, share.be_entry, he.host_block, fill)
        if fill:
            self._share_set(share, be_fill=fill)
        else:  # nothing of the BE request left here: the block is the RT request's alone
            self._leave_share(be_table, share)
        return True

    # -- BE side ----------------------------------------------------------------------------------

    def _grow_be(self, rid: str, table: BlockTable, target: int) -> bool:
        bs, ledger = self.block_size, self.ledger
        last = self.shares.get(table.ids[-1]) if table.claimed % bs else None
        if last is not None and last.be_id == rid:
            e = len(table) - 1
            if not self._grow_be_last(rid, table, e, min(target - e * bs, bs)):
                return False
        while len(table) * bs < target:
            e = len(table)
            if ledger.pool.num_free:
                block = ledger.take_free_block()
                ledger.append_entry(table, block, rev=False)
                self._add_share(Share(block.block_id, rid, e, 0, 0))
            elif not (self.lend_rt_ends and self._take_rt_end(rid, table, target - e * bs)):
                return False
        for e in range(table.claimed // bs, len(table)):
            share = self.shares.get(table.ids[e])
            if share is not None and share.be_id == rid:
                fill = min(target - e * bs, bs)
                self._share_set(share, be_fill=fill, be_len=fill)
        ledger.set_claimed(table, target)
        return True

    def _take_rt_end(self, rid: str, table: BlockTable, want: int) -> bool:
        """Append an entry in the free end of the RT block with the most empty slots (at least
        `want`, fewer than a block: only a growth's last entry can fit), ties to the lowest
        block id so the choice depends on the state alone, not on the tables' order."""
        bs, ledger = self.block_size, self.ledger
        best: tuple[int, int, str, int] | None = None  # (empty, -block id, RT request, entry)
        for owner, rt in ledger.tables.items():
            if rt.owner is not self or not rt.claimed % bs:
                continue
            e = len(rt) - 1
            block = rt.blocks[e]
            # RT entries with a device block and no share are theirs alone; every resident BE
            # entry has a share, and prefix-cache hits are full (claimed % bs == 0 above)
            if block is None or block.ref_count != 1 or block.block_id in self.shares:
                continue
            key = (bs - rt.claimed % bs, -block.block_id, owner, e)
            if key[0] >= want and (best is None or key[:2] > best[:2]):
                best = key
        if best is None:
            return False
        _, neg_id, owner, rt_entry = best
        block = ledger.pool.blocks[-neg_id]
        be_rev = not ledger.tables[owner].rev[rt_entry]  # the end opposite the RT data
        ledger.acquire([block])
        ledger.append_entry(table, block, rev=be_rev)
        self._add_share(Share(block.block_id, rid, len(table) - 1, 0, 0, owner, rt_entry, be_rev))
        return True

    def _grow_be_last(self, rid: str, table: BlockTable, e: int, want: int) -> bool:
        """Make room for `want` slots of the last BE block; relocate it if the RT end is in the way."""
        share = self.shares[table.ids[e]]
        if want <= self.block_size - self._rt_fill(share):
            return True
        if not self.ledger.pool.num_free:
            return False
        self._relocate(rid, table, e, share, share.be_fill)
        return True

    def _rt_fill(self, share: Share) -> int:
        if share.rt_id is None:
            return 0
        rt = self.ledger.tables[share.rt_id]
        return rt.entry_len(share.rt_entry, self.block_size)

    def _relocate(self, rid: str, table: BlockTable, e: int, share: Share, resident: int) -> None:
        """Move a BE logical block's resident offsets [0, resident) to a free block."""
        bs, ledger = self.block_size, self.ledger
        block = ledger.take_free_block()
        old = share.block_id
        ledger.emit(
            CopyKind.D2D,
            [old * bs + share.be_slot(o, bs) for o in range(resident)],
            [block.block_id * bs + o for o in range(resident)],
            "relocate",
            rid,
        )
        self._leave_share(table, share)
        ledger.set_entry(table, e, block, rev=False)
        self._add_share(Share(block.block_id, rid, e, resident, resident))

    def _restore_be(self, rid: str, table: BlockTable, e: int) -> bool:
        """A fresh block for BE entry e; its resident part (if any) moves along device to device."""
        ledger = self.ledger
        if not ledger.pool.num_free:
            return False
        if table.blocks[e] is not None:
            self._relocate(rid, table, e, self.shares[table.ids[e]], table.host[e].resident)
        else:
            block = ledger.take_free_block()
            ledger.set_entry(table, e, block, rev=False)  # it may have been in an RT block's right end
            self._add_share(Share(block.block_id, rid, e, 0, 0))
        length = table.entry_len(e, self.block_size)
        self._share_set(self.shares[table.ids[e]], be_fill=length, be_len=length)
        return True

    def _leave_share(self, be_table: BlockTable, share: Share) -> None:
        """The BE request leaves a block: drop the share, its reference and its table entry."""
        self._drop_share(share)  # any RT end keeps the block as its plain forward block
        self.ledger.release(self.ledger.pool.blocks[share.block_id])
        self.ledger.set_entry(be_table, share.be_entry, None)

    # -- logged changes to the preemption table ----------------------------------------------------

    def _add_share(self, share: Share) -> None:
        self.shares[share.block_id] = share
        self.steal_index.update(share, share.rt_id is None)
        self.ledger.undo.push(lambda: self._unindex(share))

    def _drop_share(self, share: Share) -> None:
        stamp = self.steal_index.stamp(share.block_id)
        self._unindex(share)
        self.ledger.undo.push(lambda: self._reindex(share, stamp))

    def _unindex(self, share: Share) -> None:
        del self.shares[share.block_id]
        self.steal_index.update(share, False)

    def _reindex(self, share: Share, stamp: int | None) -> None:
        self.shares[share.block_id] = share
        self.steal_index.update(share, share.rt_id is None, stamp)

    def _share_set(self, share: Share, **fields) -> None:
        old = {k: getattr(share, k) for k in fields}
        stamp = self.steal_index.stamp(share.block_id)
        for k, v in fields.items():
            setattr(share, k, v)
        self.steal_index.update(share, share.rt_id is None)

        def undo() -> None:
            for k, v in old.items():
                setattr(share, k, v)
            self.steal_index.update(share, share.rt_id is None and share.block_id in self.shares, stamp)

        self.ledger.undo.push(undo)

    # -- consistency --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every owned entry is a BE end (direction `be_rev`, share lengths match the table and
        host entry), the RT end of a share (the other direction), or a plain block; shares fit
        their block."""
        for rid, table in self.ledger.tables.items():
            if table.owner is self:
                self._check_table(rid, table)
        bs = self.block_size
        for share in self.shares.values():
            assert 0 < share.be_fill <= share.be_len <= bs, share
            assert self._rt_fill(share) + share.be_fill <= bs, share

    def _check_table(self, rid: str, table: BlockTable) -> None:
        for e, block in enumerate(table.blocks):
            he = table.host.get(e)
            if block is None:
                assert he is not None, (rid, e)  # an entry without a device block is on host
                continue
            share = self.shares.get(block.block_id)
            if share is not None and share.be_id == rid and share.be_entry == e:  # a BE end
                assert table.rev[e] == share.be_rev, (rid, e)
                assert share.be_len == table.entry_len(e, self.block_size), (rid, e)
                assert (he.resident if he else share.be_len) == share.be_fill, (rid, e)
            else:
                assert he is None, (rid, e)
                if share is not None:  # the RT end (keeps its direction once the BE leaves)
                    assert share.rt_id == rid and share.rt_entry == e and table.rev[e] != share.be_rev, (rid, e)
