"""`tandem up --ha`: two of scheduler, advisory and queue, one active and one standing by per
pair (`tandem status` shows them); a dead active is reported and its standby serves; a broker
restart with its data gone leaves every pair whole. Starting `up`: tests/services/up_stack.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from shared.kafka import KafkaClient
from shared.schemas.lease import LeaseRecord
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.stack import LEASE_S
from tests.services.up_stack import (  # noqa: F401 (stop_started_stacks: the autouse fixture)
    DEFAULT_FLAGS,
    HTTP_TIMEOUT_S,
    UpRun,
    batch_completes,
    served_model,
    start_up,
    stop_started_stacks,
    submit_batch,
    wait_batch,
)

HA_FLAGS = (*DEFAULT_FLAGS, "--ha")
# `tandem status` is a cold start of the CLI (~1 CPU-s quiet); polls of it get this safety net.
STATUS_TIMEOUT_S = 300.0


def _status(lines: list[str], prefix: str = "tandem", broker: str | None = None) -> dict:
    """`tandem status --json` against the broker `up` started (its address is in `up`'s log), or
    against `broker`."""
    if broker is None:
        broker = next(
            ln.split("embedded broker on ")[1].split()[0] for ln in list(lines) if "embedded broker on " in ln
        )
    env = {**os.environ, "KAFKA_BOOTSTRAP": broker, "TANDEM_TOPIC_PREFIX": prefix, "TANDEM_LEASE_S": str(LEASE_S)}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=STATUS_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _instances(status: dict, role: str) -> dict[str, str]:
    """Instance name (the service id, without pid and start time) -> state, for one role."""
    pair = next((p for p in status["pairs"] if p["role"] == role), {"instances": []})
    return {i["instance"].split("/")[0]: i["state"] for i in pair["instances"]}


def _wait_pairs(lines: list[str], broker: str | None = None) -> dict[str, dict[str, str]]:
    """Until `tandem status` shows each of the three pairs with one instance active and the other
    standing by (each standby announces itself within a lease); returns the pairs."""
    pairs = {}
    deadline = time.monotonic() + STATUS_TIMEOUT_S
    while time.monotonic() < deadline:
        status = _status(lines, broker=broker)
        pairs = {role: _instances(status, role) for role in ("scheduler", "advisory", "queue")}
        if all(sorted(p.values()) == ["active", "standby"] for p in pairs.values()):
            return pairs
        time.sleep(0.5)
    raise AssertionError(f"not one active and one standby per pair: {pairs}")


def test_up_ha_reports_a_dead_scheduler_and_keeps_serving(tiny_model_dir):
    """`up --ha`: two of scheduler, advisory and queue. SIGKILL the active scheduler: `up` says so
    and keeps running, the standby takes over, requests are served, `tandem status` shows the
    dead instance silent and the other active."""
    up = start_up(tiny_model_dir("llama"), HA_FLAGS, env={"TANDEM_LEASE_S": str(LEASE_S)})
    url = f"{up.url}/v1"
    model = served_model(up.url)
    pairs = _wait_pairs(up.lines)
    active = next(name for name, state in pairs["scheduler"].items() if state == "active")
    other = next(name for name in pairs["scheduler"] if name != active)
    victim = next(c for c in psutil.Process(up.proc.pid).children() if c.environ().get("TANDEM_SCHEDULER_ID") == active)
    victim.kill()
    for i in range(3):  # placed by the standby once it holds the lease
        r = httpx.post(
            f"{url}/completions",
            timeout=120,
            json={"model": model, "prompt": f"after {i}", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
    assert up.proc.poll() is None, up.output(tail=40)
    assert any(f"{active} died (code -9); {other} serves as the scheduler" in ln for ln in list(up.lines))
    deadline = time.monotonic() + STATUS_TIMEOUT_S  # silent: no record for two leases
    while _instances(_status(up.lines), "scheduler") != {active: "silent", other: "active"}:
        assert time.monotonic() < deadline, _status(up.lines)["pairs"]
        time.sleep(0.5)
    batch_completes(url, model)  # the queue pair still serves batches


@pytest.mark.timeout(900)
def test_up_ha_pairs_survive_a_broker_restart(tiny_model_dir):
    """`up --ha` on a broker that restarts with its data gone (tansu in memory: `leases` comes
    back empty) while a batch job runs. A standby used to start its broker watch only once
    active, so its lease reader kept its old position, above the new `leases` topic's end: it
    read nothing more, claimed the next term every second without ever reading its claim back,
    and the active read that claim and exited deposed, so no queue was active again (`tandem
    chaos --ha`). Now every instance repairs and rewinds, the batch completes with every item,
    and each pair has one active and one standby again."""
    from tests.services.test_broker_restart import RestartableBroker

    broker = RestartableBroker()
    up = None
    try:
        env = {"TANDEM_LEASE_S": str(LEASE_S), "KAFKA_BOOTSTRAP": broker.bootstrap}
        up = start_up(tiny_model_dir("llama"), HA_FLAGS, env=env)
        url = f"{up.url}/v1"
        model = served_model(up.url)
        _wait_pairs(up.lines, broker.bootstrap)
        asyncio.run(_lease_history(broker.bootstrap, 3000))
        batch_id = submit_batch(url, model, n=24, max_tokens=16)
        wait_batch(url, batch_id, done=1)
        broker.restart()
        # Needs an active queue and scheduler: a stuck standby deposed the active (safety net only).
        try:
            batch = wait_batch(url, batch_id)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{up.output(tail=200)}") from None
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}, batch
        # Every instance, standbys included, saw the restart and repaired (the watch's line).
        for name in ("scheduler-a", "scheduler-b", "queue-a", "queue-b", "advisory-a", "advisory-b"):
            _wait_line(up, f"{name:<10}| ", "broker restarted (")
        _wait_pairs(up.lines, broker.bootstrap)
        assert up.proc.poll() is None, up.output(tail=40)
    finally:
        if up is not None:  # stopped while its broker still runs (the fixture would stop it after)
            with contextlib.suppress(subprocess.TimeoutExpired):
                up.stop()
        broker.kill()


async def _lease_history(bootstrap: str, n: int) -> None:
    """`n` records of another role on `leases`, as hours of renewals leave there: a reader whose
    position is kept from the old broker then sits far above the new topic's end (the chaos run
    that found the defect had been up for minutes; this short stack would outgrow its position
    within a minute and hide it)."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "test-lease-history")
    await kafka.start()
    record = LeaseRecord(role="history", holder="test", term=1, state="standby", sent_at=time.time())
    try:
        acks = [await kafka.send_nowait(Topics("tandem").leases.name, record, key="history") for _ in range(n)]
        await asyncio.gather(*acks)
    finally:
        await kafka.stop()


def _wait_line(up: UpRun, prefix: str, text: str, timeout_s: float = 300) -> None:
    """Until `up` printed a line of one child (`prefix`) holding `text`; fails at once if `up` exited."""
    deadline = time.monotonic() + timeout_s
    while not any(ln.startswith(prefix) and text in ln for ln in list(up.lines)):
        assert up.proc.poll() is None and time.monotonic() < deadline, f"{prefix}{text!r}:\n{up.output(tail=40)}"
        time.sleep(0.1)
