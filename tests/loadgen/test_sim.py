"""The simulator: determinism, multi-worker placement, and agreement with the real engine."""

from __future__ import annotations

import pytest

from engine.cost_model import CostModel, PhaseFit
from loadgen.arrivals import ArrivalSpec
from loadgen.driver import Driver
from loadgen.metrics import summarize
from loadgen.prompts import PromptBuilder
from loadgen.sim.cluster import ClusterSpec, SimTarget
from loadgen.sim.worker import SimWorker, WorkerSpec
from loadgen.workloads.build import WorkloadConfig, build_workload

COST = CostModel(PhaseFit(2e-4, 1e-8, 0.01), PhaseFit(1e-4, 5e-7, 0.02), 25e9, {"model": "test"})


def sim_run(cfg: WorkloadConfig, workers=1, policy="fcfs", num_blocks=256, bw=None, **spec):
    ws = [
        SimWorker(
            f"w{i}",
            WorkerSpec(num_blocks=num_blocks, max_model_len=2048, kv_bytes_per_token=100_000, **spec),
            COST,
            policy,
        )
        for i in range(workers)
    ]
    target = SimTarget(ws, ClusterSpec(kv_transfer_bytes_per_s=bw))
    return Driver(target, build_workload(cfg), PromptBuilder(49152, cfg.seed)).run(), target


def timelines(result):
    return sorted((r.request_id, tuple(r.token_times_s), r.finish_reason) for r in result.records)


@pytest.mark.timeout(300)
def test_simulation_is_deterministic_given_seed():
    cfg = WorkloadConfig("rt-be", ArrivalSpec("poisson", 4.0), 20.0, seed=3, length_scale=0.5, be_batch=8)
    a, _ = sim_run(cfg)
    b, _ = sim_run(cfg)
    assert timelines(a) == timelines(b)
    c, _ = sim_run(WorkloadConfig("rt-be", ArrivalSpec("poisson", 4.0), 20.0, seed=4, length_scale=0.5, be_batch=8))
    assert timelines(a) != timelines(c)
    s = summarize(a.records, a.elapsed_s)
    assert s["rt"]["completed"] == s["rt"]["requests"] > 20
    assert s["be"]["completed"] > 0


@pytest.mark.timeout(300)
def test_more_load_means_worse_attainment_and_more_workers_help():
    def att(rate, workers):
        res, _ = sim_run(WorkloadConfig("sharegpt", ArrivalSpec("poisson", rate), 60.0, seed=1), workers=workers)
        return summarize(res.records, res.elapsed_s)["rt"]["slo_attainment"]

    assert att(1.0, 1) > att(8.0, 1)
    assert att(8.0, 4) > att(8.0, 1)


@pytest.mark.timeout(300)
def test_multi_worker_sessions_spread_and_keep_affinity():
    cfg = WorkloadConfig("sessions", ArrivalSpec("poisson", 2.0), 120.0, seed=2, turns_mean=3, length_scale=0.5)
    res, target = sim_run(cfg, workers=4, bw=10e9)
    workers_used = {r.worker for r in res.records if r.worker}
    assert len(workers_used) == 4
    by_session: dict[str, set] = {}
    for r in res.records:
        by_session.setdefault(r.session_id, set()).add(r.worker)
    assert sum(len(v) == 1 for v in by_session.values()) >= 0.8 * len(by_session)  # affinity mostly holds
    assert all(r.completed for r in res.records if r.req_class == "rt")
    assert res.typing_hints >= len(by_session)


def test_session_history_hits_the_prefix_cache():
    cfg = WorkloadConfig("sessions", ArrivalSpec("poisson", 0.5), 200.0, seed=5, turns_mean=4, length_scale=0.5)
    res, target = sim_run(cfg, num_blocks=4096)
    later = [r for r in res.records if r.session_id and not r.request_id.endswith("-t0") and r.completed]
    assert later, "the workload should have multi-turn sessions"
    history = sum(r.prompt_tokens for r in later)
    cached = target.workers["w0"].prompt_tokens_cached
    # later turns resend their history, still cached on the one worker: most of it is a hit
    assert cached > 0.5 * history


def test_recompute_preemption_hits_are_counted():
    """A request dropped for recompute and re-admitted takes what is still cached of its KV:
    the worker counts those tokens (`recompute_tokens_cached`; the first admission's hit stays
    `prompt_tokens_cached`, what usage reports). Checked against the work identity: every token
    of progress a request ever had came from a cache hit or a computed token, so the hits are
    the progress (kept by finished requests, thrown away by preemptions) minus the computed
    tokens."""
    from loadgen.targets.base import PreparedRequest

    spec = WorkerSpec(num_blocks=24, max_model_len=512, kv_bytes_per_token=100_000)
    worker = SimWorker("w0", spec, COST, "fcfs")
    requests = [
        worker.add(PreparedRequest(f"r{i}", "rt", [7 * i + t for t in range(64)], 100, 0.0), 0.0) for i in range(4)
    ]
    dropped, now = 0, 0.0
    while worker.has_work():
        computed = {r: r.num_computed_tokens for r in worker.scheduler.running}
        duration = worker.start_step(now)
        assert duration is not None
        dropped += sum(computed[r] for r in worker.batch.preempted)
        now += duration
        worker.finish_step()
    assert worker.batch is None and all(r.is_finished for r in requests)
    assert worker.stats.preemptions > 0  # the pool holds 384 tokens, the requests want 656
    kept = sum(r.num_tokens - 1 for r in requests)  # the last sampled token is never computed
    hits = kept + dropped - worker.stats.tokens_computed
    assert worker.recompute_tokens_cached > 0
    assert worker.prompt_tokens_cached + worker.recompute_tokens_cached == hits
