"""BROS policy on a real KV manager without a model: Algorithm 1's invariants every step,
merge-polling, the adaptive cap, late requests, replacement, and no deadlock under pressure."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cost_model import CostModel, PhaseFit
from engine.kv import BlockPool, KVCacheManager, TwoEndedBlocks
from engine.kv.copies import CopyKind
from engine.sampling import SamplingParams
from engine.scheduling import (
    SLO,
    BatchLimits,
    FinishReason,
    Request,
    RequestClass,
    Scheduler,
    make_policy,
)
from engine.scheduling.slack import deadline, merge_by_deadline

RT, BE = RequestClass.RT, RequestClass.BE
COST = CostModel(PhaseFit(1e-3, 1e-6, 4e-3), PhaseFit(5e-4, 1e-6, 4e-3), swap_bytes_per_s=1e9)
DEFAULT_SLO = SLO(0.05, 0.02)


def _sched(num_blocks=32, block_size=4, max_seqs=64, budget=64, base_cap=4, host_blocks=None, cost=COST):
    kv = KVCacheManager(
        BlockPool(num_blocks, enable_caching=False), block_size, bytes_per_token=64, host_blocks=host_blocks
    )
    policy = make_policy("bros", cost_model=cost, default_slo=DEFAULT_SLO, base_cap=base_cap)
    return Scheduler(kv, BatchLimits(max_seqs, budget), policy)


def _request(rid: str, n: int, out: int, cls: RequestClass, now: float, rng: random.Random) -> Request:
    return Request(
        rid, [rng.randrange(1000) for _ in range(n)], SamplingParams(max_tokens=out), arrival_time=now, req_class=cls
    )


def _live_slots(kv: KVCacheManager, requests) -> dict[int, str]:
    """Device slot -> owner for every computed token that is resident (its data must survive)."""
    owners = {}
    for r in requests:
        if not kv.holds(r):
            continue
        table = kv.table(r)
        for p in range(r.num_computed_tokens):
            e, o = divmod(p, kv.block_size)
            he = table.host.get(e)
            if table.blocks[e] is not None and (he is None or o < he.resident):
                owners[kv.slot(r, p)] = r.request_id
    return owners


def _claimed_slots(kv: KVCacheManager, requests) -> dict[int, str]:
    """Device slot -> request for every position reserved beyond the computed ones."""
    out = {}
    for r in requests:
        if kv.holds(r) and kv.is_resident(r):
            for p in range(r.num_computed_tokens, kv.table(r).claimed):
                out[kv.slot(r, p)] = r.request_id
    return out


def _check_step(s: Scheduler, batch, before: dict[int, str]) -> None:
    kv, d = s.kv, s.policy.last
    kv.check_invariants()
    assert len(batch.items) <= d.cap
    assert batch.num_tokens <= s.limits.max_num_batched_tokens
    # RT set: a prefix of the slack order, minus the ones replaced from its back
    k = len(d.rt_scheduled) + len(d.replaced)
    eligible = [r for r in d.rt_order if r not in d.skipped]  # skipped: no memory / admission held
    assert d.rt_scheduled + d.replaced[::-1] == eligible[:k]
    assert [it.request for it in batch.items if it.request.req_class is RT] == d.rt_scheduled
    # memory: scheduled requests are resident, and no two requests own one slot
    live = _live_slots(kv, s.requests.values())
    claimed = _claimed_slots(kv, s.requests.values())
    assert all(kv.is_resident(it.request) for it in batch.items)
    assert not set(live) & set(claimed)
    # lazy checkpointing: checkpointed slots are exactly the BE slots another request now takes
    # over (that are not moved away anyway), and nothing live is lost
    moved = {src for c in batch.copies for src in c.src_slots if c.kind is not CopyKind.H2D}
    checkpointed = [src for c in batch.copies if c.reason == "checkpoint" for src in c.src_slots]
    dropped = {r.request_id for r in batch.preempted}  # recompute-preempted: their KV is given up
    after = {**live, **claimed}  # restored requests own new slots too
    overwritten = {slot for slot, rid in after.items() if before.get(slot, rid) not in (rid, *dropped)}
    assert overwritten <= moved
    assert set(checkpointed) <= overwritten | {slot for slot in checkpointed if before[slot] in dropped}
    assert len(checkpointed) == len(set(checkpointed))
    moved_otherwise = {x for c in batch.copies if c.reason in ("swap_out", "relocate") for x in c.src_slots}
    be_overwritten = {slot for slot in overwritten - moved_otherwise if s.requests[before[slot]].req_class is BE}
    assert be_overwritten == {slot for slot in checkpointed if before[slot] not in dropped}


def _pretend_run(s: Scheduler, batch, now: float, rng: random.Random) -> None:
    for it in batch.items:
        r = it.request
        r.num_computed_tokens += it.num_new_tokens
        s.kv.commit(r)
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(rng.randrange(1000), None, now)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, FinishReason.LENGTH, now)


def _simulate(s: Scheduler, arrivals: list[tuple[int, Request]], rng: random.Random, max_steps=3000) -> int:
    """Run until every request finished; returns steps. Arrivals are (step index, request)."""
    now, step, pending = 0.0, 0, sorted(arrivals, key=lambda a: a[0])
    while pending or s.has_work():
        while pending and pending[0][0] <= step:
            r = pending.pop(0)[1]
            r.arrival_time = now
            s.add(r)
        before = _live_slots(s.kv, s.requests.values())
        batch = s.schedule(now)
        _check_step(s, batch, before)
        assert batch or not s.has_work() or pending, "nothing scheduled although requests wait: deadlock"
        dt = s.policy.last.estimate_s if batch else 0.001
        now += dt
        _pretend_run(s, batch, now, rng)
        s.step_done(batch, dt)
        step += 1
        assert step < max_steps, "no progress"
    return step


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6), num_blocks=st.integers(10, 24), host=st.sampled_from([None, 3, 0]), n=st.integers(2, 14)
)
def test_random_workloads_keep_invariants_and_finish(seed, num_blocks, host, n):
    rng = random.Random(seed)
    s = _sched(num_blocks=num_blocks, host_blocks=host)
    cap_tokens = (num_blocks - 1) * 4
    arrivals = []
    for i in range(n):
        cls = rng.choice([RT, BE])
        prompt = rng.randint(1, min(24, cap_tokens // 2))
        out = rng.randint(1, min(12, cap_tokens - prompt))
        arrivals.append((rng.randint(0, 30), _request(f"{cls.value}{i}", prompt, out, cls, 0.0, rng)))
    _simulate(s, arrivals, rng)
    assert not s.requests and s.kv.pool.num_free == s.kv.pool.capacity
    assert s.kv.host.num_free == s.kv.host.num_blocks and not s.kv.component(TwoEndedBlocks).shares


def test_pressure_exercises_checkpoint_restore_and_swap():
    rng = random.Random(3)
    seen = {"checkpoint": 0, "restore": 0, "swap_out": 0, "relocate": 0}
    for seed in range(30):
        rng = random.Random(seed)
        s = _sched(num_blocks=12)
        arrivals = [(0, _request(f"be{i}", rng.randint(6, 10), rng.randint(4, 10), BE, 0.0, rng)) for i in range(4)]
        arrivals += [
            (rng.randint(2, 12), _request(f"rt{i}", rng.randint(3, 9), rng.randint(3, 8), RT, 0.0, rng))
            for i in range(4)
        ]
        orig = s.schedule

        def counting(now=None, orig=orig):
            batch = orig(now)
            for c in batch.copies:
                seen[c.reason] += 1
            return batch

        s.schedule = counting
        _simulate(s, arrivals, rng)
    assert all(seen.values()), seen


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0.01, 1), st.booleans(), st.floats(0, 5)), max_size=30))
def test_merge_polling_equals_full_sort(specs):
    waiting, pending = [], []
    for i, (arrival, ttft, started, since) in enumerate(specs):
        r = Request(str(i), [1], SamplingParams(), arrival_time=arrival, slo=SLO(ttft, 0.2))
        if started:
            r.first_token_time = r.last_token_time = arrival + since
            pending.append(r)
        else:
            waiting.append(r)
    waiting.sort(key=lambda r: r.arrival_time)  # FIFO
    key = lambda r: deadline(r, DEFAULT_SLO)  # noqa: E731
    merged = merge_by_deadline(waiting, pending, DEFAULT_SLO)
    assert [key(r) for r in merged] == sorted(key(r) for r in waiting + pending)
    assert sorted(map(id, merged)) == sorted(map(id, waiting + pending))


def test_cap_doubles_without_rt_and_resets_on_rt_cost_failure():
    s = _sched(num_blocks=64, max_seqs=32, base_cap=2)
    rng = random.Random(0)
    for i in range(4):
        s.add(_request(f"be{i}", 4, 50, BE, 0.0, rng))
    caps = []
    for _step in range(6):
        batch = s.schedule(0.0)
        caps.append(s.policy.last.cap)
        _pretend_run(s, batch, 0.0, rng)
    assert caps == [2, 4, 8, 16, 32, 32]
    # an RT request whose slack is smaller than any step: the cost check fails -> back to base
    s.add(_request("rt", 4, 5, RT, 0.0, rng))
    s.add(_request("rt2", 4, 5, RT, 0.0, rng))
    s.schedule(DEFAULT_SLO.ttft_s - 0.009)  # ~9 ms of slack, one 4-token prefill costs ~8 ms
    assert s.policy.last.early_exit and s.policy.cap.value == 2


def test_late_request_does_not_stall_others():
    s = _sched(base_cap=8)
    rng = random.Random(1)
    late = _request("late", 8, 5, RT, 0.0, rng)
    s.add(late)
    fresh = [_request(f"rt{i}", 4, 5, RT, 1.0, rng) for i in range(3)]
    for r in fresh:
        s.add(r)
    batch = s.schedule(1.0)  # `late` is 1 s past its 50 ms TTFT
    d = s.policy.last
    assert d.rt_order[-1] is late and d.num_saveable == 3
    assert math.isfinite(d.budget_s) and d.budget_s > 0
    assert {it.request.request_id for it in batch.items} >= {"rt0", "rt1", "rt2"}


def test_late_prefill_is_chunked_to_its_target_and_the_head_always_runs():
    s = _sched()
    rng = random.Random(2)
    big = _request("big", 60, 3, RT, 0.0, rng)  # a 60-token prefill costs ~68 ms > the 50 ms TTFT
    s.add(big)
    batch = s.schedule(0.045)  # 5 ms of slack left: hopeless, so the budget is its plain 50 ms target
    d = s.policy.last
    assert d.num_saveable == 0 and d.budget_s == pytest.approx(0.05) and not d.forced
    n = batch.items[0].num_new_tokens
    assert 16 <= n < 60 and d.estimate_s <= 0.05  # the largest chunk that fits
    tiny = _request("tiny-slo", 40, 3, RT, 0.0, rng)
    tiny.slo = SLO(0.001, 0.001)  # not even a minimum chunk fits: it runs anyway (no stall)
    s2 = _sched()
    s2.add(tiny)
    batch = s2.schedule(0.0)
    assert [(it.request, it.num_new_tokens) for it in batch.items] == [(tiny, 16)] and s2.policy.last.forced


def test_be_replaces_least_urgent_rt_only_if_its_deadline_holds():
    # prefill: 1 ms/token + 4 ms; decode: 5 ms/row + 4 ms; one 4 ms base per step
    cost = CostModel(PhaseFit(1e-3, 0, 4e-3), PhaseFit(5e-3, 0, 4e-3), 1e9)
    tight = SLO(0.012, 0.012)  # budget 12 ms: two 2-token RT prefills (8 ms) + a BE decode (13 ms) do not fit

    def setup(second_slo: SLO):
        rng = random.Random(4)
        s = _sched(cost=cost)
        be = _request("be", 4, 10, BE, 0.0, rng)
        s.add(be)
        _pretend_run(s, s.schedule(0.0), 0.0, rng)  # be is prefilled: now a decode
        urgent, second = _request("urgent", 2, 5, RT, 0.0, rng), _request("second", 2, 5, RT, 0.0, rng)
        urgent.slo, second.slo = tight, second_slo
        s.add(urgent), s.add(second)
        return s, be, urgent, second

    s, be, urgent, relaxed = setup(SLO(10.0, 10.0))  # lots of slack: can wait a step
    batch = s.schedule(0.0)
    assert s.policy.last.replaced == [relaxed]
    assert [it.request for it in batch.items] == [urgent, be]
    assert s.kv.holds(relaxed)
    assert relaxed in s.running  # admitted: keeps its reservation for the next step
    s, be, urgent, second = setup(tight)  # deferring `second` would break its own deadline
    batch = s.schedule(0.0)
    assert s.policy.last.replaced == [] and [it.request for it in batch.items] == [urgent, second]


def test_policy_needs_a_cost_model():
    s = Scheduler(KVCacheManager(BlockPool(8), 4), BatchLimits(8, 32), make_policy("bros"))
    s.add(Request("a", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="cost model"):
        s.schedule(0.0)
    with pytest.raises(ValueError, match="TTFT and TPOT"):
        make_policy("bros", default_slo=SLO(None, 0.2))


@pytest.mark.parametrize("order, first", [("arrival", "be0"), ("checkpointed", "be1")])
def test_be_order_arrival_restores_the_oldest_and_the_papers_order_runs_the_least_checkpointed(order, first):
    """With one seat, the older BE request whose KV went to host runs first in arrival order
    (restored); the paper's order runs the one with fewer blocks on host."""
    rng = random.Random(0)
    kv = KVCacheManager(BlockPool(32, enable_caching=False), 4, bytes_per_token=64)
    policy = make_policy("bros", cost_model=COST, default_slo=DEFAULT_SLO, base_cap=2, be_order=order)
    s = Scheduler(kv, BatchLimits(2, 64), policy)
    be0, be1 = (_request(f"be{i}", 6, 8, BE, float(i), rng) for i in range(2))
    s.add(be0), s.add(be1)
    batch = s.schedule(0.0)
    assert {it.request.request_id for it in batch.items} == {"be0", "be1"}
    _pretend_run(s, batch, 0.01, rng)
    s.step_done(batch, 0.01)
    assert kv.swap_out(be0) and kv.num_host_blocks(be0) > kv.num_host_blocks(be1) == 0
    kv.take_copies()
    policy.cap.value = policy.cap.limit = 1  # one seat
    batch = s.schedule(0.02)
    assert [it.request.request_id for it in batch.items] == [first]
    assert kv.is_resident(be0) == (first == "be0")
    kv.check_invariants()


