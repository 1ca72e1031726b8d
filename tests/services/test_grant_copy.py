"""When a gateway sends a granted request's flagged copy to `requests.rt`
(`GatewaySettings.rt_grant_copy_after_ms`, services/gateway/core.py; docs/services.md, issue 21,
twelfth session), on the real broker: the gateway's Kafka client is the real one, which also
records the order of its sends (what these tests are about). The real-stack behaviour of grants
is `test_rt_grants.py`."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from services.gateway.core import GatewayCore
from services.gateway.settings import GatewaySettings
from shared.kafka import KafkaClient
from shared.schemas.grants import PlacementGrant, WorkerGrant
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, ResultBatch
from shared.schemas.telemetry import Heartbeat
from shared.topics import Topics

PREFIX = "gcopy"


class RecordingKafka(KafkaClient):
    """The real client, noting (topic, request id, attempt) in the order the sends were made."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, str, int]] = []

    async def send(self, topic, message, **kwargs):
        self.sent.append((topic, message.request_id, message.attempt))
        return await super().send(topic, message, **kwargs)

    async def send_nowait(self, topic, message, **kwargs):
        self.sent.append((topic, message.request_id, message.attempt))
        return await super().send_nowait(topic, message, **kwargs)


_clients: list[RecordingKafka] = []


@pytest_asyncio.fixture(autouse=True)
async def _stop_clients():
    """Each test's client is stopped after it, on the test's loop."""
    yield
    while _clients:
        await _clients.pop().stop()


async def _core(bootstrap: str, after_ms: float) -> tuple[GatewayCore, RecordingKafka]:
    settings = GatewaySettings(
        kafka_bootstrap=bootstrap, topic_prefix=PREFIX, rt_grants=True, rt_grant_copy_after_ms=after_ms
    )
    core = GatewayCore(settings)
    topics = Topics(PREFIX)
    core.kafka = kafka = RecordingKafka(settings, "test-grant-copy")
    _clients.append(kafka)
    await kafka.start([topics.dispatch("w0"), topics.rt_requests])
    now = time.time()
    core.workers.on_heartbeat(
        Heartbeat(
            worker_id="w0",
            model="m",
            max_model_len=2048,
            dispatch_topic=f"{PREFIX}.dispatch.w0",
            started_at=now,
            sent_at=now,
            epoch=1,
        )
    )
    core.grants.on_grant(
        PlacementGrant(
            scheduler_id="s",
            term=1,
            sequence=1,
            sent_at=now,
            ttl_s=60,
            workers=[WorkerGrant(worker_id="w0", epoch=1, model="m", slots=4)],
        )
    )
    return core, kafka


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        messages=[{"role": "user", "content": "hi"}],
        gateway_id="g",
        reply_partition=0,
        model="m",
        kind="chat",
        created_at=time.time(),
        req_class="rt",
    )


DISPATCH, COPY = f"{PREFIX}.dispatch.w0", f"{PREFIX}.requests.rt"


async def _open_and_submit(core: GatewayCore, rid: str) -> None:
    request = _req(rid)
    core.streams.open(request)
    await core.submit(request)


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_at_zero_the_copy_goes_with_the_dispatch(kafka_bootstrap):
    core, kafka = await _core(kafka_bootstrap, 0)
    await _open_and_submit(core, "r0")
    assert kafka.sent == [(DISPATCH, "r0", 0), (COPY, "r0", 0)]
    assert not core._held_copies


@pytest.mark.asyncio
async def test_the_copy_waits_for_the_first_token_not_the_acceptance(kafka_bootstrap):
    core, kafka = await _core(kafka_bootstrap, 10_000)  # the bound out of the way
    await _open_and_submit(core, "r0")
    assert kafka.sent == [(DISPATCH, "r0", 0)]
    await core.route(ResultBatch(source="w0", events=[Accepted(request_id="r0", worker_id="w0", prompt_tokens=3)]))
    await _turns()
    assert kafka.sent == [(DISPATCH, "r0", 0)]
    stream = core.streams.get("r0")
    await core.route(ResultBatch(source="w0", events=[Delta(request_id="r0", index=0, token_ids=[7], text="a")]))
    assert stream.events.qsize() == 2  # the token is the client's before the copy is sent
    await _turns()
    assert kafka.sent == [(DISPATCH, "r0", 0), (COPY, "r0", 0)]
    await core.route(ResultBatch(source="w0", events=[Delta(request_id="r0", index=1, token_ids=[8], text="b")]))
    await _turns()
    assert len(kafka.sent) == 2  # once


@pytest.mark.asyncio
async def test_the_copy_goes_after_the_bound_without_any_event(kafka_bootstrap):
    core, kafka = await _core(kafka_bootstrap, 30)
    await _open_and_submit(core, "r0")
    await asyncio.sleep(0.01)
    assert kafka.sent == [(DISPATCH, "r0", 0)]
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(kafka.sent) == 2:
            break
    assert kafka.sent == [(DISPATCH, "r0", 0), (COPY, "r0", 0)]


@pytest.mark.asyncio
async def test_a_stream_closed_first_sends_its_copy_at_once_and_frees_its_slot(kafka_bootstrap):
    core, kafka = await _core(kafka_bootstrap, 10_000)
    await _open_and_submit(core, "r0")
    assert core.grants._in_flight["w0"] == 1
    core.streams.close("r0")
    await _turns()
    assert kafka.sent == [(DISPATCH, "r0", 0), (COPY, "r0", 0)]
    assert core.grants._in_flight["w0"] == 0 and not core._held_copies


@pytest.mark.asyncio
async def test_a_resumed_attempt_follows_the_first_attempts_copy(kafka_bootstrap):
    """A gap in the stream before the first token's copy left: the scheduler must read the
    copy of attempt 0 before attempt 1 (its assignment table keeps one entry per request)."""
    core, kafka = await _core(kafka_bootstrap, 10_000)
    await _open_and_submit(core, "r0")
    await core.route(ResultBatch(source="w0", events=[Delta(request_id="r0", index=3, token_ids=[7], text="a")]))
    assert kafka.sent == [(DISPATCH, "r0", 0), (COPY, "r0", 0), (COPY, "r0", 1)]  # a gap: resumed


@pytest.mark.asyncio
async def test_a_broker_restart_drops_the_held_copies(kafka_bootstrap):
    core, kafka = await _core(kafka_bootstrap, 30)
    await _open_and_submit(core, "r0")
    core._held_copies.pop("r0")[2].cancel()  # what `_on_broker_restart` does to each
    await asyncio.sleep(0.06)
    assert kafka.sent == [(DISPATCH, "r0", 0)]
