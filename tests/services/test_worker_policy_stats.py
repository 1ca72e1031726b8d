"""The engine policy's own figures reach the worker's telemetry: a real worker running the
`ellm` policy (real broker, scheduler and gateway) serves a request, and a telemetry message
read straight off the telemetry topic carries its `DecisionStats` (decisions taken, mean
ratio, decision time percentiles), published through the engine's snapshot
(`SchedulingPolicy.published_stats`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.cost_model import CostModel, PhaseFit
from shared.schemas.telemetry import Telemetry
from shared.topics import Topics
from tests.services.conftest import chat_body, next_message


@pytest.fixture(scope="module")
def stack(make_stack, tmp_path_factory):
    profile = tmp_path_factory.mktemp("profiles") / "ellm.json"
    # a given profile: the worker starts without profiling (1 ms steps, 1 µs per token)
    CostModel(PhaseFit(1e-6, 0.0, 1e-3), PhaseFit(1e-6, 0.0, 1e-3), 1e9, {"model": "tiny"}).save(profile)
    s = make_stack()
    s.scheduler()
    s.worker("ellm", TANDEM_POLICY="ellm", TANDEM_COST_MODEL_PATH=str(profile))
    s.gateway()
    s.wait_workers(1)
    return s


async def _telemetry_with_decisions(stack, worker_id: str) -> Telemetry:
    """The first telemetry message of `worker_id` whose policy stats count a decision, read
    from the topic's start (the worker may have sent it before this reader began)."""
    return await next_message(
        stack,
        Topics(stack.prefix).telemetry.name,
        Telemetry,
        lambda m: m.worker_id == worker_id and bool(m.policy_stats) and m.policy_stats["steps"] > 0,
        from_end=False,
    )


def test_ellm_decision_stats_are_in_the_worker_telemetry(stack):
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("hello", max_tokens=4), timeout=120)
    assert r.status_code == 200, r.text
    msg = asyncio.run(asyncio.wait_for(_telemetry_with_decisions(stack, "ellm"), 120))
    stats = msg.policy_stats
    assert stats["mean_batch_bound"] >= 1 and 0 <= stats["mean_ratio"] <= 0.9
    assert 0 < stats["p50_decision_cpu_s"] <= stats["max_decision_cpu_s"]
    assert 0 < stats["p50_decision_s"] <= stats["max_decision_s"]
