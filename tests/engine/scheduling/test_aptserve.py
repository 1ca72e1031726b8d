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


@pytest.mark.parametrize("rho", [1e-9, 1e3])
def test_aptserve_keeps_fcfs_tokens_and_picks_hidden_on_mha(rho, tiny_model_dir):
    """12 blocks for six requests: the packing preempts and converts; a tiny penalty makes
    HIDDEN pay on MHA (OPT), a huge one never does."""
    path = tiny_model_dir("opt")
    reference, _, _ = _run(path, "fcfs", num_blocks=64)
    tokens, engine, forms = _run(path, "aptserve", aptserve_rho=rho)
    assert tokens == reference
    assert engine.stats.preemptions > 0  # the pool really was the bottleneck
    if rho < 1:
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
    scheduler = Scheduler(kv, BatchLimits(8, 512, True), AptServePolicy(rho=10.0))
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
