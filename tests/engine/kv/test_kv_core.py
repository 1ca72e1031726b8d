"""The KV manager's core: one allocation path through the undo log (rolled back under FCFS),
moves between device and host that keep every token, and the component contract (ownership,
rollback of a component's partial growth, publishing, detaching, invariants)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cost_model import CostModel, PhaseFit
from engine.kv import BlockPool, BlockTable, KVCacheManager, KVComponent, TwoEndedBlocks
from engine.kv.copies import CopyKind
from engine.sampling import SamplingParams
from engine.scheduling import BatchLimits, Request, Scheduler, make_policy

BS = 4


def _req(rid: str, n: int = 64) -> Request:
    return Request(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=4))


def _apply(kv: KVCacheManager, requests: list[Request], ops) -> None:
    """Run (kind, request index, tokens) ops the way a policy and the engine would, checking
    the manager's invariants after each."""
    for kind, i, n in ops:
        r = requests[i]
        if kind == "alloc" and kv.is_resident(r) and r.num_computed_tokens + n <= r.num_tokens:
            if kv.allocate(r, n):
                r.num_computed_tokens += n  # the step ran
                kv.commit(r)
        elif kind == "free":
            kv.free(r)
            r.num_computed_tokens = 0
        elif kind == "swap" and kv.holds(r) and kv.is_resident(r):
            kv.swap_out(r)
        elif kind == "restore" and kv.holds(r) and not kv.is_resident(r):
            kv.restore(r)
        kv.check_invariants()


_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free", "swap", "restore"]), st.integers(0, 3), st.integers(1, 9)),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=_ops, tentative=_ops, num_blocks=st.integers(3, 14), host=st.integers(0, 6))
def test_forward_allocations_roll_back_through_the_undo_log(kv_fingerprint, before, tentative, num_blocks, host):
    """FCFS's allocations, frees and moves are logged like BROS's: everything done after a
    mark is undone exactly (tables, reference counts, free-list order, host space, copies)."""
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), BS, bytes_per_token=8, host_blocks=host)
    requests = [_req(f"r{i}") for i in range(4)]
    _apply(kv, requests, before)
    snapshot, progress = kv_fingerprint(kv), [r.num_computed_tokens for r in requests]
    mark = kv.undo.mark()
    _apply(kv, requests, tentative)
    kv.undo.rollback(mark)
    kv.undo.settle()
    for r, n in zip(requests, progress):  # request progress is the policy's to undo
        r.num_computed_tokens = n
    assert kv_fingerprint(kv) == snapshot
    kv.check_invariants()
    _apply(kv, requests, before)  # and the manager works on from there


def test_failed_allocation_changes_nothing_without_a_mark(kv_fingerprint):
    kv = KVCacheManager(BlockPool(6), BS)
    a, b = _req("a"), _req("b")
    assert kv.allocate(a, 9)
    a.num_computed_tokens = 9
    snapshot = kv_fingerprint(kv)
    assert not kv.allocate(b, 4 * BS)  # 4 blocks, 2 free
    assert not kv.allocate(a, 3 * BS)  # 3 more blocks needed, 2 free
    assert kv_fingerprint(kv) == snapshot and not kv.holds(b) and not kv.undo.active


def test_allocate_contract_errors():
    kv = KVCacheManager(BlockPool(8), BS)
    a = _req("a")
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.commit(a)
    prefix, _ = kv.match_prefix(_req("b"))
    with pytest.raises(ValueError, match="prefix-cache hits are taken on admission"):
        kv.allocate(a, 1, prefix)
    assert kv.swap_out(a)
    with pytest.raises(RuntimeError, match="must be restored"):
        kv.allocate(a, 1)


def test_forward_swap_out_and_restore_keep_every_token(slot_memory):
    kv = KVCacheManager(BlockPool(5), BS, bytes_per_token=8)
    mem = slot_memory()
    a, b = _req("a"), _req("b")
    assert kv.allocate(a, 11)
    mem.write(kv, "a", 0, 11)
    a.num_computed_tokens = 11
    assert kv.allocate(a, 1)  # reserved for a step that does not run: swap-out drops nothing computed
    assert kv.swap_out(a)
    copies = kv.take_copies()
    assert [c.kind for c in copies] == [CopyKind.D2H] * 3 and sum(c.num_slots for c in copies) == 11
    assert kv.pool.num_free == kv.pool.capacity and kv.num_host_blocks(a) == 3 and kv.host_tokens(a) == 11
    mem.run(copies)
    assert kv.allocate(b, 4 * BS)  # b overwrites every block a had
    mem.write(kv, "b", 0, 4 * BS)
    assert not kv.restore(a)  # no free block: nothing changes
    kv.free(b)
    assert kv.restore(a) and kv.is_resident(a)
    restores = kv.take_copies()
    assert [c.kind for c in restores] == [CopyKind.H2D] * 3
    mem.run(restores)
    mem.check_resident(kv, "a", 11)
    assert kv.host.num_free == kv.host.num_blocks
    kv.check_invariants()


# -- the component contract, through a small component written against it -----------------------


