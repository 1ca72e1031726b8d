"""The aptserve policy in the engine (float32, tiny models): whatever it packs, preempts and
converts, every request's greedy tokens are FCFS's; it picks HIDDEN under memory pressure
on an MHA model when the penalty is small, never on a GQA model where HIDDEN saves nothing,
and the KV manager's invariants hold after every step."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.scheduling import CacheForm

STEPS = 10


def _run(path, policy: str, **config) -> tuple[dict, LLMEngine, set]:
    config = dict(dtype="float32", num_blocks=12, block_size=16, max_num_batched_tokens=64) | config
    engine = LLMEngine(EngineConfig(model=str(path), policy=policy, **config))
    rng = random.Random(7)
    for i in range(6):
        prompt = [rng.randrange(49152) for _ in range(rng.randrange(10, 40))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(6)}
    forms: set = set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        forms |= {r.cache_form for r in engine.scheduler.running}
        engine.kv.check_invariants()
    return tokens, engine, forms


def _cost_model_file(tmp_path) -> str:
    """A hand-made profile (what prices a re-prefill: 0.1 ms per token), so the engine does not
    profile the tiny model at start."""
    from engine.cost_model import CostModel, PhaseFit

    path = tmp_path / "cost.json"
    CostModel(PhaseFit(1e-4, 1e-8, 1e-3), PhaseFit(1e-4, 1e-8, 1e-3), 1e9).save(path)
    return str(path)


@pytest.mark.parametrize(
    ("rho", "price_switches", "hidden"),
    [(1e-9, True, True), (0.0, False, True), (1e-9, False, False), (1e3, True, False), (1e3, False, False)],
)
def test_aptserve_keeps_fcfs_tokens_and_picks_hidden_on_mha(rho, price_switches, hidden, tiny_model_dir, tmp_path):
    """12 blocks for six requests: the packing preempts and converts. HIDDEN is picked on MHA
    (OPT) where the next decode iteration keeps it: a free rebuild, or a tiny penalty with
    conversions priced; never with the paper's values and any ρ > 0 (a just-served request is
    worth ~0 there, less than any penalty), never with a huge penalty."""
    path = tiny_model_dir("opt")
    reference, _, _ = _run(path, "fcfs", num_blocks=64)
    tokens, engine, forms = _run(
        path,
        "aptserve",
        aptserve_rho=rho,
        aptserve_price_switches=price_switches,
        cost_model_path=_cost_model_file(tmp_path),
    )
    assert tokens == reference
    assert engine.stats.preemptions > 0  # the pool really was the bottleneck
    if hidden:
        assert CacheForm.HIDDEN in forms and engine.scheduler.policy.hidden_chosen > 0
    else:
        assert forms == {CacheForm.KV} and engine.scheduler.policy.hidden_chosen == 0


def test_aptserve_never_picks_hidden_where_it_saves_nothing(tiny_model_dir):
    path = tiny_model_dir("llama")  # GQA: a hidden row is as large as K+V
    reference, _, _ = _run(path, "fcfs", num_blocks=64)
    tokens, engine, forms = _run(path, "aptserve", aptserve_rho=1e-9)
    assert tokens == reference
    assert forms == {CacheForm.KV} and engine.scheduler.policy.hidden_chosen == 0


def test_aptserve_refuses_a_forced_form(tiny_model_dir):
    with pytest.raises(ValueError, match="cache_form='auto'"):
        LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir("opt")), dtype="float32", num_blocks=12, policy="aptserve", cache_form="kv"
            )
        )


def test_a_prefill_iteration_that_admits_nothing_decodes_instead():
    """Regression (found in the simulator): a waiting request whose KV form does not fit the
    free blocks and whose HIDDEN form fits but is worth less than its penalty made every
    prefill iteration admit nothing, and the worker idled with requests running. Now only an
    option the knapsack would take counts as fitting, and an empty prefill decodes instead."""
    from engine.bookkeeping import EngineStats, StepBookkeeping
    from engine.kv import BlockPool, KVCacheManager
    from engine.kv.hidden import HiddenBlocks, HiddenLayout
    from engine.scheduling import BatchLimits, Request, Scheduler
    from engine.scheduling.aptserve import AptServePolicy

    kv = KVCacheManager(BlockPool(24), 16)
    kv.attach(HiddenBlocks.factory(HiddenLayout(512, 64, 16, 16, 24)))  # MHA: ratio 1/2
    scheduler = Scheduler(kv, BatchLimits(8, 512, True), AptServePolicy(rho=10.0, price_switches=False))
    book = StepBookkeeping(scheduler, EngineStats())
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    running = Request("a", list(range(160)), params, arrival_time=0.0)
    scheduler.add(running)
    batch = scheduler.schedule(0.0)
    assert [it.request for it in batch.items] == [running]
    book.advance(batch.items)
    book.append_token(running, 7, None, 4.99)
    late = Request("b", list(range(1000, 1300)), params, arrival_time=0.5)  # 19 KV blocks, 10 HIDDEN
    scheduler.add(late)
    assert kv.pool.num_free < 19 <= kv.pool.capacity
    batch = scheduler.schedule(5.0)  # b has waited 4.5 s, a 0.01 s: a prefill iteration by pending time
    assert [(it.request, it.num_new_tokens) for it in batch.items] == [(running, 1)]
    assert late in scheduler.waiting and not batch.preempted
    kv.check_invariants()


def _two_requests(price_switches: bool, withhold_dropped_hidden: bool = True):
    """A pool of 23 usable blocks (MHA, HIDDEN at half): `a` decodes in KV (11 blocks), `b`
    waited 0.4 s and only fits in HIDDEN (10 of its 19 blocks). Up to the prefill iteration at
    5.0 s; returns that batch too."""
    from engine.bookkeeping import EngineStats, StepBookkeeping
    from engine.cost_model import CostModel, PhaseFit
    from engine.kv import BlockPool, KVCacheManager
    from engine.kv.hidden import HiddenBlocks, HiddenLayout
    from engine.scheduling import BatchLimits, Request, Scheduler
    from engine.scheduling.aptserve import AptServePolicy

    kv = KVCacheManager(BlockPool(24), 16)
    kv.attach(HiddenBlocks.factory(HiddenLayout(512, 64, 16, 16, 24)))
    # a re-prefill costs 1 ms per token: 0.3 s for b's 300 tokens
    cost = CostModel(PhaseFit(1e-3, 0.0, 0.01), PhaseFit(1e-4, 0.0, 0.01), 1e9)
    policy = AptServePolicy(
        rho=0.005, cost_model=cost, price_switches=price_switches, withhold_dropped_hidden=withhold_dropped_hidden
    )
    scheduler = Scheduler(kv, BatchLimits(8, 512, True), policy)
    book = StepBookkeeping(scheduler, EngineStats())
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    a = Request("a", list(range(160)), params, arrival_time=0.0)
    scheduler.add(a)
    book.advance(scheduler.schedule(0.0).items)
    book.append_token(a, 7, None, 4.99)
    b = Request("b", list(range(1000, 1300)), params, arrival_time=4.6)
    scheduler.add(b)
    batch = scheduler.schedule(5.0)  # b has waited 0.4 s: a prefill iteration by pending time
    return scheduler, policy, book, a, b, batch


def test_priced_switches_keep_the_hidden_request_they_admit():
    """Priced: b is admitted in HIDDEN at 5.0 s (its only fitting form; worth 0.4 - 0.19 s),
    and the next decode iteration (5.05 s) keeps it: b's value (0.05 s since its token) is below
    its HIDDEN penalty (2 x 0.005 x 19 = 0.19 s), but staying HIDDEN also avoids its re-prefill
    (2 x 0.3 s), so both decode."""
    scheduler, policy, book, a, b, batch = _two_requests(price_switches=True)
    assert [it.request for it in batch.items] == [b] and b.cache_form is CacheForm.HIDDEN
    book.advance(batch.items)
    book.append_token(b, 7, None, 5.0)
    batch = scheduler.schedule(5.05)
    assert {it.request for it in batch.items} == {a, b} and not batch.preempted
    assert b.cache_form is CacheForm.HIDDEN
    scheduler.kv.check_invariants()


def test_no_hidden_admission_the_next_decode_iteration_would_drop():
    """The paper's values: admitted in HIDDEN at 5.0 s, b would be worth ~0 at the next decode
    iteration (it has just got its token), below its penalty, and its KV form does not fit
    beside a: it would be preempted right away and its prefill wasted (what every HIDDEN row
    was on the CPU engine). So b is not offered HIDDEN, stays waiting, and a decodes."""
    scheduler, policy, book, a, b, batch = _two_requests(price_switches=False)
    assert [(it.request, it.num_new_tokens) for it in batch.items] == [(a, 1)] and not batch.preempted
    assert b in scheduler.waiting and policy.hidden_chosen == 0 and policy.hidden_withheld > 0
    after = policy.hidden_kept_next_decode(b, 19, 10, 2, scheduler.kv.pool.capacity)
    assert not after  # what the next decode iteration would do with b in HIDDEN: drop it
    scheduler.kv.check_invariants()


def test_the_withheld_hidden_admission_was_the_one_dropped_next():
    """Mutation check of the rule above, through its switch: without it (the paper's rule,
    `withhold_dropped_hidden=False`, the ablation of docs/aptserve.md) b is admitted in HIDDEN
    and preempted by the very next decode iteration."""
    scheduler, policy, book, a, b, batch = _two_requests(price_switches=False, withhold_dropped_hidden=False)
    assert policy.hidden_withheld == 0
    assert [it.request for it in batch.items] == [b] and b.cache_form is CacheForm.HIDDEN
    book.advance(batch.items)
    book.append_token(b, 7, None, 5.0)
    batch = scheduler.schedule(5.05)
    assert [it.request for it in batch.items] == [a] and batch.preempted == [b]
    scheduler.kv.check_invariants()


def test_priced_switches_need_a_cost_model():
    from engine.kv import BlockPool, KVCacheManager
    from engine.kv.hidden import HiddenBlocks, HiddenLayout
    from engine.scheduling import BatchLimits, Request, Scheduler
    from engine.scheduling.aptserve import AptServePolicy

    kv = KVCacheManager(BlockPool(24), 16)
    kv.attach(HiddenBlocks.factory(HiddenLayout(512, 64, 16, 16, 24)))
    scheduler = Scheduler(kv, BatchLimits(8, 512, True), AptServePolicy(rho=0.01, price_switches=True))
    scheduler.add(Request("a", list(range(40)), SamplingParams(max_tokens=4), arrival_time=0.0))
    with pytest.raises(ValueError, match="price_switches=False"):
        scheduler.schedule(0.0)


@pytest.mark.parametrize("counts_demoted", [True, False])
def test_the_penalty_scale_with_and_without_the_demoted(counts_demoted):
    """The paper's code takes N of the penalty `N·ρ·m̄` less the requests past their SLO
    (`penalty_counts_demoted=False`); ours counts them. `b` (waited 0.4 s, fits only in HIDDEN:
    10 of 19 blocks) beside `a` and three requests 5 s late: with N = 2 its HIDDEN option is
    on the hull (0.4 s >= 2·2·0.005·19 = 0.38 s) and it is admitted in HIDDEN; with N = 5 it is
    not (0.95 s) and `a` decodes. The late ones fit only in HIDDEN too and are worth ~0 either way."""
    from engine.bookkeeping import EngineStats, StepBookkeeping
    from engine.kv import BlockPool, KVCacheManager
    from engine.kv.hidden import HiddenBlocks, HiddenLayout
    from engine.scheduling import BatchLimits, Request, Scheduler
    from engine.scheduling.aptserve import AptServePolicy

    kv = KVCacheManager(BlockPool(24), 16)
    kv.attach(HiddenBlocks.factory(HiddenLayout(512, 64, 16, 16, 24)))
    policy = AptServePolicy(rho=0.005, withhold_dropped_hidden=False, penalty_counts_demoted=counts_demoted)
    scheduler = Scheduler(kv, BatchLimits(8, 512, True), policy)
    book = StepBookkeeping(scheduler, EngineStats())
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    a = Request("a", list(range(160)), params, arrival_time=0.0)
    scheduler.add(a)
    book.advance(scheduler.schedule(0.0).items)
    book.append_token(a, 7, None, 4.99)
    late = [Request(f"late{i}", list(range(2000, 2300)), params, arrival_time=0.0) for i in range(3)]
    b = Request("b", list(range(1000, 1300)), params, arrival_time=4.6)
    for r in (*late, b):
        scheduler.add(r)
    batch = scheduler.schedule(5.0)
    if counts_demoted:
        assert [it.request for it in batch.items] == [a] and policy.hidden_chosen == 0
    else:
        assert [it.request for it in batch.items] == [b] and b.cache_form is CacheForm.HIDDEN
        assert policy.hidden_chosen == 1
    assert all(r in scheduler.waiting for r in late) and not batch.preempted
    kv.check_invariants()
