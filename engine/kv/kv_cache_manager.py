"""The KV manager's core: per-request block tables, prefix caching, one allocation path,
freeing and whole-request moves between device and host.

Policies call `match_prefix` and `allocate` (all or nothing), the engine calls `commit` after
each step to publish newly filled blocks to the prefix cache, and `free` when a request
finishes, aborts or is preempted. What varies between policies (two-ended blocks for BROS;
hidden-state blocks and partial residency next) is a `KVComponent` composed into the core;
`engine/kv/component.py` is the contract. Every change goes through the `KVLedger`, so any
sequence of calls can be rolled back to an undo mark (BROS packs candidates that way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from engine.kv.block_pool import Block, BlockPool
from engine.kv.block_table import BlockTable
from engine.kv.component import KVComponent
from engine.kv.copies import CopyKind, KVCopy
from engine.kv.host_pool import HostPool
from engine.kv.ledger import KVLedger
from engine.kv.prefix_hash import hash_block, salt_root

if TYPE_CHECKING:
    from engine.scheduling.request import Request

C = TypeVar("C", bound=KVComponent)


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, block_size: int, *, bytes_per_token: int = 0, host_blocks: int | None = None
    ) -> None:
        """`bytes_per_token` prices KV copies (`KVCopy.nbytes`); `host_blocks` sizes the swap
        space (default: four times the device pool)."""
        self.pool = pool
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.host = HostPool(4 * pool.num_blocks if host_blocks is None else host_blocks)
        self.ledger = KVLedger(pool, block_size, bytes_per_token, self.host)
        self.undo = self.ledger.undo
        self._tables = self.ledger.tables
        self._components: list[KVComponent] = []
        # Called with the number of blocks short when a forward allocation would fail; may free
        # some (the session store releases soft pins) and returns whether it did.
        self.reclaim: Callable[[int], bool] | None = None

    # -- components -------------------------------------------------------------------------

    def attach(self, factory: Callable[[KVLedger], C]) -> C:
        """Build a component on this manager's ledger and compose it in (before any table exists)."""
        if self._tables:
            raise RuntimeError("KV components are attached before the first allocation")
        component = factory(self.ledger)
        if any(type(c) is type(component) for c in self._components):
            raise ValueError(f"a {type(component).__name__} component is already attached")
        self._components.append(component)
        return component

    def component(self, cls: type[C]) -> C:
        """The attached component of type `cls`."""
        for c in self._components:
            if isinstance(c, cls):
                return c
        names = [type(c).__name__ for c in self._components]
        raise LookupError(
            f"the KV manager has no {cls.__name__} component (attached: {names}); the Scheduler attaches "
            f"the components of the policy it is built with"
        )

    @property
    def components(self) -> tuple[KVComponent, ...]:
        return tuple(self._components)

    # -- tables -------------------------------------------------------------------------------

    def table(self, request: Request) -> BlockTable:
        return self._tables[request.request_id]

    def holds(self, request: Request) -> bool:
        return request.request_id in self._tables

    def capacity_tokens(self) -> int:
        return self.pool.capacity * self.block_size

    # -- prefix cache ---------------------------------------------------------------------------

    def match_prefix(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute: the step needs it to produce logits.
        """
        if not self.pool.enable_caching:
            return [], 0
        owner = self._owner_for(request)
        if owner is not None and not owner.uses_prefix_cache:
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

    def commit(self, request: Request) -> None:
        """Publish blocks whose tokens are all computed to the prefix cache (`publishable` ones)."""
        if not self.pool.enable_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_registered_blocks:
            return
        table = self._tables[request.request_id]
        hashes = self._block_hashes(request, full)
        for i in range(request.num_registered_blocks, full):
            if self.publishable(table, i):
                self.pool.register(table.blocks[i], hashes[i])
        request.num_registered_blocks = full

    def publishable(self, table: BlockTable, entry: int) -> bool:
        """Whether a full, computed entry may be served to other requests by its hash.

        Only device-resident, left-filled entries qualify: a reversed block's slots are not in
        logical order, so serving it to a reader that expects forward order would be wrong;
        the table's owner may veto more (a block another request still writes into).
        """
        if table.blocks[entry] is None or table.rev[entry]:
            return False
        return table.owner is None or table.owner.publishable(table, entry)

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

    # -- allocation -----------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, prefix: Sequence[Block] = ()) -> bool:
        """Slots for `num_new_tokens` more tokens (after the prefix-cache hits `prefix`, when
        admitting). The request must be resident (`restore` first).

        All or nothing: returns False, with no state changed, when memory is short. Every
        change is logged, so a caller's undo mark can also roll back a successful call.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            owner = self._owner_for(request)
            target = len(prefix) * self.block_size + num_new_tokens
        else:
            if prefix:
                raise ValueError(f"request {rid} already holds KV; prefix-cache hits are taken on admission")
            if table.host:
                raise RuntimeError(f"request {rid} must be restored before it runs")
            target = request.num_computed_tokens + num_new_tokens
            if target <= table.claimed:
                return True
            owner = table.owner
        if owner is None:
            return self._allocate_forward(rid, table, target, prefix)
        return self._atomic(lambda: owner.grow(request, self._table_for(rid, table, prefix, owner), target))

    def _allocate_forward(self, rid: str, table: BlockTable | None, target: int, prefix: Sequence[Block]) -> bool:
        """The core's rules: free blocks, filled from the left. Checked before anything changes,
        so it never has to undo itself (FCFS pays no log)."""
        need = -(-target // self.block_size) - (len(table) if table else 0) - len(prefix)
        evictable = self.pool.num_evictable(prefix) if prefix else 0
        if need + evictable > self.pool.num_free and not self._reclaimed(need, prefix):
            return False
        table = self._table_for(rid, table, prefix, None)
        if need > 0:
            self.ledger.append_entries(table, self.ledger.take_free(need))
        self.ledger.set_claimed(table, target)
        return True

    def _reclaimed(self, need: int, prefix: Sequence[Block]) -> bool:
        short = need + self.pool.num_evictable(prefix) - self.pool.num_free
        if self.reclaim is None or not self.reclaim(short):
            return False
        return need + self.pool.num_evictable(prefix) <= self.pool.num_free

    def _owner_for(self, request: Request) -> KVComponent | None:
        for c in self._components:
            if c.owns(request):
                return c
        return None

    def _table_for(
        self, rid: str, table: BlockTable | None, prefix: Sequence[Block], owner: KVComponent | None
    ) -> BlockTable:
        """The request's table, created (taking over the prefix-cache hits) when it has none."""
        if table is not None:
            return table
        table = BlockTable(owner=owner)
        self.ledger.add_table(rid, table)
        if prefix:
            self.ledger.acquire(prefix)
            self.ledger.append_entries(table, prefix)
            self.ledger.set_claimed(table, len(prefix) * self.block_size)
        return table

    def _atomic(self, op: Callable[[], bool]) -> bool:
        """Run `op` under an undo mark and roll it back when it fails (or raises)."""
        undo = self.undo
        outer = undo.active
        mark = undo.mark()
        ok = False
        try:
            ok = op()
        finally:
            if not ok:
                undo.rollback(mark)
            if not outer:
                undo.settle()
        return ok

    # -- freeing and moves between device and host -------------------------------------------

    def free(self, request: Request) -> None:
        """Drop everything the request holds (finish, abort, recompute preemption)."""
        table = self._tables.get(request.request_id)
        if table is not None:
            self._drop_table(request.request_id, table)
        request.num_registered_blocks = 0

    def swap_out(self, request: Request) -> bool:
        """Move all of the request's device KV to host; False (nothing changed) when host space
        is short."""
        return self._atomic(lambda: self._swap_out(request))

    def restore(self, request: Request) -> bool:
        """Bring every logical block with KV on host back into a fresh device block; False
        (nothing changed) when memory is short."""
        return self._atomic(lambda: self._restore(request))

    def take_copies(self) -> list[KVCopy]:
        """The KV copies recorded since the last call (the engine runs them before the step)."""
        return self.ledger.take_copies()

    @property
    def pending_swap_bytes(self) -> int:
        """Bytes of the recorded copies that cross host <-> device."""
        return self.ledger.swap_bytes

    def _drop_table(self, rid: str, table: BlockTable) -> None:
        for e in reversed(range(len(table))):  # tail first: the head is the most shareable part
            if table.blocks[e] is not None:
                self._detach(rid, table, e)
        if table.held:
            self.ledger.release_held(table)
        for e in list(table.host):
            self.ledger.release_host(table, e)
        while table.host_prefix:
            self.ledger.pop_host_prefix(table)
        self.ledger.drop_table(rid)

    def _detach(self, rid: str, table: BlockTable, e: int) -> None:
        """Drop the table's hold on entry e's device block."""
        if table.owner is not None:
            table.owner.on_detach(rid, table, e)
        self.ledger.release(table.blocks[e])
        self.ledger.set_entry(table, e, None)

    def _swap_out(self, request: Request) -> bool:
        rid, bs = request.request_id, self.block_size
        table = self._tables[rid]
        if table.held:  # rows laid out by the owner, not per entry: the copies below would lose them
            raise RuntimeError(f"request {rid} holds {table.owner.name} blocks, which are never swapped out")
        computed = request.num_computed_tokens
        while len(table) > -(-computed // bs):  # reserved, never written: just drop
            e = len(table) - 1
            if table.blocks[e] is not None:
                self._detach(rid, table, e)
            if e in table.host:
                self.ledger.release_host(table, e)
            self.ledger.pop_entry(table)
        self.ledger.set_claimed(table, computed)
        for e in range(len(table)):
            if table.blocks[e] is not None and not self._swap_out_entry(rid, table, e):
                return False
        return True

    def _swap_out_entry(self, rid: str, table: BlockTable, e: int) -> bool:
        bs = self.block_size
        block_id = table.ids[e]
        he = table.host.get(e)
        resident = table.entry_len(e, bs) if he is None else he.resident
        host_block = he.host_block if he is not None else self.ledger.take_host()
        if host_block is None:
            return False
        if table.rev[e]:
            src = [block_id * bs + bs - 1 - o for o in range(resident)]
        else:
            src = [block_id * bs + o for o in range(resident)]
        self.ledger.emit(CopyKind.D2H, src, [host_block * bs + o for o in range(resident)], "swap_out", rid)
        self.ledger.set_host(table, e, host_block, 0)
        self._detach(rid, table, e)
        return True

    def _restore(self, request: Request) -> bool:
        table = self._tables[request.request_id]
        for e in sorted(table.host):
            if not self._restore_entry(request, table, e):
                return False
        return True

    def _restore_entry(self, request: Request, table: BlockTable, e: int) -> bool:
        """A fresh device block for entry e (placed by its owner), then the host part copied in."""
        bs = self.block_size
        he = table.host[e]
        length = table.entry_len(e, bs)
        if table.owner is not None:
            if not table.owner.restore_entry(request, table, e):
                return False
        elif self.pool.num_free:  # forward tables go to host whole (resident part 0)
            self.ledger.set_entry(table, e, self.ledger.take_free_block(), rev=False)
        else:
            return False
        offsets = range(he.resident, length)
        dst = [table.slot(e * bs + o, bs) for o in offsets]
        self.ledger.emit(CopyKind.H2D, [he.host_block * bs + o for o in offsets], dst, "restore", request.request_id)
        self.ledger.release_host(table, e)
        return True

    # -- queries ----------------------------------------------------------------------------------

    def num_host_blocks(self, request: Request) -> int:
        """Logical blocks of the request with KV on host (0 when not admitted)."""
        table = self._tables.get(request.request_id)
        return len(table.host) if table else 0

    def host_tokens(self, request: Request) -> int:
        """Tokens a restore would copy host -> device."""
        table = self._tables.get(request.request_id)
        if not table:
            return 0
        return sum(table.entry_len(e, self.block_size) - he.resident for e, he in table.host.items())

    def is_resident(self, request: Request) -> bool:
        table = self._tables.get(request.request_id)
        return table is None or not table.host

    def device_blocks(self, request: Request) -> int:
        table = self._tables.get(request.request_id)
        return 0 if table is None else sum(b is not None for b in table.blocks) + len(table.held)

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
        return self._tables[request.request_id].slot(position, self.block_size)

    # -- consistency (tests call this after every step) -------------------------------------------

    def check_invariants(self, outside: Iterable[Block] = ()) -> None:
        """Raise AssertionError if tables, reference counts, host space or a component's state
        disagree. `outside`: blocks referenced by holders other than block tables, one
        reference per occurrence (the session store's pins; `LLMEngine.check_invariants`
        passes them), so a held pin is not mistaken for a leaked reference."""
        bs = self.block_size
        refs: dict[int, int] = {}
        for block in outside:
            refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for rid, table in self._tables.items():
            assert len(table.blocks) == len(table.ids) == len(table.rev) == -(-table.claimed // bs), rid
            assert all(0 <= e < len(table) for e in table.host), rid
            for e, block in enumerate(table.blocks):
                assert table.ids[e] == (0 if block is None else block.block_id), (rid, e)
                if block is None:
                    he = table.host.get(e)
                    assert he is None or he.resident == 0, (rid, e)  # a resident part needs a device block
                else:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
            for block in table.held:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
            if table.owner is None:
                self._check_forward(rid, table)
        for block in self.pool.blocks[1:]:
            assert block.ref_count == refs.get(block.block_id, 0), (block, refs.get(block.block_id))
        host_used = [he.host_block for t in self._tables.values() for he in t.host.values()]
        host_used += [h for t in self._tables.values() for h in t.host_prefix]
        assert len(set(host_used)) == len(host_used) == self.host.num_blocks - self.host.num_free
        for component in self._components:
            component.check_invariants()

    @staticmethod
    def _check_forward(rid: str, table: BlockTable) -> None:
        """The core's rules: forward entries, each wholly on device or wholly on host."""
        assert not any(table.rev) and not table.held, rid
        for e, block in enumerate(table.blocks):
            assert (block is None) == (e in table.host), (rid, e)
