"""Hidden-state blocks (Apt-Serve's hybrid cache): a HIDDEN request keeps, per layer and token,
the tensor that enters the layer's QKV projection instead of its K and V, in the same pool.

**Layout.** One layer of the pool is `[2, kv_heads, blocks, bs, head_dim]`. Viewed as
`[2·kv_heads · blocks, bs·head_dim]` it is a list of *units*: one (plane, KV head) slice of
one block, holding `bs` rows of `head_dim` values. A hidden row of `d = hidden_size` values is
cut into `need = ceil(d / head_dim)` chunks (the last zero-padded), and logical entry e of a
HIDDEN request (tokens `[e·bs, (e+1)·bs)`) stores chunk j of its tokens in the request's
unit `k = e·need + j`, i.e. in unit `k mod U` of its held block `k div U` (U = 2·kv_heads,
units per block). So a request of n entries holds `ceil(n·need / U)` blocks: `ceil(n·r)` in
KV-block units with `r = need / U = d / (2·kv_heads·head_dim)` (exactly, when head_dim
divides d). For MHA r = 1/2 and two logical hidden blocks share one pool block's K and V
planes, as in the paper's code; for SmolLM2's GQA r = 1.5 (nine chunks of 64 over six units),
for the tiny GQA test Llama with one KV head r = 2.

The blocks are in `BlockTable.held` and the entries have none of their own (id 0): where an
entry's rows lie is the arithmetic above, which the runner does (`HiddenLayout`), the same
for every layer. The same layer view is what the attention reads, so no second tensor and
no second budget exist: HIDDEN and KV requests share one pool and one allocation path.

**Decisions.**
- *Refused where it costs memory.* With r >= 1 (GQA with kv_heads <= heads/2) the hidden form
  takes as much pool as K/V or more; it is still allowed when forced for every request
  (`EngineConfig.cache_form="hidden"`, a checking and debugging setting), with a warning in
  the log, and `saves_memory` tells a policy never to pick it to save memory.
- *No prefix cache for HIDDEN requests*, in either direction: their blocks hold no K/V
  (`publishable` False), and their rows straddle blocks shared with the next entry, so a
  hidden block is not a unit another request could reuse either.
- *Never swapped.* Conversions and preemption are by recompute, as in the paper; the core
  refuses to swap a table with held blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.kv.component import KVComponent

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.kv.block_table import BlockTable
    from engine.kv.ledger import KVLedger
    from engine.scheduling.request import Request


class CacheForm(str, enum.Enum):
    """What a request keeps per layer and token (`Request.cache_form`; docs/aptserve.md)."""

    KV = "kv"  # K and V (2·kv_heads·head_dim values)
    HIDDEN = "hidden"  # the layer's QKV-projection input (hidden_size values); K/V rebuilt every step


@dataclass(frozen=True)
class HiddenLayout:
    """Where a HIDDEN request's rows lie in one layer of the pool (see the module docstring)."""

    hidden_size: int  # d: values per stored row
    head_dim: int  # a unit's row width
    units_per_block: int  # U = 2·kv_heads
    block_size: int
    num_blocks: int  # blocks in the pool (a unit's flat index is u·num_blocks + block)

    @staticmethod
    def of(model: ModelConfig, block_size: int, num_blocks: int) -> HiddenLayout:
        return HiddenLayout(model.hidden_size, model.head_dim, 2 * model.num_kv_heads, block_size, num_blocks)

    @property
    def chunks(self) -> int:
        """`need`: units per logical entry (a row's head_dim-wide chunks)."""
        return -(-self.hidden_size // self.head_dim)

    @property
    def ratio(self) -> float:
        """Pool blocks per logical entry, in KV-block units: d / (2·kv_heads·head_dim) when
        head_dim divides d."""
        return self.chunks / self.units_per_block

    @property
    def saves_memory(self) -> bool:
        return self.ratio < 1

    def describe(self) -> str:
        """One log line: what a hidden row costs here and whether it saves memory."""
        kv_width = self.units_per_block * self.head_dim
        verdict = "saves memory" if self.saves_memory else "saves NO memory (GQA): never chosen to save memory"
        return (
            f"hidden cache: a hidden row (d={self.hidden_size}) takes {self.ratio:.2f}x a token's K+V "
            f"(2*kv_heads*head_dim={kv_width}); it {verdict}"
        )

    def blocks_for(self, entries: int) -> int:
        """Pool blocks a HIDDEN request of `entries` logical entries holds."""
        return -(-entries * self.chunks // self.units_per_block)

    def entry_units(self, held_ids: torch.Tensor, entries: int) -> torch.Tensor:
        """`[entries, chunks]` flat unit indices (`u·num_blocks + block`) of entries
        0..entries-1, for the request holding blocks `held_ids` (a long tensor)."""
        k = torch.arange(entries * self.chunks, dtype=torch.long).view(entries, self.chunks)
        return (k % self.units_per_block) * self.num_blocks + held_ids[k // self.units_per_block]

    def write_rows(self, held_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`[len(positions), chunks]` rows of the layer viewed as `[-1, head_dim]` where the
        tokens at `positions` store their chunks."""
        entries = -(-(int(positions.max()) + 1) // self.block_size)
        units = self.entry_units(held_ids, entries)[positions // self.block_size]
        return units * self.block_size + (positions % self.block_size).unsqueeze(1)


class HiddenBlocks(KVComponent):
    """Owns the requests in HIDDEN form and places their rows (module docstring)."""

    name: ClassVar[str] = "hidden"
    uses_prefix_cache: ClassVar[bool] = False

    def __init__(self, ledger: KVLedger, *, layout: HiddenLayout) -> None:
        super().__init__(ledger)
        self.layout = layout

    @staticmethod
    def factory(layout: HiddenLayout):
        """A factory for `KVCacheManager.attach`."""
        return lambda ledger: HiddenBlocks(ledger, layout=layout)

    def owns(self, request: Request) -> bool:
        return request.cache_form is CacheForm.HIDDEN

    def grow(self, request: Request, table: BlockTable, target: int) -> bool:
        bs = self.ledger.block_size
        entries = -(-target // bs)
        more = self.layout.blocks_for(entries) - len(table.held)
        if more > self.ledger.pool.num_free:
            return False
        if more > 0:
            self.ledger.hold(table, self.ledger.take_free(more))
        if entries > len(table):
            self.ledger.append_empty_entries(table, entries - len(table))
        self.ledger.set_claimed(table, target)
        return True

    def restore_entry(self, request: Request, table: BlockTable, entry: int) -> bool:
        raise RuntimeError("HIDDEN requests are never on host (they are preempted by recompute)")

    def publishable(self, table: BlockTable, entry: int) -> bool:
        return False  # the blocks hold hidden rows, never K/V

    def capacity_tokens(self) -> int:
        """Tokens one HIDDEN request may hold in the whole pool."""
        entries = self.ledger.pool.capacity * self.layout.units_per_block // self.layout.chunks
        return entries * self.ledger.block_size

    def check_invariants(self) -> None:
        for rid, table in self.ledger.tables.items():
            if table.owner is not self:
                continue
            assert not table.host and not any(table.rev), rid
            assert all(b is None for b in table.blocks), rid
            assert len(table.held) == self.layout.blocks_for(len(table)), (rid, len(table.held), len(table))
            assert len({b.block_id for b in table.held}) == len(table.held), rid
