"""Garbage on every topic a service consumes (issue 22): bad JSON, an unknown schema version, a
huge deeply nested payload, a missing value. Every consumer logs and skips it (shared/records.py;
decision: skip, no dead-letter topic, see docs/reliability.md) and the stack keeps serving."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from aiokafka import AIOKafkaProducer

from tests.services.conftest import chat_body

pytestmark = pytest.mark.timeout(600)

GARBAGE = (
    b"this is not json",
    b'{"schema_version": 999, "anything": true}',
    b"[" * 50_000 + b"]" * 50_000,  # 100 kB, nested far past any recursion limit
    b"\xff\xfe not utf-8",
    None,  # a tombstone where none is expected
)


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(TANDEM_RT_GRANTS="true")  # so that the gateways read placement.grants too
    s.advisory()
    return s.start(("w0",), queue=True)


async def _publish_garbage(bootstrap: str, topics: list[tuple[str, int]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=1_048_576)
    await producer.start()
    try:
        for name, partitions in topics:
            for partition in range(partitions):
                for value in GARBAGE:
                    await producer.send_and_wait(name, value=value, key=b"\xff garbage key", partition=partition)
    finally:
        await producer.stop()


def _consumed_topics(stack) -> list[tuple[str, int]]:
    from shared.topics import Topics

    t = Topics(stack.prefix)
    specs = [*t.static(), t.dispatch("w0")]
    return [(spec.name, spec.partitions) for spec in specs]


def test_every_consumer_skips_garbage_and_the_stack_keeps_serving(stack):
    topics = _consumed_topics(stack)
    asyncio.run(_publish_garbage(stack.bootstrap, topics))
    # Every topic's garbage is reported by a consumer of it (a topic nothing in this stack reads
    # would never be, and is listed here by name).
    replayed = f"{stack.prefix}.scheduler.state"  # read at start only (the scheduler's replay): below
    expected = {name for name, _ in topics} - {replayed}
    deadline = time.monotonic() + 120
    while True:
        logs = "\n".join(f.read_text(errors="replace") for f in stack.log_dir.glob("*.log"))
        missing = {name for name in expected if f"malformed record skipped: topic {name} " not in logs}
        if not missing:
            break
        stack.check_alive()
        assert time.monotonic() < deadline, f"never reported: {sorted(missing)}\n{stack.logs()}"
        time.sleep(0.2)
    stack.check_alive()
    stack.kill("scheduler", signal.SIGTERM)  # a new scheduler replays scheduler.state, garbage included
    stack.scheduler("scheduler2")
    _wait_logged(stack, "scheduler2", f"malformed record skipped: topic {replayed} ")
    _wait_logged(stack, "scheduler2", "scheduler ready")
    stack.wait_workers(1)
    for cls in ("rt", "be"):
        r = httpx.post(
            f"{stack.url}/v1/chat/completions",
            json=chat_body("still there?", max_tokens=4),
            headers={"X-Tandem-Class": cls},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    r = httpx.post(f"{stack.url}/v1/sessions/after-garbage/typing", json={}, timeout=30)
    assert r.status_code == 202, r.text
    assert "Traceback" not in logs, logs[-6000:]


def _wait_logged(stack, name: str, text: str, timeout: float = 120.0) -> None:
    log = stack.log_dir / f"{name}.log"
    deadline = time.monotonic() + timeout
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        stack.check_alive()
        assert time.monotonic() < deadline, f"{name} never logged {text!r}\n{stack.logs()}"
        time.sleep(0.2)
