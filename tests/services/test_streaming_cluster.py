"""Two workers behind one gateway: concurrency, cancellation, worker loss and scheduler restart."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import httpx
import pytest

from shared.kafka import KafkaClient, fetch_decoded
from shared.schemas.requests import GenerateRequest
from shared.schemas.telemetry import Telemetry
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import chat_body, worker_heartbeat

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack().start(("w0", "w1"))


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, on_chunk=None, request_id: str | None = None
) -> dict:
    """One SSE request: its text, chunk count, finish reason, worker, and usage."""
    text, chunks, finish, usage = "", 0, None, None
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        worker = r.headers.get("x-tandem-worker")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj["choices"]:
                text += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
                chunks += 1
                if on_chunk is not None:
                    await on_chunk(chunks)
    return {"text": text, "chunks": chunks, "finish": finish, "worker": worker, "usage": usage}


def _bodies(n: int, max_tokens: int) -> list[dict]:
    return [
        chat_body(
            f"request number {i}: say something",
            max_tokens=max_tokens,
            stream=True,
            ignore_eos=True,
            stream_options={"include_usage": True},
        )
        for i in range(n)
    ]


def _reference(url: str, bodies: list[dict]) -> list[str]:
    """Each request alone, non-streaming: the uninterrupted greedy text."""
    out = []
    for b in bodies:
        r = httpx.post(f"{url}/v1/chat/completions", json={**b, "stream": False}, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def test_fifty_concurrent_streams_across_two_workers(stack):
    bodies = _bodies(50, 24)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[_stream(client, stack.url, b) for b in bodies])

    results = asyncio.run(run())
    assert {r["worker"] for r in results} == {"w0", "w1"}  # placement spread the load
    for r in results:
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 24
    # Every stream is complete and in order: the same text as the request run alone.
    reference = _reference(stack.url, bodies[:10])
    assert [r["text"] for r in results[:10]] == reference


async def _worker_telemetry(stack, worker_id: str, match) -> Telemetry:
    """The next telemetry report of a worker that `match`es, read straight from the broker."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-telemetry-probe")
    consumer = await kafka.consumer(group=None)
    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).telemetry.name, from_end=True)
        while True:
            t = Telemetry.decode((await consumer.getone()).value)
            if t.worker_id == worker_id and match(t):
                return t
    finally:
        await kafka.stop()


def test_client_disconnect_cancels_and_frees_kv(stack):
    body = chat_body("never ending", max_tokens=450, stream=True, ignore_eos=True)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as r:
                worker = r.headers["x-tandem-worker"]
                rid = r.headers["x-request-id"]
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 5:
                        break  # leave: the connection closes mid-stream
        for _ in range(100):  # the worker drops it within a few heartbeats
            hb = await worker_heartbeat(stack, worker)
            if not any(k.startswith(rid) for k in hb.running_ids):
                # the pool's own count: every block back (nothing else runs on this worker now)
                empty = await asyncio.wait_for(_worker_telemetry(stack, worker, lambda t: t.kv_usage == 0.0), 60)
                return rid, hb, empty
        raise AssertionError(f"request {rid} still running on {worker}: {hb.running_ids}")

    rid, hb, empty = asyncio.run(run())
    assert any(k.startswith(rid) for k in hb.finished_ids)
    metrics = httpx.get(f"{stack.url}/metrics", timeout=60).text
    assert 'status="cancelled"' in metrics
    # The KV went back: the worker's telemetry (its pool's count) reports an empty pool
    assert empty.kv_usage == 0.0
    # and a request that needs the blocks runs to its full length
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("after", 200, ignore_eos=True), timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200


def test_worker_killed_mid_stream_resumes_on_the_other_with_identical_text(stack):
    bodies = _bodies(6, 200)
    reference = _reference(stack.url, bodies)
    killed: list[str] = []

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:

            async def kill_once(n_chunks):
                if n_chunks == 30 and not killed:
                    killed.append("w0")
                    stack.kill("w0", signal.SIGKILL)

            tasks = [
                _stream(client, stack.url, b, on_chunk=kill_once if i == 0 else None) for i, b in enumerate(bodies)
            ]
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert killed == ["w0"]
    on_w0 = sum(r["worker"] == "w0" for r in results)
    assert on_w0, "no stream started on the killed worker"
    resumed = [
        ln
        for ln in httpx.get(f"{stack.url}/metrics", timeout=60).text.splitlines()
        if ln.startswith("tandem_gateway_resumed_requests ")
    ]
    assert float(resumed[0].split()[1]) >= on_w0  # each of them was resumed elsewhere
    for r, ref in zip(results, reference):
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 200
        assert r["text"] == ref
    stack.worker("w2")  # back to two workers for what follows
    stack.wait_workers(2)


async def _start_and_wait_published(stack, start, request_ids: set[str]) -> list[asyncio.Task]:
    """`start()` starts the requests `request_ids` (returns their tasks); returns once the gateway
    has published every one of them on the stack's RT request topic. (Read, not counted by end
    offsets: tansu reports a partition's end as its last batch's first offset + 1.)"""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-requests-probe")
    consumer = await kafka.consumer(group=None, hot=True)
    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).rt_requests.name, from_end=True)
        tasks = start()
        seen: set[str] = set()
        while not request_ids <= seen:
            seen |= {r.request_id for r in await fetch_decoded(consumer, GenerateRequest, timeout_ms=200)}
        return tasks
    finally:
        await kafka.stop()


def test_scheduler_restart_mid_load_loses_no_request(stack):
    bodies = _bodies(20, 40)

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            running = asyncio.Event()

            async def on_chunk(_):
                running.set()

            first = [asyncio.create_task(_stream(client, stack.url, b, on_chunk=on_chunk)) for b in bodies[:10]]
            await running.wait()  # the scheduler dies with requests placed and running
            stack.kill("scheduler", signal.SIGKILL)
            ids = {f"restart-{uuid.uuid4().hex}": b for b in bodies[10:]}
            publish = _start_and_wait_published(  # requests arrive while no scheduler runs
                stack,
                lambda: [asyncio.create_task(_stream(client, stack.url, b, request_id=i)) for i, b in ids.items()],
                set(ids),
            )
            second = await asyncio.wait_for(publish, 120)
            stack.scheduler("scheduler-2")
            return await asyncio.gather(*first, *second)

    results = asyncio.run(run())
    assert len(results) == 20
    for r in results:  # none lost (a lost one would end in a 503 or a timeout), none cut short
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 40
