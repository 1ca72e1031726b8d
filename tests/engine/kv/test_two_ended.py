"""The two-ended blocks component (BROS) on the KV core, without a policy: stealing, lazy
checkpointing, relocation, restore and swap keep every token's data, its invariants hold
after every operation, and a rollback restores it exactly (preemption table included)."""

from __future__ import annotations

from functools import partial

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv import BlockPool, KVCacheManager, TwoEndedBlocks
from engine.kv.copies import CopyKind
from engine.sampling import SamplingParams
from engine.scheduling import Request

BS = 4


def _kv(num_blocks: int, host_blocks: int | None = None, lend: bool = True) -> tuple[KVCacheManager, TwoEndedBlocks]:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), BS, bytes_per_token=8, host_blocks=host_blocks)
    is_be = lambda r: r.request_id.startswith("be")  # noqa: E731
    return kv, kv.attach(partial(TwoEndedBlocks, is_be=is_be, lend_rt_ends=lend))


def _req(rid: str, n: int = 64) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=4))


def _run(kv, mem, r: Request, n: int) -> bool:
    """Schedule n tokens of r and run the step: copies first, then the forward pass's writes."""
    if not kv.allocate(r, n):
        return False
    mem.run(kv.take_copies())
    mem.write(kv, r.request_id, r.num_computed_tokens, r.num_computed_tokens + n)
    r.num_computed_tokens += n
    return True


def test_rt_steals_a_be_end_and_checkpoints_only_what_it_overwrites(slot_memory):
    kv, ends = _kv(4)  # 3 usable blocks
    mem = slot_memory()
    be, rt = _req("be0"), _req("rt0")
    assert _run(kv, mem, be, 6)  # two BE blocks: full, and 2 of 4 slots
    assert _run(kv, mem, rt, 4)  # the last free block
    assert _run(kv, mem, rt, 1)  # no free block: the right end of the emptier BE block
    stolen = kv.table(be).ids[1]
    assert kv.table(rt).ids[1] == stolen and kv.table(rt).rev[1] and ends.num_stealable == 1
    assert kv.slot(rt, 4) == stolen * BS + BS - 1
    assert kv.is_resident(be)  # the middle was empty: nothing checkpointed yet
    assert kv.allocate(rt, 2)  # rt's offsets 1-2 reach BE offset 1: exactly that slot goes to host
    (copy,) = kv.take_copies()
    assert copy.kind is CopyKind.D2H and copy.reason == "checkpoint" and copy.src_slots == (stolen * BS + 1,)
    share = ends.shares[stolen]
    assert list(share.checkpointed(BS)) == [s - stolen * BS for s in copy.src_slots]
    assert not kv.is_resident(be) and kv.host_tokens(be) == 1 and kv.num_host_blocks(be) == 1
    mem.run([copy])
    mem.write(kv, "rt0", 5, 7)
    rt.num_computed_tokens = 7
    mem.check_resident(kv, "rt0", 7)
    assert not kv.publishable(kv.table(be), 0)  # a BE block: its right end may still be taken
    assert kv.publishable(kv.table(rt), 0) and not kv.publishable(kv.table(rt), 1)
    kv.check_invariants()
    kv.free(rt)  # the BE end keeps the block; then a restore moves BE to a fresh block
    assert ends.shares[stolen].rt_id is None and kv.restore(be)
    copies = kv.take_copies()
    assert [(c.kind, c.reason) for c in copies] == [(CopyKind.D2D, "relocate"), (CopyKind.H2D, "restore")]
    mem.run(copies)
    mem.check_resident(kv, "be0", 6)
    kv.check_invariants()


def test_be_leaving_a_shared_block_leaves_it_to_the_rt_end(slot_memory):
    kv, ends = _kv(3)  # 2 usable blocks
    mem = slot_memory()
    be, rt = _req("be0"), _req("rt0")
    assert _run(kv, mem, be, 5)
    assert _run(kv, mem, rt, 2)  # steals the right end of BE's second block
    block = kv.table(rt).ids[0]
    kv.free(be)
    assert not ends.shares and kv.table(rt).ids[0] == block and kv.table(rt).rev[0]
    assert kv.pool.blocks[block].ref_count == 1
    mem.check_resident(kv, "rt0", 2)
    kv.check_invariants()


def test_be_fills_the_free_end_of_an_rt_block_and_rt_growth_checkpoints_it(slot_memory):
    kv, ends = _kv(4)  # 3 usable blocks
    mem = slot_memory()
    be, rt = _req("be0"), _req("rt0")
    assert _run(kv, mem, rt, 5)  # two RT blocks: full, and 1 of 4 slots
    assert _run(kv, mem, be, 4)  # the last free block, full
    lent = kv.table(rt).ids[1]
    assert _run(kv, mem, be, 1)  # no free block: the right end of RT's partly filled block
    assert kv.table(be).ids[1] == lent and kv.table(be).rev[1] and not kv.table(rt).rev[1]
    assert kv.slot(be, 4) == lent * BS + BS - 1 and kv.pool.blocks[lent].ref_count == 2
    share = ends.shares[lent]
    assert share.be_rev and share.rt_id == "rt0" and share.rt_entry == 1 and ends.num_stealable == 1
    assert _run(kv, mem, be, 2)  # grows towards the RT end into the empty middle: no copy
    assert kv.is_resident(be) and not kv.take_copies()
    assert kv.allocate(rt, 1)  # RT offset 1 meets BE offset 2 (slot 1): exactly that slot goes to host
    (copy,) = kv.take_copies()
    assert copy.kind is CopyKind.D2H and copy.reason == "checkpoint" and copy.src_slots == (lent * BS + 1,)
    assert share.checkpointed(BS) == [s - lent * BS for s in copy.src_slots]
    assert kv.host_tokens(be) == 1 and not kv.publishable(kv.table(rt), 1)
    mem.run([copy])
    mem.write(kv, "rt0", 5, 6)
    rt.num_computed_tokens = 6
    mem.check_resident(kv, "rt0", 6)
    kv.check_invariants()
    assert not kv.restore(be)  # no free block to restore into
    kv.free(rt)  # the BE end keeps the block; a restore moves it to a fresh forward block
    assert kv.pool.blocks[lent].ref_count == 1 and share.rt_id is None and kv.restore(be)
    copies = kv.take_copies()
    assert [(c.kind, c.reason) for c in copies] == [(CopyKind.D2D, "relocate"), (CopyKind.H2D, "restore")]
    assert copies[0].src_slots == (lent * BS + 3, lent * BS + 2)  # BE offsets 0, 1 of the reversed end
    mem.run(copies)
    mem.check_resident(kv, "be0", 7)
    assert not kv.table(be).rev[1]
    kv.check_invariants()


