"""Pulls a session's KV file from a peer worker's KV server into a local file.

The download only lands bytes; verifying them (magic, version, per-layer CRC32, model and
layout) is the engine's `adopt_file`, which deletes a bad file. A short or failed download is
refused here and the partial file deleted.
"""

from __future__ import annotations

import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.worker.kv_auth import sign

CHUNK_BYTES = 1 << 20


class PullError(Exception):
    """The transfer failed (peer unreachable, HTTP error, truncated, too large)."""


@dataclass(frozen=True)
class PulledFile:
    path: Path
    nbytes: int
    seconds: float


class KVPuller:
    def __init__(self, incoming_dir: Path, timeout_s: float, max_bytes: int, secret: str = "") -> None:
        self.incoming_dir = incoming_dir
        self.max_bytes = max_bytes
        self._secret = secret  # the cluster secret: each request is signed with it (kv_auth.py)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)))

    async def fetch(self, url: str) -> PulledFile:
        self.incoming_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.incoming_dir / f"{uuid.uuid4().hex}.part"
        t0 = time.perf_counter()
        try:
            nbytes = await self._download(url, tmp)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, httpx.HTTPError):
                raise PullError(f"{url}: {type(exc).__name__}: {exc}") from None
            raise
        return PulledFile(tmp, nbytes, time.perf_counter() - t0)

    async def _download(self, url: str, dest: Path) -> int:
        headers = sign(self._secret, "GET", urllib.parse.urlsplit(url).path) if self._secret else {}
        async with self._client.stream("GET", url, headers=headers) as r:
            if r.status_code != 200:
                raise PullError(f"{url}: HTTP {r.status_code}")
            expected = int(r.headers.get("content-length", "-1"))
            if expected > self.max_bytes:
                raise PullError(f"{url}: {expected} bytes exceeds the {self.max_bytes}-byte limit")
            n = 0
            with open(dest, "wb") as f:
                async for chunk in r.aiter_bytes(CHUNK_BYTES):
                    n += len(chunk)
                    if n > self.max_bytes:
                        raise PullError(f"{url}: more than {self.max_bytes} bytes")
                    f.write(chunk)
        if expected >= 0 and n != expected:
            raise PullError(f"{url}: truncated ({n} of {expected} bytes)")
        return n

    async def close(self) -> None:
        await self._client.aclose()
