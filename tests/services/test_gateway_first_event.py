"""A stream whose first result event is a delta, not the worker's `Accepted` (issue 22, broker
restarts): the restarted broker lost the records it held unread, `Accepted` among them, while the
worker's producer sent its later records again to the new broker. Found by `tandem chaos`
(eighth session): the gateway took the first delta for the acceptance and dropped it, so the
client's text lacked its first chunk (counted as a stream gap).

A real broker and a real gateway process; the worker is scripted (it heartbeats, reads the
request and answers on the gateway's results partition without an `Accepted`), since a real
worker's lost `Accepted` cannot be produced on cue."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from shared.kafka import KafkaClient
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Delta, ResultBatch
from shared.schemas.telemetry import Heartbeat
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import chat_body

pytestmark = pytest.mark.timeout(600)  # stacks or services start inside tests: their start counts


async def _scripted_worker(stack, stop: asyncio.Event, answered: list[str]) -> None:
    """Heartbeat as worker `w0` serving `tiny`; answer each RT request with two deltas ("Hel",
    then "lo" with its finish) and no `Accepted`."""
    topics = Topics(stack.prefix)
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap, topic_prefix=stack.prefix), "scripted-w0")
    await kafka.start(topics.static())
    requests = await kafka.consumer(group=None)
    await kafka.assign_all(requests, topics.rt_requests.name, from_end=True)
    started = time.time()

    async def beat() -> None:
        while not stop.is_set():
            hb = Heartbeat(
                worker_id="w0",
                model="tiny",
                max_model_len=256,
                dispatch_topic=f"{stack.prefix}.dispatch.w0",
                started_at=started,
                sent_at=time.time(),
            )
            await kafka.send(topics.heartbeats.name, hb, key="w0")
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(beat())
    try:
        while not stop.is_set():
            for records in (await requests.getmany(timeout_ms=200)).values():
                for record in records:
                    req = GenerateRequest.decode(record.value)
                    rid = req.request_id
                    events = [
                        Delta(request_id=rid, index=0, token_ids=[1, 2], text="Hel"),
                        Delta(request_id=rid, index=2, token_ids=[3], text="lo", finish_reason="length"),
                    ]
                    for event in events:  # one record each, as a worker's steps send them
                        batch = ResultBatch(source="w0", events=[event])
                        await kafka.send(topics.results.name, batch, key=rid, partition=req.reply_partition)
                    answered.append(rid)
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await kafka.stop()


def test_a_first_delta_without_an_accepted_reaches_the_client(make_stack):
    stack = make_stack()
    url = stack.gateway()

    async def run() -> tuple[str, str, list[str]]:
        stop, answered = asyncio.Event(), []
        worker = asyncio.create_task(_scripted_worker(stack, stop, answered))
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                while True:  # until the gateway counts the scripted worker (the event, not a sleep)
                    assert not worker.done(), worker.result()
                    try:
                        if (await client.get(f"{url}/health")).json()["workers"] >= 1:
                            break
                    except (httpx.HTTPError, ValueError):
                        pass
                    await asyncio.sleep(0.2)
                body = chat_body("hello", max_tokens=3)
                plain = (await client.post(f"{url}/v1/chat/completions", json=body)).json()
                text = plain["choices"][0]["message"]["content"]
                chunks = []
                async with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                                chunks.append(choice.get("delta", {}).get("content") or "")
                return text, "".join(chunks), answered
        finally:
            stop.set()
            await worker

    text, streamed, answered = asyncio.run(run())
    assert len(answered) == 2, answered
    assert text == "Hello"  # built from the stream's text, which always had every delta
    assert streamed == "Hello"  # the streamed one lacked "Hel"
