"""SLO placement with real processes: the scheduler predicts from each worker's own published
profile, places where the SLO holds, and answers 429 with Retry-After when none can meet it.

Two workers of the tiny model are given step-time profiles (`--cost-model-path`): `fast` (1 ms
steps) and `slow` (every pass 2 s). With the default 1 s TTFT target only `fast` meets the SLO,
so least-loaded would send every other request to `slow` and the SLO policy must send none.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.cost_model import CostModel, PhaseFit
from tests.services.conftest import chat_body, worker_heartbeat


def _profile(path, beta: float) -> str:
    CostModel(PhaseFit(1e-6, 0.0, beta), PhaseFit(1e-6, 0.0, beta), 1e9, {"model": "tiny"}).save(path)
    return str(path)


@pytest.fixture(scope="module")
def stack(make_stack, tmp_path_factory):
    profiles = tmp_path_factory.mktemp("profiles")
    s = make_stack(TANDEM_PLACEMENT="slo", TANDEM_SLO_OVERLOAD="reject")
    s.scheduler()
    s.worker("fast", TANDEM_COST_MODEL_PATH=_profile(profiles / "fast.json", 0.001))
    s.worker("slow", TANDEM_COST_MODEL_PATH=_profile(profiles / "slow.json", 2.0))
    s.gateway()
    s.wait_workers(2)
    return s


def _decisions(stack) -> dict[str, float]:
    text = httpx.get(f"{stack.scheduler_url}/metrics", timeout=5).text
    return {
        s.labels["outcome"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "tandem_scheduler_placement_decisions"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("req_class") == "rt"
    }


def _wait_profiles(stack) -> None:
    """Until the scheduler has both workers' telemetry with their profiles: a request placed
    before that is ranked by load (reason `no profiles`), which would make the test meaningless.
    One probe request per round shows it: it is counted `meets_slo` once profiles are in."""

    def ready() -> bool:
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("probe", max_tokens=2), timeout=120)
        return r.status_code == 200 and _decisions(stack).get("meets_slo", 0) > 0

    stack.wait_until("the scheduler predicting from the workers' profiles", ready)


def test_rt_goes_where_the_profile_says_the_slo_holds(stack):
    _wait_profiles(stack)
    before = _decisions(stack)
    ids = []
    for i in range(6):
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body(f"hello {i}", max_tokens=4), timeout=120)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"].removeprefix("chatcmpl-"))
    after = _decisions(stack)
    assert after.get("meets_slo", 0) - before.get("meets_slo", 0) == 6
    assert after.get("over_slo_admitted", 0) == before.get("over_slo_admitted", 0)
    # every one ran on `fast`: its heartbeat lists them all as finished
    hb = asyncio.run(
        worker_heartbeat(stack, "fast", lambda hb: all(any(f.startswith(i) for f in hb.finished_ids) for i in ids))
    )
    assert hb.worker_id == "fast"


def test_unattainable_slo_is_answered_429_with_retry_after_and_nothing_else_is_lost(stack):
    _wait_profiles(stack)
    body = chat_body("too tight", max_tokens=4, tandem={"ttft_ms": 0.001})
    answers: list[httpx.Response] = []

    def rejected() -> bool:
        """One unattainable request. Until the scheduler has the slow worker's profile too (its
        first telemetry comes later on a loaded machine; `_wait_profiles` needs only the fast
        one's), it tries that worker unpredicted, as an unprofiled worker might meet the SLO, and
        the request is served: that case alone, counted `unpredicted`, is tried again."""
        before = _decisions(stack).get("unpredicted", 0)
        answers.append(httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120))
        if answers[-1].status_code != 200:
            return True
        assert _decisions(stack).get("unpredicted", 0) == before + 1, answers[-1].text  # not placed as meeting it
        return False

    stack.wait_until("the scheduler predicting for both workers", rejected)
    r = answers[-1]
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "slo_unattainable"
    assert "no worker meets the SLO" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert _decisions(stack).get("rejected", 0) >= 1
    ok = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("fine", max_tokens=4), timeout=120)
    assert ok.status_code == 200, ok.text


def test_scheduler_exports_its_request_consumer_lag(stack):
    """The Grafana dashboard's consumer-lag panel reads this gauge (tests/test_grafana.py)."""

    def lag_topics() -> set[str]:
        text = httpx.get(f"{stack.scheduler_url}/metrics", timeout=5).text
        return {
            s.labels["topic"]
            for f in text_string_to_metric_families(text)
            if f.name == "tandem_scheduler_consumer_lag"
            for s in f.samples
            if s.value >= 0
        }

    stack.wait_until("the scheduler's consumer lag gauge", lambda: f"{stack.prefix}.requests.rt" in lag_topics())
