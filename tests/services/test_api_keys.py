"""API keys through the real stack (issue 22): keys made with `tandem keys`, checked by the
gateway on every `/v1` route, with per-key limits, classes, ownership and cache salts."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.services.conftest import chat_body

pytestmark = pytest.mark.timeout(600)
KEY_TTL_S = 0.5
# Long enough to fill several KV blocks, so a prefix-cache hit shows in cached_tokens.
LONG_PROMPT = " ".join(f"word{i}" for i in range(40))


def tandem_keys(stack, *argv: str) -> str:
    """`tandem keys ...` against the stack's database; its stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "keys", *argv],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


def create_key(stack, name: str, *flags: str) -> dict:
    return json.loads(tandem_keys(stack, "create", "--name", name, "--json", *flags))


def bearer(key: dict | str) -> dict:
    return {"Authorization": f"Bearer {key if isinstance(key, str) else key['key']}"}


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(TANDEM_KEY_CACHE_TTL_S=KEY_TTL_S)
    s.log_dir.joinpath("data").mkdir(exist_ok=True)
    s.keys = {  # created before the gateway starts: it comes up closed
        "a": create_key(s, "tenant-a"),
        "b": create_key(s, "tenant-b"),
        "be": create_key(s, "be-only", "--classes", "be", "--batch-quota", "2"),
        "rt": create_key(s, "rt-only", "--classes", "rt"),
        "slow": create_key(s, "slow", "--rps", "0.01"),
        "tpm": create_key(s, "tpm", "--tpm", "1"),
        "admin": create_key(s, "ops", "--admin"),
    }
    return s.start(("w0",), queue=True)


def chat(stack, key, content: str = "hello", **headers) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=chat_body(content, max_tokens=4),
        headers={**(bearer(key) if key else {}), **headers},
        timeout=120,
    )


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_missing_wrong_and_malformed_keys_get_401(stack):
    for headers in ({}, {"Authorization": "Bearer sk-tandem-000000000000-nope"}, {"Authorization": "Basic abc"}):
        r = httpx.get(f"{stack.url}/v1/models", headers=headers, timeout=30)
        assert_openai_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    # a real key's id with another key's secret
    forged = stack.keys["a"]["key"].rsplit("-", 1)[0] + "-" + stack.keys["b"]["key"].rsplit("-", 1)[1]
    assert_openai_error(httpx.get(f"{stack.url}/v1/models", headers=bearer(forged), timeout=30), 401, "invalid_api_key")
    assert httpx.get(f"{stack.url}/v1/models", headers=bearer(stack.keys["a"]), timeout=30).status_code == 200


def test_open_routes_stay_open(stack):
    for path in ("/health", "/metrics", "/", "/openapi.json"):
        assert httpx.get(f"{stack.url}{path}", timeout=30).status_code == 200, path


def test_class_rules(stack):
    """A key's default class is RT when allowed; naming a class the key lacks is a 403, never a downgrade."""
    assert chat(stack, stack.keys["be"]).status_code == 200  # names no class: runs BE
    err = assert_openai_error(chat(stack, stack.keys["be"], **{"X-Tandem-Class": "rt"}), 403, "class_not_allowed")
    assert err["type"] == "permission_error"
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=chat_body("hi", max_tokens=4, service_tier="priority"),
        headers=bearer(stack.keys["be"]),
        timeout=60,
    )
    assert_openai_error(r, 403, "class_not_allowed")
    assert_openai_error(chat(stack, stack.keys["rt"], **{"X-Tandem-Class": "be"}), 403, "class_not_allowed")
    assert chat(stack, stack.keys["rt"], **{"X-Tandem-Class": "rt"}).status_code == 200


