"""Sessions across two real workers: a hint moves a session's KV to the idle worker over HTTP, a
turn with no hint leaves a busy holder, and a corrupt or truncated transfer is refused and the turn
recomputes. Every turn's greedy text equals a no-session run of the same conversation.

Set-up: only worker `wa` runs while the sessions' first turns are served (so `wa` holds them all),
then `wb` joins. Workers have 4 sequence slots and the scheduler's holder-room share is 0.25, so
a holder running one RT request has no room for a turn without a hint. The model is the tiny
Llama with a long context (`llama_long`), so that the busy holder's turn can run until the test
cancels it. Workers pull a turn's KV
whenever it has a source (`session_pull=always`): the cost model's choice on this tiny model is a
coin toss, and the test must know which path ran.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import signal
import threading
import time

import httpx
import pytest

from engine.llm import LLM, apply_chat_template
from engine.sampling import SamplingParams
from shared.kafka import KafkaClient
from shared.schemas.control import ControlEnvelope
from shared.schemas.sessions import Prefetch, SessionLocation, SessionPlacement, session_kv_url
from shared.schemas.telemetry import Heartbeat
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import current_term, worker_heartbeat

pytestmark = pytest.mark.timeout(400)
MAX_TOKENS = 24
SESSIONS = ("mig", "decoy", "nohint", "flip", "busy")
BLOCK = 16  # the engine's block size: only full blocks are kept and moved
MODEL = "llama_long"  # 8K context: the busy holder's turn runs until the test releases it
BUSY_TOKENS = 6000


def _turn1(sid: str) -> list[dict]:
    # The session id leads the system message, so no two sessions share a first KV block.
    return [
        {"role": "system", "content": f"{sid} session. You are a friendly assistant."},
        {"role": "user", "content": "Hello there. Tell me about the weather today, please."},
    ]


def _turn2(sid: str, reply: str) -> list[dict]:
    return [*_turn1(sid), {"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]


def _chat(stack, messages: list[dict], session: str | None, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def _cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


class Reference:
    """The same conversations on an in-process engine with no sessions and no prefix cache."""

    def __init__(self, model_dir) -> None:
        self.llm = LLM(
            model=str(model_dir), dtype="float32", kv_cache_gib=0.05, enable_prefix_caching=False, num_threads=1
        )

    def history(self, sid: str) -> int:
        """Tokens of turn 1's prompt in full blocks: what turn 2 reuses at least when the KV is there."""
        return len(apply_chat_template(self.llm.tokenizer, _turn1(sid))) // BLOCK * BLOCK

    def text(self, messages: list[dict]) -> str:
        ids = apply_chat_template(self.llm.tokenizer, messages)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        return self.llm.generate([ids], params)[0].text


class Probe:
    """Test-side Kafka access: read topics, publish as the advisory service or a worker would."""

    def __init__(self, stack) -> None:
        self.stack, self.topics = stack, Topics(stack.prefix)

    async def read_until(self, topic: str, match, decode, from_start: bool = True, limit_s: float = 120):
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=self.stack.bootstrap), "test-probe")
        consumer = await kafka.consumer(group=None)
        try:
            await kafka.assign_all(consumer, topic, from_end=not from_start)
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline:
                for msgs in (await consumer.getmany(timeout_ms=500)).values():
                    for m in msgs:
                        value = None if m.value is None else decode(m.value)
                        if value is not None and match(value):
                            return value
            raise AssertionError(f"nothing matched on {topic}\n{self.stack.logs()}")
        finally:
            await kafka.stop()

    async def publish(self, *items: tuple[str, object, str]) -> None:
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=self.stack.bootstrap), "test-publisher")
        await kafka.start()
        try:
            for topic, message, key in items:
                await kafka.send(topic, message, key=key)
        finally:
            await kafka.stop()

    def location(self, sid: str, worker: str, disk: bool = True) -> SessionLocation:
        return asyncio.run(
            self.read_until(
                self.topics.sessions_directory.name,
                lambda loc: loc.session_id == sid and loc.worker_id == worker and (not disk or "disk" in loc.tiers),
                SessionLocation.decode,
            )
        )


