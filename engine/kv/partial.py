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

**Source of the non-resident prefix** (`source`, per engine; docs/ellm.md, "Per-layer
swap-in"): `rebuild` as above, or `host`: a block leaving the pool is first copied to a host
block (a d2h `KVCopy` the engine runs before the step, the host pool's accounting), then
released with its hash kept, and its host block joins `BlockTable.host_prefix`; each step
reads the prefix's K/V from there layer by layer (`engine/rebuilt_prefix.py`), no rows are
rebuilt. A shrinking ratio brings entries back as prefix-cache hits or fresh blocks filled by
h2d copies (no rebuild either), and their host blocks are freed. The source is decided per
table when its prefix grows from nothing (host when the host pool has room for it): a table
whose prefix would outgrow the host space falls back to `rebuild`, releasing its host blocks,
and stays so until its prefix is resident again (a rebuilt prefix has no copy to offload).
So a full host pool degrades to the rebuild path, never to an error.

All changes go through the ledger (logged), so the core's rollback undoes a failed `grow`.
One ratio for every request it owns (the paper's solver yields one `r` and writes it into
every running request), changeable between steps with `set_ratio`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from engine.kv.component import KVComponent
from engine.kv.copies import CopyKind

if TYPE_CHECKING:
    from engine.kv.block_table import BlockTable
    from engine.kv.ledger import KVLedger
    from engine.scheduling.request import Request

MAX_RATIO = 0.95  # r = 1 would leave a request no resident context, only its newest block
SOURCES = ("rebuild", "host")  # where a step gets the non-resident prefix's K/V


def check_source(source: str) -> str:
    """`source`, or ValueError when it is not one of `SOURCES`."""
    if source not in SOURCES:
        raise ValueError(f"uncached source must be one of {', '.join(SOURCES)}, got {source!r}")
    return source


def check_ratio(ratio: float) -> float:
    """`ratio` as a float, or ValueError when it is outside [0, MAX_RATIO]."""
    ratio = float(ratio)
    if not 0.0 <= ratio <= MAX_RATIO:
        raise ValueError(f"uncached ratio must be in [0, {MAX_RATIO}], got {ratio}")
    return ratio


class PartialResidency(KVComponent):
    name: ClassVar[str] = "partial"

    def __init__(
        self,
        ledger: KVLedger,
        *,
        ratio: float = 0.0,
        excluded: Callable[[Request], bool] | None = None,
        source: str = "rebuild",
    ) -> None:
        """`ratio`: the share of each request's computed tokens kept out of the pool.
        `excluded(request)`: requests left to the core's rules (session turns: the keeper
        copies every block of a finished turn, so the turn must hold them all). `source`:
        `rebuild` or `host` (the module docstring)."""
        super().__init__(ledger)
        self.ratio = check_ratio(ratio)
        self.source = check_source(source)
        self.excluded = excluded
        self.block_size = ledger.block_size

    def set_ratio(self, ratio: float) -> None:
        """Change r for every owned request from their next allocation on (logged)."""
        old, self.ratio = self.ratio, check_ratio(ratio)
        if self.ledger.undo.active:
            self.ledger.undo.push(lambda: setattr(self, "ratio", old))

    def set_source(self, source: str) -> None:
        """The source of prefixes that leave the pool from the next allocation on (logged);
        tables keep the source their prefix started with."""
        old, self.source = self.source, check_source(source)
        if self.ledger.undo.active:
            self.ledger.undo.push(lambda: setattr(self, "source", old))

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
            if table.host_prefix:  # host-sourced: exactly the empty prefix is on host, nothing rebuilt
                n = len(table.host_prefix)
                assert table.transient == n * bs == self._leading_empty(table), (rid, n, table.transient)
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
            if self._kept_on_host(table, current, target):
                self._offload(request.request_id, table, current // bs, target // bs)
            else:
                for e in range(current // bs, target // bs):
                    self.ledger.release(table.blocks[e])
                    self.ledger.set_entry(table, e, None)
            transient = target
        elif table.host_prefix:
            if not self._copy_back(request, table, target // bs, current // bs):
                return False
            transient = target
        else:
            transient = self._bring_back(request, table, target // bs, current // bs)
            if transient is None:
                return False
        if transient != table.transient:
            self.ledger.set_transient(table, transient)
        return True

    def _kept_on_host(self, table: BlockTable, current: int, target: int) -> bool:
        """Whether the prefix growing from `current` to `target` tokens is kept on host. A table
        keeps its source while it has a prefix; when the host pool cannot take the growth, a
        host-sourced table falls back to rebuilding (its host blocks are released, logged)."""
        if target == current or self.source != "host":
            return False
        if current and not table.host_prefix:  # a rebuilt prefix has no copy to offload
            return False
        if (target - current) // self.block_size <= self.ledger.host.num_free:
            return True
        while table.host_prefix:
            self.ledger.pop_host_prefix(table)
        return False

    def _offload(self, rid: str, table: BlockTable, low: int, high: int) -> None:
        """Entries [low, high) leave the pool for host blocks: a d2h copy each (run before the
        step, so before anything overwrites the released block), then the device block is
        released with its hash kept. The caller checked the host pool's room."""
        bs = self.block_size
        for e in range(low, high):
            host_block = self.ledger.take_host()
            block_id = table.ids[e]
            self.ledger.emit(
                CopyKind.D2H,
                [block_id * bs + o for o in range(bs)],
                [host_block * bs + o for o in range(bs)],
                "offload_prefix",
                rid,
            )
            self.ledger.push_host_prefix(table, host_block)
            self.ledger.release(table.blocks[e])
            self.ledger.set_entry(table, e, None)

    def _copy_back(self, request: Request, table: BlockTable, low: int, high: int) -> bool:
        """Host-kept entries [low, high) become resident again, from the top down: a prefix-cache
        hit where the released block is still cached, otherwise a fresh block filled by an h2d
        copy from the entry's host block (no rebuild, so a hit may sit below a copy). The host
        blocks are freed. False when the pool is short."""
        bs, pool, hashes = self.block_size, self.ledger.pool, request.block_hashes
        for e in range(high - 1, low - 1, -1):
            block = pool.lookup(hashes[e]) if e < len(hashes) else None
            if block is not None:
                self.ledger.acquire([block])
            elif pool.num_free:
                block = self.ledger.take_free_block()
                src = table.host_prefix[e]
                self.ledger.emit(
                    CopyKind.H2D,
                    [src * bs + o for o in range(bs)],
                    [block.block_id * bs + o for o in range(bs)],
                    "restore_prefix",
                    request.request_id,
                )
            else:
                return False
            self.ledger.set_entry(table, e, block, rev=False)
            self.ledger.pop_host_prefix(table)
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