def test_be_takes_an_rt_end_only_for_its_last_block_and_only_when_enabled(slot_memory):
    kv, _ = _kv(4)
    mem = slot_memory()
    be, rt = _req("be0"), _req("rt0")
    assert _run(kv, mem, rt, 5) and _run(kv, mem, be, 4)
    assert not kv.allocate(be, 4)  # a whole block never fits a partly filled one
    assert not kv.allocate(be, 3 + BS)  # nor a growth whose middle entry would need one
    assert kv.allocate(be, 3)  # the last 3 slots do
    kv, _ = _kv(4, lend=False)
    be, rt = _req("be0"), _req("rt0")
    assert _run(kv, mem, rt, 5) and _run(kv, mem, be, 4)
    assert not kv.allocate(be, 1)
    kv.check_invariants()


def test_a_freed_rt_end_can_be_stolen_back_from_the_other_side(slot_memory):
    kv, ends = _kv(4)
    mem = slot_memory()
    be, rt, rt1 = _req("be0"), _req("rt0"), _req("rt1")
    assert _run(kv, mem, rt, 5) and _run(kv, mem, be, 5)
    lent = kv.table(be).ids[1]
    kv.free(rt)  # one block freed; the lent one stays with BE's reversed entry
    assert _run(kv, mem, rt1, 4)  # the free block
    assert _run(kv, mem, rt1, 1)  # then the free (left) end of BE's reversed block, forward
    assert kv.table(rt1).ids[1] == lent and not kv.table(rt1).rev[1] and ends.shares[lent].rt_id == "rt1"
    assert _run(kv, mem, rt1, 2) and not kv.take_copies()  # slots 1-2 were empty
    mem.check_resident(kv, "be0", 5)
    assert kv.allocate(rt1, 1)  # RT offset 3 takes slot 3, BE offset 0: checkpointed
    (copy,) = kv.take_copies()
    assert copy.reason == "checkpoint" and copy.src_slots == (lent * BS + 3,)
    mem.run([copy])
    mem.write(kv, "rt1", 7, 8)
    rt1.num_computed_tokens = 8
    assert not kv.is_resident(be) and lent not in ends.shares
    mem.check_resident(kv, "rt1", 8)
    kv.check_invariants()


_KINDS = ["alloc", "alloc", "alloc", "free", "swap", "restore"]
_ops = st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, 3), st.integers(1, 7)), max_size=30)
_NAMES = ["be0", "be1", "rt0", "rt1"]


def _apply(kv, requests, ops, mem=None) -> None:
    for kind, i, n in ops:
        r = requests[i]
        if kind == "alloc" and kv.is_resident(r):
            if mem is not None:
                _run(kv, mem, r, n)
            elif kv.allocate(r, n):
                r.num_computed_tokens += n
        elif kind == "free":
            kv.free(r)
            r.num_computed_tokens = 0
        elif kind == "swap" and kv.holds(r) and kv.is_resident(r):
            kv.swap_out(r)
        elif kind == "restore" and not kv.is_resident(r):
            kv.restore(r)
        if mem is not None:
            mem.run(kv.take_copies())
            for x in requests:
                if kv.holds(x) and kv.is_resident(x):
                    mem.check_resident(kv, x.request_id, x.num_computed_tokens)
        kv.check_invariants()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, num_blocks=st.integers(3, 10), host=st.integers(0, 6))
def test_random_operations_keep_every_token_and_the_invariants(slot_memory, ops, num_blocks, host):
    kv, _ = _kv(num_blocks, host)
    _apply(kv, [_req(n) for n in _NAMES], ops, slot_memory())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=_ops, tentative=_ops, num_blocks=st.integers(3, 10), host=st.integers(0, 6))
def test_rollback_restores_tables_pools_and_the_preemption_table(kv_fingerprint, before, tentative, num_blocks, host):
    kv, _ = _kv(num_blocks, host)
    requests = [_req(n) for n in _NAMES]
    _apply(kv, requests, before)
    snapshot, progress = kv_fingerprint(kv), [r.num_computed_tokens for r in requests]
    mark = kv.undo.mark()
    _apply(kv, requests, tentative)
    kv.undo.rollback(mark)
    kv.undo.settle()
    for r, n in zip(requests, progress):
        r.num_computed_tokens = n
    assert kv_fingerprint(kv) == snapshot
    kv.check_invariants()