@pytest.fixture(scope="module")
def stack(make_stack, tiny_model_dir):
    s = make_stack(
        MODEL, TANDEM_MAX_NUM_SEQS=4, TANDEM_HOLDER_ROOM=0.25, TANDEM_PLACEMENT_TTL_S=60, TANDEM_SESSION_PULL="always"
    )
    s.scheduler()
    s.advisory()
    s.worker("wa")
    s.gateway()
    s.wait_workers(1)
    s.turn1 = {sid: _chat(s, _turn1(sid), sid) for sid in SESSIONS}
    s.worker("wb")
    s.wait_workers(2)
    s.probe = Probe(s)
    s.reference = Reference(tiny_model_dir(MODEL))
    return s


def _stats(stack, worker: str) -> dict:
    return httpx.get(f"{stack.url}/v1/sessions/stats", timeout=30).json()["workers"][worker]


def test_first_turns_are_kept_on_their_worker_and_reported_in_the_directory(stack):
    for sid, r in stack.turn1.items():
        assert r.headers["x-tandem-worker"] == "wa" and _cached(r) == 0
        assert _text(r) == stack.reference.text(_turn1(sid))
        loc = stack.probe.location(sid, "wa")
        assert loc.num_tokens >= stack.reference.history(sid) > 0 and loc.kv_url and not loc.dropped


def _hint_placement(stack, sid: str) -> SessionPlacement:
    assert httpx.post(f"{stack.url}/v1/sessions/{sid}/typing", timeout=30).json()["hint"] == "sent"
    return asyncio.run(
        stack.probe.read_until(
            stack.probe.topics.sessions_placement.name, lambda p: p.session_id == sid, SessionPlacement.decode
        )
    )


def test_hint_moves_the_session_to_the_less_loaded_worker_which_pulls_its_kv_over_http(stack):
    # Both workers are idle; a hint for `decoy` (also held by wa) stays on wa and is pending there,
    # so wa counts one advised turn more than wb when the hint for `mig` comes.
    decoy = _hint_placement(stack, "decoy")
    assert decoy.worker_id == "wa" and decoy.source_worker is None
    placement = _hint_placement(stack, "mig")
    assert placement.worker_id == "wb" and placement.source_worker == "wa"
    pulled = stack.probe.location("mig", "wb", disk=True)  # wb pulled the file from wa and adopted it
    assert pulled.num_tokens == stack.probe.location("mig", "wa").num_tokens
    messages = _turn2("mig", _text(stack.turn1["mig"]))
    r = _chat(stack, messages, "mig")
    assert r.headers["x-tandem-worker"] == "wb"
    assert _cached(r) >= stack.reference.history("mig")  # the conversation so far was not recomputed
    assert _text(r) == stack.reference.text(messages)
    _wait_stat(stack, "wb", "pulls", 1)
    _wait_stat(stack, "wa", "served_sessions", 1)


