"""`tandem status` against a running stack (broker, scheduler, a worker, a gateway)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from services.broker import free_port
from services.status import ClusterStatus, collect
from shared.kafka import KafkaClient
from shared.schemas.requests import GenerateRequest
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import chat_body


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack().start(("w0",))


def _settings(stack) -> ServiceSettings:
    return ServiceSettings(
        kafka_bootstrap=stack.bootstrap,
        topic_prefix=stack.prefix,
        worker_timeout_s=float(stack.env["TANDEM_WORKER_TIMEOUT_S"]),
    )


def _status(stack) -> ClusterStatus:
    return asyncio.run(collect(_settings(stack)))


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "status", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_status_shows_workers_load_kv_sessions_and_broker(stack):
    # long enough that the turn keeps full KV blocks (a session's directory entry counts them)
    body = chat_body("hello there " * 40, tandem={"session_id": "s-1"})
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    seen: list[ClusterStatus] = []

    def telemetry_seen() -> bool:
        seen.append(_status(stack))
        return any(w.worker_id == "w0" and w.kv_usage is not None for w in seen[-1].workers)

    def session_seen() -> bool:
        seen.append(_status(stack))
        return seen[-1].sessions.sessions >= 1

    stack.wait_until("status with w0's telemetry", telemetry_seen, timeout=120)
    stack.wait_until("status with the session's KV", session_seen, timeout=120)
    out = _cli(stack.env, "--json")
    assert out.returncode == 0, out.stderr
    s = ClusterStatus.model_validate_json(out.stdout)
    assert s.reachable and s.topics_present == s.topics_expected > 0
    (w0,) = [w for w in s.workers if w.worker_id == "w0"]
    assert w0.state == "live" and w0.model == "tiny" and w0.kv_blocks > 0 and 0.0 <= w0.kv_usage <= 1.0
    assert s.sessions.sessions >= 1 and s.sessions.copies >= 1 and s.sessions.bytes > 0
    assert s.queues.rt_backlog == 0  # every request the scheduler read is committed
    table = _cli(stack.env)
    assert table.returncode == 0 and "w0" in table.stdout and "live" in table.stdout and "sessions:" in table.stdout


def test_unreachable_broker_exits_1_with_the_reason():
    env = {**_cli_env(), "KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}"}
    out = _cli(env, "--json", "--timeout", "2")
    assert out.returncode == 1
    s = json.loads(out.stdout)
    assert s["reachable"] is False and s["error"]


def test_backlog_grows_while_the_scheduler_is_down_and_a_dead_worker_turns_silent(stack):
    stack.kill("scheduler")
    req = GenerateRequest(
        request_id="status-probe",
        gateway_id="nobody",
        reply_partition=0,
        model="tiny",
        kind="completion",
        prompt="x",
        created_at=time.time(),
    )

    async def produce() -> None:
        kafka = KafkaClient(_settings(stack), "test-status")
        await kafka.start()
        try:
            await kafka.send(Topics(stack.prefix).rt_requests.name, req, key=req.request_id)
        finally:
            await kafka.stop()

    asyncio.run(produce())
    assert _status(stack).queues.rt_backlog >= 1
    stack.kill("w0")
    stack.wait_until(
        "w0 silent", lambda: any(w.worker_id == "w0" and w.state == "silent" for w in _status(stack).workers)
    )


def _cli_env() -> dict:
    import os

    return dict(os.environ)


def test_pairs_are_read_from_the_lease_records():
    """Each role's instances by the lease rules: the term's holder renewing is active, a standby
    heard recently standby, an instance with no record for two leases silent, a released one
    stopped; roles do not mix."""
    import time

    from services.status import _pairs
    from shared.schemas.lease import LeaseRecord

    now = time.time()

    def rec(role, holder, term, state="held", age=0.0):
        return LeaseRecord(role=role, holder=holder, term=term, state=state, sent_at=now - age)

    records = [
        rec("scheduler", "s-a/1", 1, age=30),
        rec("scheduler", "s-b/2", 1, "standby", age=20),
        rec("scheduler", "s-b/2", 2, age=1),  # took over
        rec("queue", "q-a/3", 1, age=0.5),
        rec("queue", "q-b/4", 1, "standby", age=0.5),
        rec("advisory", "a-a/5", 4, age=2),
        rec("advisory", "a-a/5", 4, "released", age=1),
    ]
    pairs = {p.role: p for p in _pairs(records, lease_s=3.0)}
    states = {role: {i.instance: i.state for i in p.instances} for role, p in pairs.items()}
    assert states == {
        "scheduler": {"s-a/1": "silent", "s-b/2": "active"},
        "queue": {"q-a/3": "active", "q-b/4": "standby"},
        "advisory": {"a-a/5": "stopped"},
    }
    assert pairs["scheduler"].term == 2 and pairs["advisory"].term == 4
