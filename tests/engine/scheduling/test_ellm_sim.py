"""The simulator runs the eLLM policies: `ellm` (its rebuilt prefixes priced as prefill rows)
and the vLLM-Swap baseline `swap`, on the same arrivals as FCFS."""

from __future__ import annotations

import functools

import pytest

from engine.cost_model import CostModel, PhaseFit
from engine.kv import BlockPool, KVCacheManager, PartialResidency
from engine.rebuilt_prefix import host_prefix_rows, rebuilt_rows
from engine.sampling import SamplingParams
from engine.scheduling import Request, ScheduledItem
from engine.scheduling.request import SLO
from loadgen.arrivals import ArrivalSpec
from loadgen.driver import Driver
from loadgen.prompts import PromptBuilder
from loadgen.sim.cluster import ClusterSpec, SimTarget
from loadgen.sim.worker import SimWorker, WorkerSpec
from loadgen.workloads.build import WorkloadConfig, build_workload

COST = CostModel(PhaseFit(2e-4, 1e-8, 0.01), PhaseFit(1e-4, 5e-7, 0.02), 25e9, {"model": "test"})


def test_rebuilt_prefix_is_a_prefill_row():
    """What the simulator's `batch_rows` adds (engine/rebuilt_prefix.py's `rebuilt_rows`; tested
    here rather than through loadgen, which a worktree's test run imports from /work/main)."""
    kv = KVCacheManager(BlockPool(32), 16)
    kv.attach(functools.partial(PartialResidency, ratio=0.5))
    request = Request("a", list(range(100, 164)), SamplingParams(max_tokens=4))
    assert kv.allocate(request, 64)
    request.num_computed_tokens = 64
    assert kv.allocate(request, 1)  # u = 32 leave the pool: this step rebuilds them
    assert rebuilt_rows([ScheduledItem(request, 1)], kv) == [(32, 32)]
    other = Request("b", list(range(500, 540)), SamplingParams(max_tokens=4))
    assert kv.allocate(other, 40)  # nothing computed yet: nothing to rebuild
    assert rebuilt_rows([ScheduledItem(request, 1), ScheduledItem(other, 40)], kv) == [(32, 32)]


def test_simulator_and_optimiser_price_rebuilt_rows_alike():
    """With a measured rebuild step (`CostModel.rebuild_step`) the simulator charges a step
    with rebuilt rows exactly what the `ellm` optimiser prices it at (one function,
    `CostModel.with_rebuilt_prefixes`), which is more than the same rows as prefill rows when
    the fit has an off-graph part; without the fit both price prefill rows, as before."""
    from dataclasses import replace

    from engine.cost_model import PrefixStepFit
    from engine.scheduling import ScheduledBatch
    from engine.scheduling.ellm import choose
    from loadgen.sim.step_time import step_seconds

    kv = KVCacheManager(BlockPool(32), 16)
    kv.attach(functools.partial(PartialResidency, ratio=0.5))
    request = Request("a", list(range(100, 164)), SamplingParams(max_tokens=4))
    assert kv.allocate(request, 64)
    request.num_computed_tokens = 64
    assert kv.allocate(request, 1)
    batch = ScheduledBatch([ScheduledItem(request, 1)])
    as_prefill = COST.estimate([(32, 32)], [(1, 65)])
    assert step_seconds(COST, batch, 1000, kv) == pytest.approx(as_prefill)
    fitted = replace(COST, rebuild_step=PrefixStepFit(0.03, 0.01, 5e-4, 1e-6, error_s=1e-3))
    want = COST.estimate([], [(1, 65)]) + 0.03 + 0.01 + 32 * 5e-4 + 32 * 32 * 1e-6
    assert step_seconds(fitted, batch, 1000, kv) == pytest.approx(want) and want > as_prefill
    # the optimiser at r = 0.5 over the same context prices the same step
    choice = choose([65], 48, 16, fitted, tpot_s=10.0, max_batch=1)  # only r >= 0.5 fits 48 tokens
    assert choice.ratio == 0.5
    assert choice.step_s == pytest.approx(fitted.with_rebuilt_prefixes(0, 0, 1, 65, 1, 32, 32 * 32)) == want


