"""The worker KV server authenticates its peers (issue 22 part B): with a cluster secret, only
requests signed with it are served (HMAC, timestamp, one-time nonce); a puller with the secret
gets the file, everyone else a 401 and nothing. A real `KVServer` on a port, real HTTP."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from services.worker.kv_auth import MAX_SKEW_S, PeerVerifier, sign
from services.worker.kv_pull import KVPuller, PullError
from services.worker.kv_server import KVServer
from shared.schemas.sessions import KV_PATH
from tests.services.conftest import worker_heartbeat

SECRET = "s3cret-of-this-cluster"
PAYLOAD = b"KV" * 5000


async def _server(tmp_path: Path, verifier: PeerVerifier | None) -> KVServer:
    kv_file = tmp_path / "s1.kv"
    kv_file.write_bytes(PAYLOAD)

    async def export_path(session_id: str) -> Path | None:
        return kv_file if session_id == "s1" else None

    server = KVServer("127.0.0.1", 0, export_path, verifier)
    await server.start()
    return server


def test_a_signed_peer_is_served_and_everyone_else_refused(tmp_path):
    async def run():
        server = await _server(tmp_path, PeerVerifier(SECRET))
        url = f"http://127.0.0.1:{server.port}{KV_PATH}s1"
        path = f"{KV_PATH}s1"
        try:
            peer = KVPuller(tmp_path / "in", timeout_s=10, max_bytes=1 << 20, secret=SECRET)
            pulled = await peer.fetch(url)
            assert pulled.path.read_bytes() == PAYLOAD
            await peer.close()
            async with httpx.AsyncClient(timeout=60) as client:
                refused = {}
                refused["no signature"] = await client.get(url)
                wrong = KVPuller(tmp_path / "in2", timeout_s=10, max_bytes=1 << 20, secret="another-secret")
                with pytest.raises(PullError, match="HTTP 401"):
                    await wrong.fetch(url)
                await wrong.close()
                headers = sign(SECRET, "GET", path)
                assert (await client.get(url, headers=headers)).status_code == 200
                refused["replayed"] = await client.get(url, headers=headers)
                other = f"http://127.0.0.1:{server.port}{KV_PATH}s2"  # signed for s1, sent for s2
                refused["other path"] = await client.get(other, headers=sign(SECRET, "GET", path))
                stale = sign(SECRET, "GET", path, now=time.time() - MAX_SKEW_S - 5)
                refused["stale"] = await client.get(url, headers=stale)
            for why, r in refused.items():
                assert r.status_code == 401, why
                assert r.content.startswith(b'{"error"') and PAYLOAD[:100] not in r.content, why
            assert server.refused == len(refused) + 1  # + the wrong secret
            assert not list((tmp_path / "in2").glob("*"))  # the refused pull left nothing behind
        finally:
            await server.stop()

    asyncio.run(run())


def test_without_a_secret_the_server_is_open_as_before(tmp_path):
    async def run():
        server = await _server(tmp_path, None)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.get(f"http://127.0.0.1:{server.port}{KV_PATH}s1")
            assert r.status_code == 200 and r.content == PAYLOAD
        finally:
            await server.stop()

    asyncio.run(run())


def test_the_verifier_rejects_tampering_and_forgets_old_nonces():
    v = PeerVerifier(SECRET)
    h = sign(SECRET, "GET", "/kv/v1/sessions/a", now=1000.0)
    assert v.check("GET", "/kv/v1/sessions/b", h, now=1000.0) == "bad signature"
    assert v.check("POST", "/kv/v1/sessions/a", h, now=1000.0) == "bad signature"
    assert v.check("GET", "/kv/v1/sessions/a", {**h, "x-tandem-nonce": "00"}, now=1000.0) == "bad signature"
    assert v.check("GET", "/kv/v1/sessions/a", {**h, "x-tandem-timestamp": "x"}, now=1000.0) == "malformed timestamp"
    assert v.check("GET", "/kv/v1/sessions/a", h, now=1000.0) is None
    assert v.check("GET", "/kv/v1/sessions/a", h, now=1001.0) == "replayed request"
    later = sign(SECRET, "GET", "/kv/v1/sessions/a", now=2000.0)
    assert v.check("GET", "/kv/v1/sessions/a", later, now=2000.0) is None
    assert len(v._nonces) == 1  # the first nonce expired with its timestamp's window


def test_a_worker_process_takes_its_secret_from_the_environment(make_stack):
    """`TANDEM_CLUSTER_SECRET` reaches a real worker's KV server: unsigned requests get 401,
    signed ones get through (404: it holds no such session)."""
    stack = make_stack()
    stack.worker("w0", TANDEM_CLUSTER_SECRET=SECRET)
    # A lone worker creates its topics as it starts: reading its heartbeats before then found no
    # topic for the ~50 s `assign_all` retries (a start at load 40 took longer), so wait for it.
    stack.wait_log("w0", "worker ready")
    hb = asyncio.run(worker_heartbeat(stack, "w0"))
    url = f"{hb.kv_url}{KV_PATH}nobody"
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers=sign("wrong", "GET", f"{KV_PATH}nobody"), timeout=30).status_code == 401
    assert httpx.get(url, headers=sign(SECRET, "GET", f"{KV_PATH}nobody"), timeout=30).status_code == 404
