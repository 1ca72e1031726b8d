"""Abusive inputs get clear errors with bounded memory (issue 22): a huge `max_tokens`,
thousands of stop strings, deeply nested JSON, a client that never reads its SSE stream, and a
WebSocket flood of typing events."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from tests.services.conftest import chat_body

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack().start(("w0",))


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _metric(stack, name: str, labels: str = "") -> float:
    text = httpx.get(f"{stack.url}/metrics", timeout=30).text
    m = re.search(rf"^tandem_{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_huge_max_tokens_thousands_of_stops_and_deep_nesting_are_400s(stack):
    url = f"{stack.url}/v1/chat/completions"
    err = _error(httpx.post(url, json=chat_body("x", max_tokens=10**12), timeout=30), 400)
    assert "max_tokens" in err["message"]
    err = _error(httpx.post(url, json={**chat_body("x"), "stop": [f"s{i}" for i in range(5000)]}, timeout=30), 400)
    assert err["param"] == "stop" and "at most 4" in err["message"]
    nested = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = _error(httpx.post(url, content=nested, headers={"content-type": "application/json"}, timeout=30), 400)
    assert err["code"] == "invalid_json"
    r = httpx.post(url, json=chat_body("ok", max_tokens=3), timeout=60)
    assert r.status_code == 200, r.text  # unharmed


def test_a_client_that_never_reads_its_stream_is_cut_off_and_cancelled(stack):
    """The gateway holds one request's deltas at most (bounded by its max_tokens); when the client
    goes away without reading, the request is cancelled and the in-flight count returns to 0."""
    body = json.dumps(chat_body("go on forever", max_tokens=400, stream=True, ignore_eos=True)).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 300
    while _metric(stack, "gateway_inflight") < 1:  # waits for the request to be in flight
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()  # never read a byte
    deadline = time.monotonic() + 300
    while _metric(stack, "gateway_inflight") > 0:
        assert time.monotonic() < deadline, "the unread stream was never released"
        time.sleep(0.1)
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("ok", 3), timeout=60).status_code == 200


def test_websocket_flood_is_answered_and_debounced(stack):
    """5000 typing events in a burst: every frame gets an answer, bad frames an error frame,
    and only a handful of hints reach Kafka (one per session per debounce interval)."""
    from websockets.sync.client import connect

    sent_before = _metric(stack, "gateway_typing_hints_total", '{source="websocket",status="sent"}')
    ws_url = stack.url.replace("http://", "ws://") + "/v1/sessions/flood/events"
    frames = 5000
    with connect(ws_url, open_timeout=30, max_size=2**16) as ws:
        for i in range(frames):
            ws.send(json.dumps({"type": "typing"}) if i % 10 else "[" * 10_000)
        answers = [json.loads(ws.recv(timeout=60)) for _ in range(frames)]
    kinds = {a["type"] for a in answers}
    assert kinds == {"hint", "error"}
    assert sum(a["type"] == "error" for a in answers) == frames // 10
    sent = _metric(stack, "gateway_typing_hints_total", '{source="websocket",status="sent"}') - sent_before
    assert 1 <= sent <= 10, sent
    assert httpx.get(f"{stack.url}/health", timeout=30).status_code == 200
