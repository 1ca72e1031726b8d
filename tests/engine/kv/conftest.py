"""Fixtures for the KV manager tests: a full fingerprint of a manager's state (to show a
rollback leaves no trace) and a slot-level memory that runs recorded copies (to show moves
keep every token's data). Session-scoped, so hypothesis tests may use them."""

from __future__ import annotations

import pytest

from engine.kv import KVCacheManager, PartialResidency, TwoEndedBlocks
from engine.kv.copies import CopyKind, KVCopy


def fingerprint(kv: KVCacheManager) -> tuple:
    """Everything a rollback must restore: tables, reference counts, the pools' free lists in
    order, the prefix-hash index, recorded copies and the two-ended component's preemption table and steal index."""
    tables = {
        rid: (
            tuple(t.ids),
            tuple(t.rev),
            t.claimed,
            t.transient,
            sorted((e, h.host_block, h.resident) for e, h in t.host.items()),
            tuple(b.block_id for b in t.held),
            tuple(t.host_prefix),
        )
        for rid, t in kv.ledger.tables.items()
    }
    pools = (
        tuple(b.ref_count for b in kv.pool.blocks),
        tuple(kv.pool._free),  # LRU order decides which block the next allocation gets
        tuple(kv.host._free),
        # the prefix index: a rollback that drops a hash loses a prefix-cache hit
        tuple(sorted((block_hash, block.block_id) for block_hash, block in kv.pool._cached.items())),
    )
    components = []
    for c in kv.components:
        if isinstance(c, TwoEndedBlocks):
            shares = sorted(
                (s.block_id, s.be_id, s.be_entry, s.be_fill, s.be_len, s.rt_id or "", s.rt_entry, s.be_rev)
                for s in c.shares.values()
            )
            best = c.steal_index.best()
            components.append((tuple(shares), c.num_stealable, None if best is None else best.block_id))
        elif isinstance(c, PartialResidency):
            components.append((c.ratio, c.source))
    return tables, pools, tuple(kv.ledger.copies), kv.pending_swap_bytes, tuple(components)


class SlotMemory:
    """What each device and host slot holds, as (request id, position) labels. `same_tokens`
    maps a request id to another whose tokens it shares, so a prefix-cache hit on the other's
    block reads as its own data."""

    def __init__(self, same_tokens: dict[str, str] | None = None) -> None:
        self.device: dict[int, tuple[str, int]] = {}
        self.host: dict[int, tuple[str, int]] = {}
        self.same_tokens = same_tokens or {}

    def _label(self, rid: str, p: int) -> tuple[str, int]:
        return self.same_tokens.get(rid, rid), p

    def write(self, kv: KVCacheManager, rid: str, start: int, end: int) -> None:
        """The forward pass writing positions [start, end) of a request into its slots."""
        table = kv.ledger.tables[rid]
        for p in range(start, end):
            self.device[table.slot(p, kv.block_size)] = self._label(rid, p)

    def run(self, copies: list[KVCopy]) -> None:
        """Execute copies in order, as `KVCacheStorage.execute` does."""
        for c in copies:
            src = self.host if c.kind is CopyKind.H2D else self.device
            dst = self.host if c.kind is CopyKind.D2H else self.device
            values = [src.get(s) for s in c.src_slots]
            for slot, value in zip(c.dst_slots, values):
                dst[slot] = value

    def write_step(self, kv: KVCacheManager, rid: str, start: int, end: int) -> None:
        """A step of a partially resident request: its rebuilt prefix rows land in the entries
        that have a block (fresh ones a shrinking ratio brought back), then its new tokens."""
        table, bs = kv.ledger.tables[rid], kv.block_size
        for p in range(table.transient):
            if table.ids[p // bs]:
                self.device[table.slot(p, bs)] = self._label(rid, p)
        self.write(kv, rid, start, end)

    def check_resident(self, kv: KVCacheManager, rid: str, computed: int) -> None:
        """Every computed position of a resident request reads back its own data: from the
        device, or for a partially resident request's empty entries from the host block that
        keeps them (host source); positions rebuilt each step are not read."""
        table, bs = kv.ledger.tables[rid], kv.block_size
        partial = isinstance(table.owner, PartialResidency)
        for p in range(computed):
            e = p // bs
            if partial and table.ids[e] == 0:
                if e < len(table.host_prefix):
                    assert self.host.get(table.host_prefix[e] * bs + p % bs) == self._label(rid, p), (rid, p, "host")
                continue
            assert self.device.get(table.slot(p, bs)) == self._label(rid, p), (rid, p)


@pytest.fixture(scope="session")
def kv_fingerprint():
    return fingerprint


@pytest.fixture(scope="session")
def slot_memory():
    return SlotMemory
