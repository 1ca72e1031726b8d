"""A request's block table: its logical KV blocks in order, and where each one lives.

This is the one structure the KV manager, its components and the runner share. Entry `i` holds
the request's tokens `[i*bs, (i+1)*bs)`; the entry's *device* block, *direction* and *host*
copy are three parallel facts about it. The runner reads only `ids` and `rev` (see
`engine/kv/component.py`, "How the runner learns slots"), so a table is all a kernel needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.block_pool import Block

if TYPE_CHECKING:
    from engine.kv.component import KVComponent


@dataclass
class HostEntry:
    """A logical block with KV on host: offsets [0, resident) are still on device, the rest
    (up to the entry's length) sit in `host_block` at their logical offsets."""

    host_block: int
    resident: int


@dataclass(eq=False)
class BlockTable:
    """A request's blocks in logical order (entry i holds tokens [i*bs, (i+1)*bs)).

    `ids` mirrors `blocks` as plain ints because the runner reads it every step (0, the null
    block, for an entry with no device block); `rev[i]` says entry i fills its block from the
    right end (offset o at slot bs-1-o). `claimed` counts token positions that own a slot:
    computed tokens plus those reserved for the step being scheduled. `owner` is the KV
    component that places this table's blocks (None: the core's forward rules); it is chosen
    when the table is created and kept until the table is dropped. `held` are device blocks
    the owner holds for the table as a whole rather than per entry (hidden-state rows, whose
    width is not a KV block's: `engine/kv/hidden.py`); the core counts and frees them.
    `transient` (partial residency, `kv/partial.py`) counts the leading tokens whose K/V the
    next step rebuilds instead of reading from the pool: their entries are empty (id 0) or,
    while a shrinking ratio brings them back, fresh blocks that step fills; 0 for every other table.
    `host_prefix` (partial residency with the host source) are the host blocks holding entries
    `0 .. len(host_prefix)-1` of that non-resident prefix: the step reads their K/V from host
    layer by layer instead of rebuilding them; empty when the prefix is rebuilt. Unlike `host`
    (a swapped-out entry the request must restore before it runs) these entries stay on host
    while the request runs.

    Only `KVLedger` primitives change a table, so every change can be rolled back.
    """

    blocks: list[Block | None] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    rev: list[bool] = field(default_factory=list)
    claimed: int = 0
    host: dict[int, HostEntry] = field(default_factory=dict)
    owner: KVComponent | None = field(default=None, repr=False)
    held: list[Block] = field(default_factory=list)
    transient: int = 0
    host_prefix: list[int] = field(default_factory=list)

    def extend(self, blocks: Sequence[Block]) -> None:
        """Append forward entries (no undo record: callers go through `KVLedger.append_entries`)."""
        self.blocks.extend(blocks)
        self.ids.extend(b.block_id for b in blocks)
        self.rev.extend(False for _ in blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def is_resident(self) -> bool:
        return not self.host

    def entry_len(self, entry: int, block_size: int) -> int:
        """Claimed tokens of logical entry `entry` (block_size for all but the last entry)."""
        return max(0, min(self.claimed - entry * block_size, block_size))

    def slot(self, position: int, block_size: int) -> int:
        """Physical device slot of a token position (its entry must have a device block)."""
        e, o = divmod(position, block_size)
        return self.ids[e] * block_size + (block_size - 1 - o if self.rev[e] else o)
