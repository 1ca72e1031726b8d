"""Partial KV residency (eLLM): a request keeps only its newest tokens' K/V in the pool.

The oldest `u` tokens of a request it owns have no K/V in the pool; each step rebuilds them
by re-running those tokens from their ids through every layer, one layer at a time, next to
the step's own tokens (design A of `../shared/papers/ellm-notes.md` §2.2; why this one is in
`docs/ellm.md`). The runner reads `BlockTable.transient` to know how many leading tokens to
rebuild; attention merges the rebuilt prefix and the paged suffix exactly
(`kernels/reference/resident.py`).

The ratio `r` sets `u = bs * floor(r * s / bs)` for a request with `s` computed tokens: whole
blocks only, since a partly filled block frees nothing, and only computed ones. Every
allocation (`grow`, once a step for a running request) first brings the table to that `u`:

- *r grew* (or `s` did): the entries of `[u_old, u_new)` are detached to empty entries (id
  0). Their blocks are released, not unregistered: they stay findable by their prefix hash
  until the pool reuses them, so a later request with the same prefix (or this one, when r
  shrinks) takes them back for free.
- *r shrank*: entries come back from the top down. Each one whose block is still cached by
  hash is taken back as a hit, until the first miss; the entries from there down to `u_new`
  get fresh blocks which this step's rebuild fills (the rebuilt prefix rows are written
  there), so `transient` stays above `u_new` for one step. Hits only above the misses: a
  block another request may read is never rewritten.
- Nothing is lost either way: tokens move between resident and rebuilt, never dropped.

All changes go through the ledger (logged), so the core's rollback undoes a failed `grow`.
One ratio for every request it owns (the paper's solver yields one `r` and writes it into
every running request), changeable between steps with `set_ratio`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from engine.kv.component import KVComponent

if TYPE_CHECKING:
    from engine.kv.block_table import BlockTable
    from engine.kv.ledger import KVLedger
    from engine.scheduling.request import Request

MAX_RATIO = 0.95  # r = 1 would leave a request no resident context, only its newest block


def check_ratio(ratio: float) -> float:
    """`ratio` as a float, or ValueError when it is outside [0, MAX_RATIO]."""
    ratio = float(ratio)
    if not 0.0 <= ratio <= MAX_RATIO:
        raise ValueError(f"uncached ratio must be in [0, {MAX_RATIO}], got {ratio}")
    return ratio


class PartialResidency(KVComponent):
    name: ClassVar[str] = "partial"

    def __init__(
        self, ledger: KVLedger, *, ratio: float = 0.0, excluded: Callable[[Request], bool] | None = None
    ) -> None:
        """`ratio`: the share of each request's computed tokens kept out of the pool.
        `excluded(request)`: requests left to the core's rules (session turns: the keeper
        copies every block of a finished turn, so the turn must hold them all)."""
        super().__init__(ledger)
        self.ratio = check_ratio(ratio)
        self.excluded = excluded
        self.block_size = ledger.block_size

    def set_ratio(self, ratio: float) -> None:
        """Change r for every owned request from their next allocation on (logged)."""
        old, self.ratio = self.ratio, check_ratio(ratio)
        if self.ledger.undo.active:
            self.ledger.undo.push(lambda: setattr(self, "ratio", old))

    def non_resident_target(self, request: Request) -> int:
        """Tokens of `request` the current ratio keeps out of the pool (whole computed blocks)."""
        bs = self.block_size
        return int(self.ratio * request.num_computed_tokens) // bs * bs

    # -- the component contract ---------------------------------------------------------------

    def owns(self, request: Request) -> bool:
        return self.excluded is None or not self.excluded(request)

    def grow(self, request: Request, table: BlockTable, target: int) -> bool:
        if not self._rebalance(request, table):
            return False
        need = -(-target // self.block_size) - len(table)
        if need > self.ledger.pool.num_free:
            return False
        if need > 0:
            self.ledger.append_entries(table, self.ledger.take_free(need))
        self.ledger.set_claimed(table, target)
        return True

    def restore_entry(self, request: Request, table: BlockTable, entry: int) -> bool:
        if not self.ledger.pool.num_free:
            return False
        self.ledger.set_entry(table, entry, self.ledger.take_free_block(), rev=False)
        return True

    def publishable(self, table: BlockTable, entry: int) -> bool:
        # a fresh block the next step fills is not K/V yet
        return entry * self.block_size >= table.transient

    def check_invariants(self) -> None:
        bs = self.block_size
        for rid, table in self.ledger.tables.items():
            if table.owner is not self:
                assert table.transient == 0, rid
                continue
            assert not any(table.rev), rid
            assert table.transient % bs == 0 and table.transient <= table.claimed, (rid, table.transient)
            empty = [block is None and e not in table.host for e, block in enumerate(table.blocks)]
            leading = self._leading_empty(table) // bs
            assert not any(empty[leading:]), (rid, empty)  # empty entries form a prefix...
            assert leading * bs <= table.transient, (rid, leading)  # ...that the next step rebuilds

    # -- moving tokens between resident and rebuilt -------------------------------------------

    def _rebalance(self, request: Request, table: BlockTable) -> bool:
        """Bring the table to the ratio's non-resident prefix; False when a shrink is short of blocks."""
        bs = self.block_size
        current = self._leading_empty(table)  # what the last step left non-resident
        target = self.non_resident_target(request)
        if target >= current:
            for e in range(current // bs, target // bs):
                self.ledger.release(table.blocks[e])
                self.ledger.set_entry(table, e, None)
            transient = target
        else:
            transient = self._bring_back(request, table, target // bs, current // bs)
            if transient is None:
                return False
        if transient != table.transient:
            self.ledger.set_transient(table, transient)
        return True

    def _bring_back(self, request: Request, table: BlockTable, low: int, high: int) -> int | None:
        """Entries [low, high) become resident: prefix-cache hits from the top down, then fresh
        blocks for this step's rebuild to fill. Returns the tokens this step rebuilds, or None
        when the pool is short."""
        pool, hashes = self.ledger.pool, request.block_hashes
        e = high
        while e > low and e - 1 < len(hashes):
            block = pool.lookup(hashes[e - 1])
            if block is None:
                break
            self.ledger.acquire([block])
            self.ledger.set_entry(table, e - 1, block, rev=False)
            e -= 1
        if e == low:
            return low * self.block_size
        if e - low > pool.num_free:
            return None
        for i, block in zip(range(low, e), self.ledger.take_free(e - low)):
            self.ledger.set_entry(table, i, block, rev=False)
        return e * self.block_size

    def _leading_empty(self, table: BlockTable) -> int:
        """Tokens before the table's first entry with a device block or a host copy."""
        for e, block in enumerate(table.blocks):
            if block is not None or e in table.host:
                return e * self.block_size
        return len(table) * self.block_size
