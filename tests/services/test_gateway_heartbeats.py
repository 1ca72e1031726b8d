"""Gateway heartbeats (issue 22 part B): a gateway that dies has its in-flight requests cancelled
on the workers, so their KV is freed; a worker that was itself away does not judge its owners."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from services.worker.owners import OwnerWatch
from shared.schemas.telemetry import OwnerHeartbeat
from tests.services.conftest import chat_body, worker_heartbeat

pytestmark = pytest.mark.timeout(600)  # a stack starts inside a test: its start counts


def _beat(owner: str) -> OwnerHeartbeat:
    return OwnerHeartbeat(owner_id=owner, started_at=1.0, sent_at=2.0)


def test_owner_watch_declares_only_heard_owners_dead_and_forgives_its_own_absence(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    watch = OwnerWatch(timeout_s=4.0)
    watch.on_heartbeat(_beat("g1"))
    watch.on_heartbeat(_beat("g2"))

    def silence_of_g1(seconds: int) -> list[list[str]]:
        """g2 keeps beating, g1 is silent; the worker checks every second."""
        out = []
        for _ in range(seconds):
            now[0] += 1.0
            watch.on_heartbeat(_beat("g2"))
            out.append(watch.expire())
        return out

    assert silence_of_g1(5) == [[], [], [], [], ["g1"]]  # dead once silent for over 4 s, said once
    assert watch.is_dead("g1") and not watch.is_dead("g2") and not watch.is_dead("never-heard")
    watch.on_heartbeat(_beat("g1"))  # back (a restart with the same id)
    assert not watch.is_dead("g1")
    now[0] += 30.0  # the worker itself was paused: nobody is judged on that silence
    assert watch.expire() == []
    assert silence_of_g1(5) == [[], [], [], [], ["g1"]]  # counted from the worker's return


def test_a_killed_gateways_streams_are_cancelled_and_their_kv_freed(make_stack):
    """40 streams on one worker that runs one sequence at a time (so they outlast the 6 s it takes
    to notice the gateway is gone: the tiny model would finish them all before that); SIGKILL
    the gateway once every one was accepted; the worker cancels what is left and frees its KV."""
    stack = make_stack()
    stack.scheduler()
    stack.worker("w0", TANDEM_MAX_NUM_SEQS=1)
    stack.gateway()
    stack.wait_workers(1)
    bodies = [chat_body(f"never ending {i}", max_tokens=450, stream=True, ignore_eos=True) for i in range(40)]

    async def start_streams() -> list[str]:
        """Open every stream until its headers (sent once its worker accepted it), then kill the
        gateway with every stream still open (a closed one would be a client's cancel)."""
        client = httpx.AsyncClient(timeout=120)
        held = []

        async def one(body):
            cm = client.stream("POST", f"{stack.url}/v1/chat/completions", json=body)
            r = await cm.__aenter__()
            assert r.status_code == 200
            held.append((cm, r))
            return r.headers["x-request-id"]

        ids = await asyncio.gather(*(one(b) for b in bodies))
        stack.kill("gateway", signal.SIGKILL)
        assert len(held) == len(bodies)
        return ids

    ids = asyncio.run(start_streams())
    assert len(ids) == len(bodies)

    async def wait_free():
        while True:
            hb = await worker_heartbeat(stack, "w0")
            if not hb.running_ids:
                return hb

    asyncio.run(wait_free())
    # Cancelled (not run to the end): the worker says so, and the engine holds no KV.
    stack.wait_log("w0", "cancelling its")
    line = next(ln for ln in (stack.log_dir / "w0.log").read_text().splitlines() if "cancelling its" in ln)
    assert int(line.split("cancelling its ")[1].split()[0]) >= 1, line
    stack.wait_until("the worker's KV free", lambda: _kv_usage(stack) == 0.0)


def _kv_usage(stack) -> float:
    return asyncio.run(_next_telemetry(stack)).kv_usage


async def _next_telemetry(stack):
    from shared.kafka import KafkaClient
    from shared.schemas.telemetry import Telemetry
    from shared.settings import ServiceSettings
    from shared.topics import Topics

    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-telemetry-probe")
    consumer = await kafka.consumer(group=None)
    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).telemetry.name, from_end=True)
        while True:
            t = Telemetry.decode((await consumer.getone()).value)
            if t.worker_id == "w0":
                return t
    finally:
        await kafka.stop()
