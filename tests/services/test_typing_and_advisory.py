"""Typing hints through the real gateway and the real advisory service, over the real broker.

The workers here are played by the test (heartbeats, telemetry and session locations published to
the broker as workers do), so the advisory service's choices can be steered by load; the real
workers' side (pull, serve, cached tokens) is tested in test_session_migration.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from websockets.sync.client import connect

from shared.kafka import KafkaClient
from shared.schemas.control import ControlEnvelope
from shared.schemas.sessions import Prefetch, SessionLocation, SessionPlacement, TypingHint
from shared.schemas.telemetry import ClassLoad, Heartbeat, Telemetry
from shared.settings import ServiceSettings
from shared.topics import Topics

pytestmark = pytest.mark.timeout(600)  # stacks or services start inside tests: their start counts
DEBOUNCE_S = 1.0
TTL_S = 4.0
# the arrival the advisory assumes for a hint naming none (60 s by default): short here, so a
# placement without a turn expires within the test; set, so the setting's name is checked too
DEFAULT_ARRIVAL_S = 1.0


class FakeWorkers:
    """Two workers' heartbeats and telemetry, from a thread: `wa` runs one RT request, `wb` none."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.bootstrap, self.topics = bootstrap, topics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _run(self) -> None:
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=self.bootstrap), "fake-workers")
        await kafka.start()
        try:
            while not self._stop.is_set():
                for wid, running in (("wa", 1), ("wb", 0)):
                    await kafka.send(self.topics.heartbeats.name, _heartbeat(wid), key=wid)
                    await kafka.send(
                        self.topics.telemetry.name,
                        Telemetry(worker_id=wid, sent_at=time.time(), rt=ClassLoad(running=running), max_num_seqs=4),
                        key=wid,
                    )
                await asyncio.sleep(0.25)
        finally:
            await kafka.stop()


def _heartbeat(wid: str) -> Heartbeat:
    return Heartbeat(
        worker_id=wid,
        model="tiny",
        max_model_len=512,
        dispatch_topic=f"d.{wid}",
        started_at=0,
        sent_at=time.time(),
        kv_url=f"http://{wid}:9",
    )


def _location(sid: str, wid: str = "wa") -> SessionLocation:
    return SessionLocation(
        session_id=sid,
        worker_id=wid,
        kv_url=f"http://{wid}:9",
        tiers=["gpu", "disk"],
        num_tokens=64,
        nbytes=4096,
        last_activity=time.time(),
    )


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(
        TANDEM_TYPING_DEBOUNCE_S=DEBOUNCE_S, TANDEM_PLACEMENT_TTL_S=TTL_S, TANDEM_DEFAULT_ARRIVAL_S=DEFAULT_ARRIVAL_S
    )
    topics = Topics(s.prefix)
    s.kafka = KafkaClient(ServiceSettings(kafka_bootstrap=s.bootstrap), "test-probe")
    asyncio.run(_publish_locations(s, ["s1", "s2", "s5"]))  # before the advisory service starts
    fakes = FakeWorkers(s.bootstrap, topics)
    fakes.start()
    try:  # the fake workers stop also when the start fails (the stack itself: make_stack)
        s.gateway()
        s.advisory()
        s.wait_log("advisory", "advisory active (term")  # ready to act: it holds the lease
        s.wait_gateway()
        yield s
    finally:
        fakes.stop()


async def _publish_locations(stack, sids: list[str]) -> None:
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-locations")
    await kafka.start(Topics(stack.prefix).static())
    for sid in sids:
        await kafka.send(Topics(stack.prefix).sessions_directory.name, _location(sid), key=sid)
    await kafka.stop()


class Reader:
    """A group-less consumer of one topic, positioned at its end when created."""

    def __init__(self, stack, topic: str) -> None:
        self.stack, self.topic = stack, topic

    async def __aenter__(self):
        self.kafka = KafkaClient(ServiceSettings(kafka_bootstrap=self.stack.bootstrap), "test-reader")
        self.consumer = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(self.consumer, self.topic, from_end=True)
        return self

    async def __aexit__(self, *exc):
        await self.kafka.stop()

    async def everything(self, decode) -> list:
        """Every message produced so far (a topic's partitions interleave in no fixed order)."""
        tps = list(self.consumer.assignment())
        end = await self.consumer.end_offsets(tps)
        seen = []
        while [tp for tp in tps if await self.consumer.position(tp) < end[tp]]:
            for msgs in (await self.consumer.getmany(timeout_ms=500)).values():
                seen += [(m.key.decode(), decode(m.value)) for m in msgs]
        return seen

    async def until(self, match, decode, limit: int = 500) -> list:
        """Messages (key, decoded value or None) up to and including the first that `match`es."""
        seen = []
        for _ in range(limit):
            m = await asyncio.wait_for(self.consumer.getone(), 60)
            item = (m.key.decode() if m.key else None, None if m.value is None else decode(m.value))
            seen.append(item)
            if match(*item):
                return seen
        raise AssertionError(f"no match in {seen}")


