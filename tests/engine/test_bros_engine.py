"""BROS in the real engine on a tiny random model: greedy tokens are identical to an
ample-memory FCFS run under heavy sharing, lazy checkpointing, restores and swapping, with
Algorithm 1's invariants checked after every step."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cost_model import CostModel, PhaseFit
from engine.kv import TwoEndedBlocks
from engine.scheduling import RequestClass

# A cost model in the range of the tiny model on this CPU: the time budget binds now and then
# (chunked BE prefills, replacements) without starving anyone.
COST = CostModel(PhaseFit(2e-4, 1e-6, 4e-3), PhaseFit(2e-4, 1e-6, 4e-3), swap_bytes_per_s=2e9)
_ids = itertools.count()


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cost") / "tiny.json"
    COST.save(path)
    return str(path)


def _engine(model_dir, cost_file, **overrides) -> LLMEngine:
    cfg = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_blocks=14,
        max_num_seqs=16,
        max_num_batched_tokens=32,
        policy="bros",
        cost_model_path=cost_file,
        rt_ttft_s=0.03,
        rt_tpot_s=0.015,
        bros_base_cap=4,
        enable_prefix_caching=False,
    )
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engines(tiny_model_dir, cost_file):
    path = tiny_model_dir("llama")
    return {
        "reference": LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=256, policy="fcfs")),
        "tight": _engine(path, cost_file),
        "no-host": _engine(path, cost_file, num_host_blocks=2),
        "prefix": _engine(path, cost_file, enable_prefix_caching=True, num_blocks=18),
    }


def _reference(engine: LLMEngine, jobs) -> dict[str, list[int]]:
    for rid, prompt, max_tokens, _, _ in jobs:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _check(engine: LLMEngine, batch_items) -> None:
    kv, d = engine.kv, engine.scheduler.policy.last
    kv.check_invariants()
    assert len(batch_items) <= d.cap
    k = len(d.rt_scheduled) + len(d.replaced)
    eligible = [r for r in d.rt_order if r not in d.skipped]  # skipped: no memory / admission held
    assert d.rt_scheduled + d.replaced[::-1] == eligible[:k]
    assert all(kv.is_resident(r) for r in batch_items)


def _run_bros(engine: LLMEngine, jobs) -> tuple[dict[str, list[int]], dict[str, int]]:
    pending = sorted(jobs, key=lambda j: j[3])
    out: dict[str, list[int]] = {}
    copies = {"checkpoint": 0, "restore": 0, "swap_out": 0, "relocate": 0, "preempted": 0}
    copies |= {"lent": 0, "lent_checkpoint": 0}  # BE entries in RT blocks' free ends, and RT growth over them
    orig = engine.scheduler.schedule
    ends = engine.kv.component(TwoEndedBlocks)
    bs = engine.kv.block_size

    def schedule(now=None):
        lent = {(s.block_id, s.be_id) for s in ends.shares.values() if s.be_rev}
        batch = orig(now)
        for c in batch.copies:
            copies[c.reason] += 1
            lent_here = c.reason == "checkpoint" and (c.src_slots[0] // bs, c.request_id) in lent
            copies["lent_checkpoint"] += lent_here
        copies["lent"] += sum(s.be_rev for s in ends.shares.values())
        copies["preempted"] += len(batch.preempted)
        _check(engine, [it.request for it in batch.items])
        return batch

    engine.scheduler.schedule = schedule
    try:
        for step in range(2000):
            while pending and pending[0][3] <= step:
                rid, prompt, max_tokens, _, cls = pending.pop(0)
                engine.add_request(
                    rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), req_class=cls
                )
            if not pending and not engine.has_unfinished():
                break
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        else:
            pytest.fail("the engine did not finish: deadlock or livelock")
    finally:
        engine.scheduler.schedule = orig
    assert engine.kv.pool.num_free == engine.kv.pool.capacity and not engine.kv.component(TwoEndedBlocks).shares
    return out, copies


def _jobs(seed: int, n: int, shared_prefix: bool = False):
    rng = random.Random(seed)
    prefix = [rng.randrange(49152) for _ in range(8)] if shared_prefix else []
    jobs = []
    for _ in range(n):
        cls = rng.choice([RequestClass.RT, RequestClass.BE])
        prompt = prefix + [rng.randrange(49152) for _ in range(rng.randint(1, 16))]
        jobs.append((f"r{next(_ids)}", prompt, rng.randint(1, 12), rng.randint(0, 12), cls))
    return jobs


@pytest.mark.timeout(600)
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6), n=st.integers(3, 9), which=st.sampled_from(["tight", "no-host", "prefix"]))
def test_greedy_tokens_match_ample_memory_run(engines, seed, n, which):
    jobs = _jobs(seed, n, shared_prefix=which == "prefix")
    expected = _reference(engines["reference"], jobs)
    got, _ = _run_bros(engines[which], jobs)
    assert got == expected


@pytest.mark.timeout(600)
def test_heavy_pressure_checkpoints_swaps_and_still_matches(engines):
    """BE requests fill memory, then RT requests arrive: their blocks come from BE ends."""
    totals: dict[str, int] = {}
    for seed in range(6):
        rng = random.Random(seed)
        jobs = [
            (
                f"be{next(_ids)}",
                [rng.randrange(49152) for _ in range(rng.randint(8, 14))],
                rng.randint(6, 12),
                0,
                RequestClass.BE,
            )
            for _ in range(3)
        ]
        jobs += [
            (
                f"rt{next(_ids)}",
                [rng.randrange(49152) for _ in range(rng.randint(6, 14))],
                rng.randint(4, 10),
                rng.randint(2, 8),
                RequestClass.RT,
            )
            for _ in range(5)
        ]
        expected = _reference(engines["reference"], jobs)
        got, copies = _run_bros(engines["tight" if seed % 2 else "no-host"], jobs)
        assert got == expected
        for k, v in copies.items():
            totals[k] = totals.get(k, 0) + v
    assert totals["checkpoint"] and totals["restore"] and totals["swap_out"] and totals["preempted"], totals


@pytest.mark.timeout(600)
def test_be_in_rt_block_ends_checkpointed_by_rt_growth_still_matches(engines):
    """RT requests hold most blocks, each with a partly filled last block; BE requests then
    take those free ends (no block is free) and RT decodes grow back over them."""
    totals: dict[str, int] = {}
    for seed in range(4):
        rng = random.Random(100 + seed)
        jobs = [
            (
                f"rt{next(_ids)}",
                [rng.randrange(49152) for _ in range(4 * rng.randint(2, 3) + rng.randint(1, 2))],
                rng.randint(6, 10),
                0,
                RequestClass.RT,
            )
            for _ in range(4)
        ]
        jobs += [
            (
                f"be{next(_ids)}",
                [rng.randrange(49152) for _ in range(rng.randint(2, 6))],
                rng.randint(4, 8),
                1,
                RequestClass.BE,
            )
            for _ in range(3)
        ]
        expected = _reference(engines["reference"], jobs)
        got, copies = _run_bros(engines["tight"], jobs)
        assert got == expected
        for k, v in copies.items():
            totals[k] = totals.get(k, 0) + v
    assert totals["lent"] and totals["lent_checkpoint"], totals