class BusyHolder:
    """A long streamed turn of the `busy` session, on its holder wa (idle, so it has room then);
    entered once its first token arrived, so the scheduler counts it on wa; on exit the stream
    is closed, which cancels the turn.

    Why it must be cancelled, not left to finish: the scheduler counts the turn on wa from its
    dispatch until a heartbeat of wa says it finished. A 400-token turn lasted 0.5 s on a quiet
    host (the tiny model decodes in ~1 ms), and the turn the test placed meanwhile went to wa
    once (its first 0.1 s of HTTP, Kafka and scheduler hops took longer than that): a race
    between two timings. A turn of thousands of tokens that ends only when the test closes it
    keeps wa busy for as long as the test needs, whatever the machine's load.

    "As long as the test needs" is still bounded: the context (8K) caps the turn at BUSY_TOKENS,
    6 to 15 s of decoding here. Should the turn end by itself before the test releases it, wa
    may have been idle when the turn under test was placed, and a `wa` there says nothing about
    the scheduler: `ended_by_itself` and `diagnosis()` tell that case apart from a real
    misplacement (a reroute, a worker declared lost), whose logs the failure then carries.
    """

    def __init__(self, stack) -> None:
        self.stack = stack
        self.started = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.ended_by_itself = False  # the stream finished before the test released it
        self.first_token_at = self.ended_at = 0.0

    def _run(self) -> None:
        messages = _turn2("busy", _text(self.stack.turn1["busy"]))
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": BUSY_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{self.stack.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "busy"}, timeout=120
        ) as r:
            self.worker = r.headers.get("x-tandem-worker")
            for line in r.iter_lines():
                if '"content"' in line and not self.started.is_set():
                    self.first_token_at = time.monotonic()
                    self.started.set()
                if self.release.is_set():
                    break  # closing the stream cancels the turn on wa
            else:
                self.ended_by_itself = not self.release.is_set()
        self.ended_at = time.monotonic()
        self.started.set()

    def __enter__(self):
        self.thread.start()
        assert self.started.wait(120)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(timeout=300)
        assert self.worker == "wa"

    def diagnosis(self) -> str:
        """Whether wa stayed busy until released, and every log line of the stack that could
        have freed wa's slot in the scheduler's view (a reroute, a lost worker, a broker restart
        seen, a lease lapse), which a tail of the logs may no longer hold."""
        ran = self.ended_at - self.first_token_at
        busy = (
            f"the busy turn ended by itself {ran:.1f} s after its first token, before the test released it"
            if self.ended_by_itself
            else "the busy turn ran on wa until the test released it"
        )
        signs = [
            f"{f.name}: {line}"
            for f in sorted(self.stack.log_dir.glob("*.log"))
            for line in f.read_text(errors="replace").splitlines()
            if any(word in line.lower() for word in ("rerout", "lost", "restart", "lease", "fence"))
        ]
        return "\n".join([busy, *signs[-50:], self.stack.logs()])


def test_turn_without_hint_leaves_a_busy_holder_and_the_new_worker_pulls_the_kv(stack):
    messages = _turn2("nohint", _text(stack.turn1["nohint"]))
    # the workers' counters are Counters: a key is absent while it is zero (wb has pulled nothing
    # yet when this test runs alone, without the hint test before it)
    pulls_before = _stats(stack, "wb").get("pulls", 0)
    with BusyHolder(stack) as busy:
        r = _chat(stack, messages, "nohint")
    assert r.headers["x-tandem-worker"] == "wb", busy.diagnosis()  # the holder wa had no room
    _wait_stat(stack, "wb", "pulls", pulls_before + 1)  # pulled while the turn waited (heartbeats lag)
    assert _cached(r) >= stack.reference.history("nohint")
    assert _text(r) == stack.reference.text(messages)