def _post_typing(url: str, sid: str, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions/{sid}/typing", json=body, timeout=30, **kw)


def test_typing_post_publishes_one_hint_per_burst(stack):
    async def run():
        async with Reader(stack, Topics(stack.prefix).advisory.name) as hints:
            first = _post_typing(stack.url, "chat-1", {"expected_arrival_s": 4.5})
            repeat = _post_typing(stack.url, "chat-1")
            other = _post_typing(stack.url, "chat-2")
            seen = await hints.everything(TypingHint.decode)  # the gateway answered after the broker's ack
        return first, repeat, other, seen

    first, repeat, other, seen = asyncio.run(run())
    assert first.status_code == 202 and first.json() == {"session_id": "chat-1", "hint": "sent"}
    assert repeat.status_code == 202 and repeat.json()["hint"] == "debounced"
    assert other.json()["hint"] == "sent" and [k for k, _ in seen if k == "chat-2"] == ["chat-2"]
    chat1 = [v for k, v in seen if k == "chat-1"]
    assert len(chat1) == 1 and chat1[0].expected_arrival_s == 4.5 and chat1[0].source == "http"


def test_websocket_events_are_debounced_and_bad_frames_keep_the_socket_open(stack):
    ws_url = stack.url.replace("http://", "ws://") + "/v1/sessions/chat-ws/events"

    async def run():
        async with Reader(stack, Topics(stack.prefix).advisory.name) as hints:
            answers = await asyncio.to_thread(_websocket_session, ws_url)
            seen = await hints.until(lambda k, v: k == "chat-ws" and v.expected_arrival_s == 2.0, TypingHint.decode)
        return answers, seen

    answers, seen = asyncio.run(run())
    assert [a["status"] for a in answers[:3]] == ["sent", "debounced", "debounced"]
    assert [a["type"] for a in answers[3:6]] == ["error"] * 3
    assert "JSON" in answers[3]["message"] and "type" in answers[4]["message"]
    assert answers[6] == {"type": "hint", "status": "sent"}  # the socket survived; a new burst, a new hint
    ws_hints = [v for k, v in seen if k == "chat-ws"]
    assert len(ws_hints) == 2 and {h.source for h in ws_hints} == {"websocket"}


def _websocket_session(url: str) -> list[dict]:
    answers = []
    with connect(url) as ws:
        for frame in (
            '{"type": "keystroke"}',
            '{"type": "keystroke"}',
            '{"type": "typing"}',
            "{not json",
            '{"type": "paste"}',
            '{"type": "typing", "expected_arrival_s": -3}',
        ):
            ws.send(frame)
            answers.append(json.loads(ws.recv(timeout=30)))
        time.sleep(DEBOUNCE_S + 0.1)  # the burst is over
        ws.send('{"type": "typing", "expected_arrival_s": 2}')
        answers.append(json.loads(ws.recv(timeout=30)))
    return answers


@pytest.mark.parametrize(
    "path,body,status,param,code",
    [
        ("/v1/sessions/s/typing", b"{not json", 400, None, "invalid_json"),
        ("/v1/sessions/s/typing", b"[1, 2]", 400, None, "invalid_json"),
        ("/v1/sessions/s/typing", b'{"expected_arrival_s": -1}', 400, "expected_arrival_s", "invalid_value"),
        ("/v1/sessions/s/typing", b'{"expected_arrival_s": "soon"}', 400, "expected_arrival_s", "invalid_value"),
        ("/v1/sessions/s/typing", b" " * 5000, 413, None, "request_too_large"),
        ("/v1/sessions/" + "x" * 300 + "/typing", b"", 400, "session_id", "invalid_value"),
    ],
)
def test_bad_typing_requests_get_openai_errors(stack, path, body, status, param, code):
    r = httpx.post(stack.url + path, content=body, timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"] == code
    assert err["param"] == param


def test_bad_session_id_on_the_websocket_is_an_error_frame(stack):
    url = stack.url.replace("http://", "ws://") + "/v1/sessions/" + "x" * 300 + "/events"
    with connect(url) as ws:
        answer = json.loads(ws.recv(timeout=30))
    assert answer["type"] == "error" and "session id" in answer["message"]


def _placed(sid: str):
    return lambda k, v: k == sid and v is not None


async def _hint_and_collect(stack, sid: str) -> tuple[Prefetch, SessionPlacement]:
    topics = Topics(stack.prefix)
    async with Reader(stack, topics.control.name) as control, Reader(stack, topics.sessions_placement.name) as plc:
        assert _post_typing(stack.url, sid).json()["hint"] == "sent"
        prefetches = await control.until(
            lambda k, v: isinstance(v.message, Prefetch) and v.message.session_id == sid, ControlEnvelope.decode
        )
        placements = await plc.until(_placed(sid), SessionPlacement.decode)
    return prefetches[-1][1].message, placements[-1][1]


def test_advisory_moves_a_hinted_session_off_its_busy_holder_and_counts_pending_hints(stack):
    pre1, plc1 = asyncio.run(_hint_and_collect(stack, "s1"))
    # wa (the holder) runs a request, wb is idle: s1 goes to wb, which pulls it from wa.
    assert plc1.worker_id == "wb" and plc1.source_worker == "wa" and plc1.hint_id == pre1.hint_id
    assert pre1.worker_id == "wb" and pre1.source_url == "http://wa:9/kv/v1/sessions/s1"
    assert pre1.ttl_s == TTL_S + DEFAULT_ARRIVAL_S  # the hint named no arrival: the default one
    pre2, plc2 = asyncio.run(_hint_and_collect(stack, "s2"))
    # s1's advised turn is pending on wb: wb and wa now weigh the same, and the holder wins ties.
    assert plc2.worker_id == "wa" and plc2.source_worker is None and pre2.source_url is None


def test_placements_without_a_turn_expire(stack):
    async def run():
        async with Reader(stack, Topics(stack.prefix).sessions_placement.name) as plc:
            assert _post_typing(stack.url, "s5").json()["hint"] == "sent"
            return await plc.until(lambda k, v: k == "s5" and v is None, SessionPlacement.decode)

    seen = [item for item in asyncio.run(run()) if item[0] == "s5"]
    assert seen[0][1].worker_id in ("wa", "wb") and seen[-1] == ("s5", None)  # placed, then a tombstone


def test_a_restarted_advisory_service_rebuilds_its_directory_from_the_topic(stack):
    stack.kill("advisory", signal.SIGKILL)
    asyncio.run(_publish_locations(stack, ["s4"]))  # known only through the compacted topic
    stack.advisory("advisory-2")
    stack.wait_log("advisory-2", "advisory active (term")  # after the killed one's lease ran out
    assert "directory rebuilt: 4 sessions" in (stack.log_dir / "advisory-2.log").read_text()
    pre, plc = asyncio.run(_hint_and_collect(stack, "s4"))
    assert plc.worker_id == "wb" and pre.source_worker == "wa"


def test_an_advisory_pair_hands_over_and_a_hint_sent_meanwhile_is_placed_once(stack):
    """Two advisory services: SIGKILL the active one and send a hint at once (no active reads
    it): the standby takes over, reads it from the group's committed offsets and places the
    session, stamped with its own, higher lease term."""
    asyncio.run(_publish_locations(stack, ["s6"]))  # a session no hint has named yet
    stack.advisory("advisory-3")
    stack.wait_log("advisory-3", "advisory standing by")
    stack.kill("advisory-2", signal.SIGKILL)
    pre, plc = asyncio.run(_hint_and_collect(stack, "s6"))
    assert plc.worker_id in ("wa", "wb") and pre.worker_id == plc.worker_id
    assert plc.term == pre.term == 3  # advisory (1), advisory-2 (2), now advisory-3
    log = (stack.log_dir / "advisory-3.log").read_text(errors="replace")
    assert "advisory active (term 3)" in log and "directory rebuilt: 5 sessions" in log