def test_requests_per_second_limit_is_429_with_retry_after(stack):
    key = stack.keys["slow"]  # 0.01 requests/s: one request, then none for 100 s
    assert httpx.get(f"{stack.url}/v1/models", headers=bearer(key), timeout=30).status_code == 200
    r = httpx.get(f"{stack.url}/v1/models", headers=bearer(key), timeout=30)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "requests" and 1 <= int(r.headers["retry-after"]) <= 100
    assert httpx.get(f"{stack.url}/v1/models", headers=bearer(stack.keys["a"]), timeout=30).status_code == 200


def test_tokens_per_minute_charged_when_a_stream_ends(stack):
    key = stack.keys["tpm"]  # 1 token/min: the first request fits, its usage is a debt for minutes
    first = chat(stack, key)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    r = chat(stack, key)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "tokens" and int(r.headers["retry-after"]) >= 60 * (used - 1)
    # it does not limit the key's other requests
    assert httpx.get(f"{stack.url}/v1/models", headers=bearer(key), timeout=30).status_code == 200


def test_revoke_takes_effect_within_the_cache_ttl(stack):
    key = create_key(stack, "short-lived")
    assert chat(stack, key).status_code == 200
    tandem_keys(stack, "revoke", key["id"])
    # The revocation is committed when the CLI returns. The gateway stamps a cached record with
    # the time before its read, so the record it holds was read before now and expires within
    # a TTL of now: a request sent a TTL later must be refused, however slow the machine (the
    # old check polled until a wall-clock bound of TTL + 10 s, which a starved gateway missed).
    expires = time.monotonic() + KEY_TTL_S
    while (left := expires - time.monotonic()) > 0:  # the TTL itself is the event waited for
        time.sleep(left)
    r = httpx.get(f"{stack.url}/v1/models", headers=bearer(key), timeout=30)
    assert r.status_code == 401, "revoked key still accepted a TTL after the revocation"
    assert "revoked" in r.json()["error"]["message"]
    listed = json.loads(tandem_keys(stack, "list", "--all", "--json"))
    assert next(k for k in listed if k["id"] == key["id"])["revoked_at"] is not None
    assert key["id"] not in {k["id"] for k in json.loads(tandem_keys(stack, "list", "--json"))}


def _cached(stack, key) -> int:
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=chat_body(LONG_PROMPT, max_tokens=2),
        headers=bearer(key),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_is_isolated_between_keys(stack):
    """Tenant B's first send of tenant A's prompt hits nothing; A's second send hits its own KV."""
    a, b = stack.keys["a"], stack.keys["b"]
    assert _cached(stack, a) == 0
    assert _cached(stack, b) == 0
    assert _cached(stack, a) > 0
    assert _cached(stack, b) > 0


def test_files_and_batches_belong_to_their_key(stack):
    a, b = stack.keys["a"], stack.keys["b"]
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": chat_body("hi", max_tokens=2)}
    content = (json.dumps(line) + "\n").encode()
    up = httpx.post(
        f"{stack.url}/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch"},
        headers=bearer(a),
        timeout=60,
    )
    assert up.status_code == 200, up.text
    file_id = up.json()["id"]
    assert httpx.get(f"{stack.url}/v1/files/{file_id}", headers=bearer(b), timeout=30).status_code == 404
    assert file_id not in {
        f["id"] for f in httpx.get(f"{stack.url}/v1/files", headers=bearer(b), timeout=60).json()["data"]
    }
    batch = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = httpx.post(f"{stack.url}/v1/batches", json=batch, headers=bearer(b), timeout=30)
    assert_openai_error(r, 404, "not_found")
    r = httpx.post(f"{stack.url}/v1/batches", json=batch, headers=bearer(a), timeout=30)
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]
    assert httpx.get(f"{stack.url}/v1/batches/{batch_id}", headers=bearer(b), timeout=30).status_code == 404
    assert httpx.post(f"{stack.url}/v1/batches/{batch_id}/cancel", headers=bearer(b), timeout=30).status_code == 404
    assert httpx.get(f"{stack.url}/v1/batches/{batch_id}", headers=bearer(a), timeout=30).status_code == 200