def test_host_kept_prefix_is_priced_as_a_copy():
    """A host-kept prefix adds no rows; the simulator charges reading its K/V of every layer
    at the profile's host-link bandwidth, added to a CPU step, and a priced layer split reads
    only its share and rebuilds the rest."""
    from engine.scheduling import ScheduledBatch
    from loadgen.sim.step_time import step_seconds

    kv = KVCacheManager(BlockPool(32), 16, bytes_per_token=1000, host_blocks=8)
    kv.attach(functools.partial(PartialResidency, ratio=0.5, source="host"))
    request = Request("a", list(range(100, 164)), SamplingParams(max_tokens=4))
    assert kv.allocate(request, 64)
    request.num_computed_tokens = 64
    assert kv.allocate(request, 1)
    items = [ScheduledItem(request, 1)]
    assert rebuilt_rows(items, kv) == [] and host_prefix_rows(items, kv) == [(32, 32)]
    kv.take_copies()  # the offload's d2h copies are the step's swap bytes; leave them out here
    batch = ScheduledBatch(items)
    plain = COST.estimate([], [(1, 65)])
    assert step_seconds(COST, batch, 1000, kv) == pytest.approx(plain + 32 * 1000 / COST.swap_bytes_per_s)
    batch.host_prefix_split = (0.5, 0.5)
    rebuild = COST.estimate([(32, 32)], [(1, 65)]) - plain
    want = plain + 0.5 * rebuild + 0.5 * 32 * 1000 / COST.swap_bytes_per_s
    assert step_seconds(COST, batch, 1000, kv) == pytest.approx(want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["ellm", "ellm-auto", "swap"])
def test_sim_runs_the_policy_to_completion(policy):
    cfg = WorkloadConfig("rt-be", ArrivalSpec("poisson", 4.0), 10.0, seed=3, length_scale=0.5, be_batch=4)
    options = {"cost_model": COST, "default_slo": SLO(2.0, 0.5)} if policy != "swap" else {}
    if policy == "ellm-auto":  # the cheaper source per step, the layer split priced
        policy, options = "ellm", options | {"source": "auto", "layer_split": True, "num_layers": 8}
    spec = WorkerSpec(num_blocks=48, max_model_len=2048, kv_bytes_per_token=100_000)
    worker = SimWorker("w0", spec, COST, policy, options)
    target = SimTarget([worker], ClusterSpec())
    result = Driver(target, build_workload(cfg), PromptBuilder(49152, cfg.seed)).run()
    assert result.records and all(r.finish_reason is not None for r in result.records)
    worker.kv.check_invariants()


def _same_numbers(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return b == pytest.approx(a, rel=1e-9)
    return a == b


def test_paper_setup_profile_and_workload():
    """eLLM's setup (Llama2-13B on one A100-80GB, ShareGPT with 1,346-token outputs, 50 ms TPOT):
    the shipped profile is what `loadgen/sim/roofline.py` derives, with Llama2-13B's KV size
    (2 x 40 layers x 5120 x 2 bytes per token) and 4K context."""
    from loadgen.factory import load_cost_model
    from loadgen.sim.roofline import build_profile
    from loadgen.workloads.datasets import PROFILES

    shipped = load_cost_model("llama-2-13b-a100-80gb")
    derived = build_profile("llama-2-13b", "a100-80gb")
    # Equal up to the least-squares fit's last bits, which move with numpy/BLAS builds (one
    # coefficient differed in its 15th digit on a fresh install): a real change to the roofline
    # moves them by far more than 1e-9.
    assert _same_numbers(shipped.to_dict(), derived.to_dict())
    assert shipped.meta["kv_bytes_per_token"] == 2 * 40 * 5120 * 2
    assert shipped.meta["max_model_len"] == 4096
    profile = PROFILES["sharegpt-ellm"]
    assert profile.output.mean() == pytest.approx(1346, rel=0.01)
    assert profile.prompt.mean() == pytest.approx(222.76, rel=0.01)
    assert profile.slo.tpot_s == 0.05 and profile.slo.ttft_s is None