class RightFilled(KVComponent):
    """Owns requests whose id starts with "r" and fills every block from the right end."""

    name = "right-filled"

    def __init__(self, ledger) -> None:
        super().__init__(ledger)
        self.detached: list[tuple[str, int]] = []  # its own state, logged like any other

    def owns(self, request) -> bool:
        return request.request_id.startswith("r")

    def grow(self, request, table: BlockTable, target: int) -> bool:
        while len(table) * self.ledger.block_size < target:
            if not self.ledger.pool.num_free:
                return False  # halfway: the core rolls back the blocks taken so far
            self.ledger.append_entry(table, self.ledger.take_free_block(), rev=True)
        self.ledger.set_claimed(table, target)
        return True

    def restore_entry(self, request, table: BlockTable, entry: int) -> bool:
        if not self.ledger.pool.num_free:
            return False
        self.ledger.set_entry(table, entry, self.ledger.take_free_block(), rev=True)
        return True

    def on_detach(self, rid: str, table: BlockTable, entry: int) -> None:
        self.detached.append((rid, entry))
        self.ledger.undo.push(self.detached.pop)

    def check_invariants(self) -> None:
        for rid, table in self.ledger.tables.items():
            if table.owner is self:
                assert all(table.rev[e] for e, b in enumerate(table.blocks) if b is not None), rid


def test_components_own_their_requests_and_others_stay_forward():
    kv = KVCacheManager(BlockPool(12), BS)
    right = kv.attach(RightFilled)
    owned, plain = _req("r1"), _req("p1")
    assert kv.allocate(owned, 6) and kv.allocate(plain, 6)
    assert kv.table(owned).owner is right and kv.table(plain).owner is None
    assert kv.table(owned).rev == [True, True] and kv.table(plain).rev == [False, False]
    block = kv.table(owned).ids[0]
    assert [kv.slot(owned, p) for p in range(4)] == [block * BS + 3, block * BS + 2, block * BS + 1, block * BS]
    for r in (owned, plain):
        r.num_computed_tokens = 6
        kv.commit(r)
    assert kv.table(owned).blocks[0].block_hash is None  # reversed: never served by hash
    assert kv.table(plain).blocks[0].block_hash is not None
    kv.check_invariants()
    kv.free(owned)
    assert right.detached == [("r1", 1), ("r1", 0)]  # tail first, as the core releases


def test_core_rolls_back_a_component_that_fails_halfway(kv_fingerprint):
    kv = KVCacheManager(BlockPool(4), BS)
    right = kv.attach(RightFilled)
    assert kv.allocate(_req("r0"), 2)
    snapshot = kv_fingerprint(kv)
    assert not kv.allocate(_req("r1"), 3 * BS)  # takes the 2 free blocks, then fails
    assert kv_fingerprint(kv) == snapshot and not kv.undo.active and right.detached == []


def test_owned_swap_out_and_restore_use_the_components_placement(slot_memory):
    kv = KVCacheManager(BlockPool(6), BS, bytes_per_token=8)
    kv.attach(RightFilled)
    mem = slot_memory()
    r = _req("r1")
    assert kv.allocate(r, 7)
    mem.write(kv, "r1", 0, 7)
    r.num_computed_tokens = 7
    assert kv.swap_out(r)
    mem.run(kv.take_copies())
    p = _req("p1")
    assert kv.allocate(p, 5 * BS)  # p overwrites every block r had
    mem.write(kv, "p1", 0, 5 * BS)
    kv.free(p)
    assert kv.restore(r) and kv.table(r).rev == [True, True]
    mem.run(kv.take_copies())
    mem.check_resident(kv, "r1", 7)
    kv.check_invariants()


def test_invariants_check_owned_and_unowned_tables():
    kv = KVCacheManager(BlockPool(8), BS)
    kv.attach(RightFilled)
    owned, plain = _req("r1"), _req("p1")
    assert kv.allocate(owned, 4) and kv.allocate(plain, 4)
    kv.check_invariants()
    kv.table(plain).rev[0] = True  # a forward table with a reversed entry: the core objects
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv.table(plain).rev[0] = False
    kv.table(owned).rev[0] = False  # the component's own rule
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_attach_contract():
    kv = KVCacheManager(BlockPool(8), BS)
    right = kv.attach(RightFilled)
    assert kv.component(RightFilled) is right and kv.components == (right,)
    with pytest.raises(ValueError, match="already attached"):
        kv.attach(RightFilled)
    with pytest.raises(LookupError, match="no TwoEndedBlocks component"):
        kv.component(TwoEndedBlocks)
    assert kv.allocate(_req("p1"), 1)
    with pytest.raises(RuntimeError, match="before the first allocation"):
        KVCacheManager.attach(kv, lambda ledger: TwoEndedBlocks(ledger, is_be=lambda r: False))


def test_scheduler_attaches_the_policys_components():
    cost = CostModel(PhaseFit(1e-3, 1e-6, 4e-3), PhaseFit(5e-4, 1e-6, 4e-3), swap_bytes_per_s=1e9)
    limits = BatchLimits(8, 64)
    bros = Scheduler(KVCacheManager(BlockPool(8), BS), limits, make_policy("bros", cost_model=cost))
    assert [type(c) for c in bros.kv.components] == [TwoEndedBlocks]
    for name in ("fcfs", "rr"):
        assert Scheduler(KVCacheManager(BlockPool(8), BS), limits, make_policy(name)).kv.components == ()
