"""`tandem drain`: a drained worker gets no new work, finishes what it holds, and `--wait`
returns once it holds nothing; the other worker serves everything after the drain."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from services.status import collect
from shared.settings import ServiceSettings
from tests.services.conftest import chat_body


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack().start(("w0", "w1"))


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "drain", *args], env=env, capture_output=True, text=True, timeout=300
    )


def _state(stack, worker_id: str) -> str | None:
    settings = ServiceSettings(kafka_bootstrap=stack.bootstrap, topic_prefix=stack.prefix)
    status = asyncio.run(collect(settings))
    return next((w.state for w in status.workers if w.worker_id == worker_id), None)


def test_a_drained_worker_gets_no_new_work_and_wait_returns_when_it_holds_none(stack):
    with httpx.Client(timeout=120) as client:
        before = {
            client.post(f"{stack.url}/v1/chat/completions", json=chat_body(f"hi {i}")).headers.get("x-tandem-worker")
            for i in range(6)
        }
    assert before <= {"w0", "w1"}
    out = _cli(stack.env, "w0", "--wait", "--timeout", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "w0 is drained" in out.stdout
    assert _state(stack, "w0") == "draining"
    # the scheduler reads the same heartbeat on its own consumer: wait for its view, then place
    stack.wait_until("the scheduler placing on w1 only", lambda: stack.scheduler_workers() == {"w1"})
    with httpx.Client(timeout=120) as client:
        after = []
        for i in range(6):
            r = client.post(f"{stack.url}/v1/chat/completions", json=chat_body(f"after {i}"))
            assert r.status_code == 200, r.text
            after.append(r.headers.get("x-tandem-worker"))
    assert after == ["w1"] * 6


def test_unknown_worker_with_wait_times_out_with_the_reason(stack):
    out = _cli(stack.env, "no-such-worker", "--wait", "--timeout", "2")
    assert out.returncode == 1 and "never reported draining" in out.stdout


def test_bad_arguments_exit_2(stack):
    out = _cli(stack.env, "w1", "--timeout", "0")
    assert out.returncode == 2 and "--timeout must be > 0" in out.stderr
