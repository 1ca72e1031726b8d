"""Two-ended blocks: a BE request at one end of a block and the RT request that may fill the
other (the paper's preemption table is the set of shares with checkpointed slots).

Every device block a BE request holds has a `Share`. Usually the BE request filled a free
block from the left (forward) and an RT request may take its right end (reversed). When no
block is free a BE request may instead take the free right end of an RT request's partly
filled block (`be_rev`: BE reversed, the RT owner forward at the left). Either way the RT end
grows into BE slots and checkpoints them, so the rules are the same with the ends swapped.
While no RT request uses the other end the block is *stealable*; `StealIndex` finds the one
with the most empty slots in O(block_size). `TwoEndedBlocks` (two_ended.py) keeps both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Share:
    block_id: int
    be_id: str
    be_entry: int  # logical block index in the BE request's table
    be_fill: int  # BE slots still resident, counted from the left end (offsets [0, be_fill))
    be_len: int  # BE tokens of this logical block (resident + checkpointed); be_fill <= be_len
    rt_id: str | None = None  # RT request filling the other end, if any
    rt_entry: int = -1
    be_rev: bool = False  # the BE end is the right one (BE took an RT block's free end)

    def be_slot(self, offset: int, block_size: int) -> int:
        """In-block slot of the BE request's logical offset `offset` in this block."""
        return block_size - 1 - offset if self.be_rev else offset

    def checkpointed(self, block_size: int) -> list[int]:
        """In-block slots whose BE contents were checkpointed to host (taken over by the RT
        end): those of the BE offsets [be_fill, be_len), in offset order."""
        return [self.be_slot(o, block_size) for o in range(self.be_fill, self.be_len)]


class StealIndex:
    """Stealable shares bucketed by empty slots; ties go to the most recently indexed.

    Each indexed share carries a stamp (its indexing time). A rollback passes the old stamp
    back to `update`, so an undone sequence of changes leaves the tie order exactly as it was
    and the next steal picks the same block as if the tentative changes never happened.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._buckets: list[dict[int, Share]] = [{} for _ in range(block_size + 1)]
        self._where: dict[int, int] = {}
        self._stamps: dict[int, int] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._where)

    def stamp(self, block_id: int) -> int | None:
        """The indexing time of an indexed share (None when it is not indexed)."""
        return self._stamps.get(block_id)

    def update(self, share: Share, stealable: bool, stamp: int | None = None) -> None:
        """(Re)index `share` as the newest of its bucket, or at `stamp` (an undo restoring its
        old place), or drop it from the index when it is not stealable."""
        old = self._where.pop(share.block_id, None)
        if old is not None:
            del self._buckets[old][share.block_id]
            del self._stamps[share.block_id]
        if not stealable:
            return
        if stamp is None:
            self._clock += 1
            stamp = self._clock
        empty = self.block_size - share.be_fill
        bucket = self._buckets[empty]
        newest = next(reversed(bucket), None)
        bucket[share.block_id] = share
        self._where[share.block_id] = empty
        self._stamps[share.block_id] = stamp
        if newest is not None and stamp < self._stamps[newest]:
            # Only an undo re-inserts an older share; put the bucket back in stamp order.
            ordered = sorted(bucket.items(), key=lambda item: self._stamps[item[0]])
            bucket.clear()
            bucket.update(ordered)

    def best(self) -> Share | None:
        for bucket in reversed(self._buckets):
            if bucket:
                return next(reversed(bucket.values()))
        return None