class TamperingServer:
    """Serves a real KV file with one byte flipped in a layer's payload, or cut short."""

    def __init__(self, data: bytes, mode: str) -> None:
        body = bytearray(data)
        if mode == "flip":
            body[len(body) // 2] ^= 0xFF
        else:
            body = body[: len(body) - 100]
        payload = bytes(body)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _wait_stat(stack, worker: str, key: str, at_least: float) -> None:
    """Until the worker's heartbeats report the session counter `key` at `at_least` or more."""
    stack.wait_until(f"{worker}: {key} >= {at_least}", lambda: _stats(stack, worker).get(key, 0) >= at_least)


def _evil_heartbeats(stack, url: str, stop: threading.Event) -> None:
    """A draining worker (never given work) whose directory entry points at the tampering server."""

    async def run():
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-evil")
        await kafka.start()
        while not stop.is_set():
            hb = Heartbeat(
                worker_id="evil",
                model="tiny",
                max_model_len=512,
                dispatch_topic="none",
                started_at=0,
                sent_at=time.time(),
                draining=True,
                kv_url=url,
            )
            await kafka.send(stack.probe.topics.heartbeats.name, hb, key="evil")
            await asyncio.sleep(0.25)
        await kafka.stop()

    asyncio.run(run())


def test_corrupt_and_truncated_transfers_are_refused_and_the_turn_recomputes(stack):
    hb = asyncio.run(worker_heartbeat(stack, "wa"))
    real = httpx.get(session_kv_url(hb.kv_url, "flip"), timeout=30).content
    flipped, truncated = TamperingServer(real, "flip"), TamperingServer(real, "truncate")
    stop = threading.Event()
    evil = threading.Thread(target=_evil_heartbeats, args=(stack, flipped.url, stop), daemon=True)
    evil.start()
    topics = stack.probe.topics
    try:
        refused_before = _stats(stack, "wb").get("pulls_refused", 0)
        loc = SessionLocation(
            session_id="flip",
            worker_id="evil",
            kv_url=flipped.url,
            tiers=["disk"],
            num_tokens=10_000,
            nbytes=len(real),
            last_activity=time.time() + 3600,
        )
        placement = SessionPlacement(  # in the active advisory's term, or the scheduler drops it
            session_id="flip",
            worker_id="wb",
            hint_id="test",
            expires_at=time.time() + 600,
            source_worker="evil",
            term=asyncio.run(current_term(stack, "advisory")),
        )
        asyncio.run(
            stack.probe.publish(
                (topics.sessions_directory.name, loc, "flip"), (topics.sessions_placement.name, placement, "flip")
            )
        )
        for n, server in enumerate((flipped, truncated), start=1):  # one after the other: a second
            prefetch = ControlEnvelope(
                message=Prefetch(  # prefetch would join the pull under way
                    worker_id="wb",
                    session_id="flip",
                    hint_id=f"test{n}",
                    source_worker="evil",
                    source_url=session_kv_url(server.url, "flip"),
                    source_tokens=10_000,
                    term=placement.term,  # workers drop a Prefetch from an older advisory term
                )
            )
            asyncio.run(stack.probe.publish((topics.control.name, prefetch, "flip")))
            _wait_stat(stack, "wb", "pulls_refused", refused_before + n)
        messages = _turn2("flip", _text(stack.turn1["flip"]))
        r = _chat(stack, messages, "flip")  # placed on wb; it pulls from its kv_source, the tampering server
        _wait_stat(stack, "wb", "pulls_refused", refused_before + 3)
    finally:
        stop.set()
        flipped.close()
        truncated.close()
    assert r.headers["x-tandem-worker"] == "wb" and _cached(r) == 0  # nothing usable arrived: recomputed
    assert _text(r) == stack.reference.text(messages)
    assert not list((stack.log_dir / "data").rglob("*.part"))  # no partial download left behind


def test_a_restarted_worker_finds_its_sessions_on_disk_and_reuses_them(stack):
    stack.kill("wa", signal.SIGTERM)  # a clean stop flushes queued session writes
    stack.worker("wa")  # same id, so the same state directory
    stack.wait_workers(2)
    stack.probe.location("decoy", "wa", disk=True)  # re-indexed and announced again
    messages = _turn2("decoy", _text(stack.turn1["decoy"]))
    worker, text, usage = _stream_chat(stack, messages, "decoy")
    assert worker == "wa"
    assert usage["prompt_tokens_details"]["cached_tokens"] >= stack.reference.history("decoy")  # disk tier
    assert text == stack.reference.text(messages)


def _stream_chat(stack, messages: list[dict], session: str) -> tuple[str, str, dict]:
    """A streamed turn: its worker, text and the usage chunk (which carries cached_tokens too)."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = "", None
    with httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        return r.headers["x-tandem-worker"], text, usage
