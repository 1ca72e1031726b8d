"""The simulator replays the engine's scheduling exactly when both use the same clock.

The in-process target with a `ModelClock` runs the real engine (real model, real scheduler,
real KV manager) but advances time by the cost model's estimate of each executed batch. The
simulator does the same without a model. Same workload, same limits, same cost model: every
request must get its tokens at the same (virtual) times, so any divergence in the
simulator's bookkeeping (progress, commits, which rows sample, stop checks, preemption)
shows up here. Timing fidelity of the cost model itself is validated in docs/simulator.md.
"""

from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.cost_model import CostModel, PhaseFit
from loadgen.arrivals import ArrivalSpec
from loadgen.driver import Driver
from loadgen.prompts import PromptBuilder
from loadgen.sim.cluster import SimTarget
from loadgen.sim.worker import SimWorker, WorkerSpec
from loadgen.targets.inproc import InprocTarget, ModelClock
from loadgen.workloads.build import WorkloadConfig, build_workload

COST = CostModel(PhaseFit(2e-4, 1e-7, 0.01), PhaseFit(1e-3, 2e-6, 0.02), 1e9, {"model": "test"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy,num_blocks", [("fcfs", 40), ("rr", 40), ("fcfs", 400)])
def test_sim_matches_engine_step_for_step(tiny_model_dir, policy, num_blocks):
    # 40 blocks of 16 = 640 slots: small enough that FCFS preempts under this load
    cfg = WorkloadConfig("rt-be", ArrivalSpec("poisson", 6.0), 3.0, seed=11, length_scale=0.2, be_batch=4, max_len=512)
    engine_cfg = EngineConfig(
        model=str(tiny_model_dir("llama")),
        dtype="float32",
        num_blocks=num_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        policy=policy,
    )
    inproc = InprocTarget.from_config(engine_cfg, clock=ModelClock(COST))
    real = Driver(inproc, build_workload(cfg), PromptBuilder(49152, cfg.seed)).run()

    spec = WorkerSpec(num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
    sim = Driver(
        SimTarget([SimWorker("w0", spec, COST, policy)]), build_workload(cfg), PromptBuilder(49152, cfg.seed)
    ).run()

    def timeline(res):
        return {r.request_id: ([round(t, 9) for t in r.token_times_s], r.finish_reason) for r in res.records}

    assert len(real.records) > 10
    assert timeline(sim) == timeline(real)
    if num_blocks == 40 and policy == "fcfs":
        assert inproc.engine.stats.preemptions > 0  # the comparison covered preemption


@pytest.mark.timeout(300)
def test_sim_and_engine_count_the_same_steps_and_tokens(tiny_model_dir):
    """Both run the one `StepBookkeeping` (engine/bookkeeping.py), so its counters agree too,
    preemptions included, not only the token timelines."""
    cfg = WorkloadConfig("rt-be", ArrivalSpec("poisson", 6.0), 2.0, seed=12, length_scale=0.2, be_batch=4, max_len=512)
    engine_cfg = EngineConfig(
        model=str(tiny_model_dir("llama")), dtype="float32", num_blocks=40, max_num_seqs=8, max_num_batched_tokens=128
    )
    inproc = InprocTarget.from_config(engine_cfg, clock=ModelClock(COST))
    Driver(inproc, build_workload(cfg), PromptBuilder(49152, cfg.seed)).run()
    worker = SimWorker(
        "w0", WorkerSpec(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512), COST, "fcfs"
    )
    Driver(SimTarget([worker]), build_workload(cfg), PromptBuilder(49152, cfg.seed)).run()

    keys = (
        "steps",
        "tokens_computed",
        "prompt_tokens_computed",
        "prompt_tokens_cached",
        "generation_tokens",
        "preemptions",
    )
    real = {k: getattr(inproc.engine.stats, k) for k in keys}
    assert real["steps"] > 20 and real["preemptions"] > 0
    assert {k: getattr(worker.stats, k) for k in keys} == real
