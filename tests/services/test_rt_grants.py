"""RT dispatch by grant (`TANDEM_RT_GRANTS=true`; services/scheduler/grants.py, gateway/grants.py)
on a real stack: RT requests go from the gateway straight to a granted worker and the scheduler
records them; a grant gone stale (its worker killed) loses nothing; a scheduler killed and
replaced hands the gateways a grant of its own term. The three-hop path (grants off, the
default) is what every other service test runs."""

from __future__ import annotations

import asyncio
import signal
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.kafka import KafkaClient, read_to_end
from shared.schemas.requests import GenerateRequest
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.test_streaming_cluster import _bodies, _reference, _stream

pytestmark = pytest.mark.timeout(600)
GRANTS = {"TANDEM_RT_GRANTS": "true"}


def _metric(url: str, name: str, **labels: str) -> float:
    """A sample's value from a service's /metrics (0 when absent or the service does not answer)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _granted(stack) -> float:
    return _metric(stack.url, "tandem_gateway_rt_dispatch_total", path="grant")


def _wait_granted_workers(stack, n: int, term_above: float = 0) -> None:
    stack.wait_until(
        f"the gateway holding a grant of {n} workers (term > {term_above:g})",
        lambda: (
            _metric(stack.url, "tandem_gateway_granted_workers") == n
            and _metric(stack.url, "tandem_gateway_grant_term") > term_above
        ),
    )


async def _run(stack, bodies: list[dict], ids: list[str] | None = None) -> list[dict]:
    async with httpx.AsyncClient(timeout=240) as client:
        ids = ids or [None] * len(bodies)
        return await asyncio.gather(*[_stream(client, stack.url, b, request_id=i) for b, i in zip(bodies, ids)])


async def _dispatched(stack, worker_id: str, request_ids: set[str]) -> set[str]:
    """Which of `request_ids` a gateway sent to `worker_id`'s dispatch topic, read from its start."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-dispatch-probe")
    consumer = await kafka.consumer(group=None)
    found: set[str] = set()

    def apply(m) -> None:
        r = GenerateRequest.decode(m.value)
        if r.request_id in request_ids and r.granted_worker == worker_id:
            found.add(r.request_id)

    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).dispatch(worker_id).name, from_end=False)
        await read_to_end(consumer, apply)
        return found
    finally:
        await kafka.stop()


def _complete(results: list[dict], tokens: int) -> None:
    for r in results:  # none lost (a 503 or a timeout), none cut short
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == tokens, r


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(**GRANTS).start(("w0", "w1"))


def test_rt_requests_go_straight_to_granted_workers_and_the_scheduler_records_them(stack):
    _wait_granted_workers(stack, 2)
    bodies = _bodies(8, 24)
    reference = _reference(stack.url, bodies[:4])
    before = _granted(stack)
    decided = _metric(stack.scheduler_url, "tandem_scheduler_placement_decisions_total", outcome="granted")
    results = asyncio.run(_run(stack, bodies))
    _complete(results, 24)
    assert [r["text"] for r in results[:4]] == reference  # in order, nothing repeated or skipped
    assert {r["worker"] for r in results} == {"w0", "w1"}  # 4 slots each: 8 streams fill both
    assert _granted(stack) - before == 8  # every one sent by the gateway itself (two hops)
    stack.wait_until(  # and the scheduler recorded each as its placement (from the flagged copy)
        "the scheduler recording the 8 granted placements",
        lambda: (
            _metric(stack.scheduler_url, "tandem_scheduler_placement_decisions_total", outcome="granted") >= decided + 8
        ),
    )
    # BE keeps the scheduler's path
    be = {**bodies[0], "stream": False}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=be, headers={"X-Tandem-Class": "be"}, timeout=240)
    assert r.status_code == 200, r.text


def test_scheduler_killed_and_replaced_loses_nothing_and_grants_again(stack):
    _wait_granted_workers(stack, 2)
    old_term = _metric(stack.url, "tandem_gateway_grant_term")
    stack.kill("scheduler", signal.SIGKILL)  # no revoke: its grant lapses after its TTL
    gap = _bodies(6, 16)
    ids = [f"gap-{uuid.uuid4().hex}" for _ in gap]

    async def during_the_gap():
        # sent while no scheduler runs: granted with the dead scheduler's term, or queued for the next one
        tasks = asyncio.create_task(_run(stack, gap, ids))
        await asyncio.sleep(0)
        stack.scheduler("scheduler-2")
        return await tasks

    _complete(asyncio.run(during_the_gap()), 16)
    stack.wait_workers(2)
    _wait_granted_workers(stack, 2, term_above=old_term)  # the successor grants with its own term
    before = _granted(stack)
    _complete(asyncio.run(_run(stack, _bodies(4, 16))), 16)
    assert _granted(stack) - before == 4


def test_stale_grant_of_a_killed_worker_is_rerouted_with_nothing_lost(make_stack):
    # A worker timeout long enough that the killed worker stays in both the gateway's and the
    # scheduler's views (and so in the grant) while the requests are sent, on a busy machine too.
    stack = make_stack(**GRANTS, TANDEM_WORKER_TIMEOUT_S="20", TANDEM_UNKNOWN_REQUEST_GRACE_S="20")
    stack.start(("w0", "w1"))
    _wait_granted_workers(stack, 2)
    bodies = _bodies(8, 24)
    reference = _reference(stack.url, bodies)
    stack.kill("w0", signal.SIGKILL)
    ids = [f"stale-{uuid.uuid4().hex}" for _ in bodies]
    results = asyncio.run(_run(stack, bodies, ids))
    _complete(results, 24)
    assert [r["text"] for r in results] == reference  # resumed where they stopped: same greedy text
    to_dead = asyncio.run(_dispatched(stack, "w0", set(ids)))
    assert to_dead, "no request was granted to the killed worker: the stale grant was not exercised"
    assert {r["worker"] for r in results} == {"w1"}  # those sent to w0 were re-routed and served by w1
    assert _metric(stack.url, "tandem_gateway_resumed_requests") >= len(to_dead)