def test_unknown_be_order_is_refused():
    with pytest.raises(ValueError, match="be_order"):
        make_policy("bros", cost_model=COST, default_slo=DEFAULT_SLO, be_order="lifo")


def test_be_on_host_is_restored_by_swapping_out_be_behind_it():
    """An admitted BE request with KV on host and no free block for its restore swaps out a BE
    request behind it in BE order, instead of holding its device blocks idle while the newer
    one runs (docs/bros.md, "Why BE loses throughput": parked BE held ~12% of the pool). An RT
    request keeps the batch non-empty, so this is not the progress guarantee."""
    rng = random.Random(0)
    kv = KVCacheManager(BlockPool(9, enable_caching=False), 4, bytes_per_token=64)
    policy = make_policy("bros", cost_model=COST, default_slo=DEFAULT_SLO, base_cap=4, min_be_share=0)
    s = Scheduler(kv, BatchLimits(4, 64), policy)
    rt0 = _request("rt0", 2, 50, RT, 0.0, rng)
    be0, be1 = (_request(f"be{i}", 12, 8, BE, float(i), rng) for i in range(2))
    for r in (rt0, be0, be1):
        s.add(r)
    batch = s.schedule(0.0)
    assert {it.request for it in batch.items} == {rt0, be0, be1}
    _pretend_run(s, batch, 0.01, rng)
    s.step_done(batch, 0.01)
    assert kv.swap_out(be0)  # its KV to host, as RT pressure would have done
    kv.take_copies()
    held = kv.pool.allocate(kv.pool.num_free - 1)  # memory taken elsewhere: one block left
    batch = s.schedule(0.011)
    assert {it.request for it in batch.items} == {rt0, be0}  # be0 restored: 3 blocks + 1 to grow
    assert batch.swapped_out == [be1] and kv.is_resident(be0) and kv.num_host_blocks(be1) == 3
    assert batch.preempted == []  # a swap, never a drop, outside the progress guarantee
    kv.pool.release(held)
    kv.check_invariants()
