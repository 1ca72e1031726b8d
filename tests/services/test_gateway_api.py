"""The OpenAI-compatible API through the real stack: gateway → Kafka → scheduler → worker → gateway."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.services.conftest import chat_body, openai_client

pytestmark = pytest.mark.timeout(600)  # stacks or services start inside tests: their start counts


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(TANDEM_MAX_BODY_BYTES=20000).start()


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(f"{stack.url}/health", timeout=60).json()
    assert health["status"] == "ok" and health["workers"] == 1


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_sse_wire_format_ends_with_done(stack):
    body = chat_body("hi", max_tokens=5, stream=True)
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    json.loads(events[-2][6:])  # every other event is a JSON chunk


def test_completions_endpoint_text_and_token_prompt(client):
    r = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.usage.completion_tokens == 8 and r.choices[0].text
    r2 = client.completions.create(
        model="tiny", prompt=[1, 2, 3, 4], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r2.usage.prompt_tokens == 4 and r2.usage.completion_tokens == 4
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    greedy = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "y"}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = greedy.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    cut = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "y"}],
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_logprobs_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def test_be_class_by_header_and_service_tier(stack, client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, service_tier="flex"
    )
    assert r.usage.completion_tokens >= 1
    h = httpx.post(
        f"{stack.url}/v1/chat/completions", json=chat_body("hi", 4), headers={"X-Tandem-Class": "be"}, timeout=60
    )
    assert h.status_code == 200
    metrics = httpx.get(f"{stack.url}/metrics", timeout=60).text
    assert 'tandem_gateway_requests_total{endpoint="chat",req_class="be",status="200"} 2.0' in metrics


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "tiny"}, 400, "messages"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(stack, body, status, param):
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_invalid_json_too_large_and_context_overflow(stack):
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = chat_body("x" * 30000)
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    long_prompt = chat_body("word " * 2000)  # > the tiny model's 512-token context, < the body limit
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=long_prompt, timeout=30)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("x", max_tokens=600), timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    # the service is unharmed
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("ok", 3), timeout=30).status_code == 200


def test_overload_429_and_no_workers_503(stack, make_stack):
    url2 = stack.gateway("gateway-small", TANDEM_MAX_INFLIGHT=1)
    stack.wait_workers(1, gateway="gateway-small")
    body = chat_body("long", max_tokens=400, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{url2}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        second = httpx.post(f"{url2}/v1/chat/completions", json=chat_body("x", 2), timeout=30)
        assert second.status_code == 429 and second.json()["error"]["code"] == "overloaded"
    lonely = make_stack()  # its own topics: no workers there
    lonely.gateway()
    url3 = lonely.wait_gateway()
    r = httpx.post(f"{url3}/v1/chat/completions", json=chat_body("x", 2), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    assert httpx.get(f"{url3}/health", timeout=60).status_code == 503