def _upload(stack, key, n: int) -> str:
    lines = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat_body("hi", max_tokens=2)}
        for i in range(n)
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    r = httpx.post(
        f"{stack.url}/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch"},
        headers=bearer(key),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_batch_quota_and_batch_class(stack):
    be, rt = stack.keys["be"], stack.keys["rt"]  # be: quota of 2 requests in unfinished batches
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = httpx.post(
        f"{stack.url}/v1/batches", json={**body, "input_file_id": _upload(stack, be, 3)}, headers=bearer(be), timeout=60
    )
    err = assert_openai_error(r, 429, "batch_quota_exceeded")
    assert int(r.headers["retry-after"]) >= 1 and "3 requests" in err["message"]
    r = httpx.post(
        f"{stack.url}/v1/batches", json={**body, "input_file_id": _upload(stack, be, 2)}, headers=bearer(be), timeout=60
    )
    assert r.status_code == 200, r.text
    # an RT-only key may not run batches (their items are best-effort)
    r = httpx.post(
        f"{stack.url}/v1/batches", json={**body, "input_file_id": _upload(stack, rt, 1)}, headers=bearer(rt), timeout=60
    )
    assert_openai_error(r, 403, "class_not_allowed")


def test_keys_over_http_need_an_admin_key(stack):
    assert_openai_error(
        httpx.get(f"{stack.url}/v1/keys", headers=bearer(stack.keys["a"]), timeout=30), 403, "admin_required"
    )
    admin = bearer(stack.keys["admin"])
    r = httpx.post(f"{stack.url}/v1/keys", json={"name": "from-http", "classes": ["be"]}, headers=admin, timeout=30)
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["key"].startswith("sk-tandem-") and made["classes"] == ["be"]
    assert chat(stack, made["key"]).status_code == 200
    listed = httpx.get(f"{stack.url}/v1/keys", headers=admin, timeout=30).json()["data"]
    assert made["id"] in {k["id"] for k in listed} and all("key" not in k for k in listed)
    r = httpx.post(f"{stack.url}/v1/keys", json={"name": "x", "classes": ["gpu"]}, headers=admin, timeout=30)
    assert_openai_error(r, 400, "invalid_value")
    assert httpx.delete(f"{stack.url}/v1/keys/{made['id']}", headers=admin, timeout=30).status_code == 200
    assert_openai_error(chat(stack, made["key"]), 401, "invalid_api_key")  # this replica forgot it at once
    assert_openai_error(httpx.delete(f"{stack.url}/v1/keys/ffffffffffff", headers=admin, timeout=60), 404, "not_found")


def test_typing_hints_and_websocket_need_a_key(stack):
    r = httpx.post(f"{stack.url}/v1/sessions/s1/typing", json={}, timeout=30)
    assert_openai_error(r, 401, "invalid_api_key")
    r = httpx.post(f"{stack.url}/v1/sessions/s1/typing", json={}, headers=bearer(stack.keys["a"]), timeout=30)
    assert r.status_code == 202, r.text
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws_url = stack.url.replace("http://", "ws://") + "/v1/sessions/s1/events"
    with pytest.raises(InvalidStatus):
        connect(ws_url, open_timeout=30).close()
    # a browser cannot set headers: the key as a subprotocol
    with connect(ws_url, subprotocols=["tandem.v1", f"tandem-key.{stack.keys['a']['key']}"], open_timeout=30) as ws:
        assert ws.subprotocol == "tandem.v1"


def test_warning_when_listening_beyond_loopback_without_keys(make_stack):
    open_stack = make_stack()
    open_stack.gateway("exposed", TANDEM_HOST="0.0.0.0")
    log = open_stack.log_dir / "exposed.log"
    deadline = time.monotonic() + 120
    while "not a loopback address" not in (log.read_text(errors="replace") if log.exists() else ""):
        open_stack.check_alive()
        assert time.monotonic() < deadline, open_stack.logs()
        time.sleep(0.1)
    assert "tandem keys create" in log.read_text()
