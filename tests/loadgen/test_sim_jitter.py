"""Step-time jitter in the simulator (`loadgen.sim.jitter`)."""

from __future__ import annotations

import zlib

import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.arrivals import ArrivalSpec
from loadgen.driver import Driver
from loadgen.prompts import PromptBuilder
from loadgen.sim.cluster import SimTarget
from loadgen.sim.jitter import StepJitter
from loadgen.sim.step_time import step_seconds
from loadgen.sim.worker import SimWorker, WorkerSpec
from loadgen.workloads.build import WorkloadConfig, build_workload

COST = CostModel(PhaseFit(2e-4, 1e-8, 0.01), PhaseFit(1e-4, 5e-7, 0.02), 25e9, {"model": "test"})
RATIOS = tuple(1.0 + i / 100 for i in range(100))


def test_draws_walk_consecutive_blocks_and_are_deterministic():
    jitter = StepJitter(RATIOS, block=10)
    walk = jitter.sampler(7)
    draws = [walk() for _ in range(50)]
    again = jitter.sampler(7)
    assert draws == [again() for _ in range(50)]
    for start in range(0, 50, 10):  # each block is a run of consecutive logged ratios
        block = draws[start : start + 10]
        first = RATIOS.index(block[0])
        assert block == list(RATIOS[first : first + 10])
    other = jitter.sampler(8)
    assert [other() for _ in range(50)] != draws


def test_long_run_mean_matches_the_logged_ratios():
    walk = StepJitter(RATIOS, block=5).sampler(0)
    mean = sum(walk() for _ in range(20_000)) / 20_000
    assert mean == pytest.approx(sum(RATIOS) / len(RATIOS), rel=0.01)


def test_from_steps_and_bad_input():
    assert StepJitter.from_steps([2.0, 3.0], [1.0, 2.0]).ratios == (2.0, 1.5)
    with pytest.raises(ValueError):
        StepJitter(())
    with pytest.raises(ValueError):
        StepJitter((1.0, -0.5))
    with pytest.raises(ValueError):
        StepJitter((1.0,), block=0)


def _priced_steps(jitter):
    """(simulated duration, cost-model price) of every step of a small run."""
    cfg = WorkloadConfig("sharegpt", ArrivalSpec("poisson", 2.0), 10.0, seed=1, length_scale=0.25)
    worker = SimWorker("w0", WorkerSpec(num_blocks=256, max_model_len=2048), COST, "fcfs", jitter=jitter)
    steps = []
    start = worker.start_step

    def logged(now):
        duration = start(now)
        if duration is not None:
            steps.append((duration, step_seconds(COST, worker.batch, 0)))
        return duration

    worker.start_step = logged
    Driver(SimTarget([worker]), build_workload(cfg), PromptBuilder(49152, cfg.seed)).run()
    return steps


@pytest.mark.timeout(300)
def test_simulated_steps_are_priced_times_the_draws():
    plain = _priced_steps(None)
    assert len(plain) > 20 and all(d == pytest.approx(p) for d, p in plain)
    doubled = _priced_steps(StepJitter((2.0,)))
    assert all(d == pytest.approx(2 * p) for d, p in doubled)
    jittered = _priced_steps(StepJitter(RATIOS, block=4))
    walk = StepJitter(RATIOS, block=4).sampler(0 ^ zlib.crc32(b"w0"))  # the worker's own stream (seed 0)
    assert [d / p for d, p in jittered] == pytest.approx([walk() for _ in jittered])
