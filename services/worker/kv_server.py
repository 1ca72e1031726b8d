"""The worker's KV server: `GET /kv/v1/sessions/{session_id}` streams the session's KV file.

The body is the engine's disk file as is (`engine/sessions/kvfile.py`: header with the model and
layout, then per-layer chunks with their own CRC32), `application/octet-stream` with a
Content-Length, so the puller detects truncation and corruption and refuses the transfer.
404 for a session this worker does not hold on disk. With a cluster secret, a request not signed
with it (kv_auth.py: HMAC, timestamp, one-time nonce) is refused with 401 before anything is read.

A plain asyncio server rather than a second uvicorn: it serves one kind of GET, and uvicorn's
`serve()` would take over the process's signal handlers from the worker's own shutdown.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path

from services.worker.kv_auth import PeerVerifier
from shared.schemas.sessions import KV_PATH

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
_MAX_HEADER_BYTES = 16 * 1024
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}

ExportPath = Callable[[str], Awaitable[Path | None]]


class KVServer:
    def __init__(self, host: str, port: int, export_path: ExportPath, verifier: PeerVerifier | None = None) -> None:
        self.host, self.port = host, port
        self._export_path = export_path
        self._verifier = verifier  # None: no cluster secret, every peer is served
        self.refused = 0
        self._server: asyncio.Server | None = None
        self.bytes_served = 0
        self.sessions_served = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]  # the real one when 0 was asked for

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._respond(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the peer went away mid-transfer: it refuses the partial file itself
        except Exception:  # noqa: BLE001 (one bad request must not stop the server)
            log.exception("KV request failed")
        finally:
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > _MAX_HEADER_BYTES:
            return await _error(writer, 400, "request header too large")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3:
            return await _error(writer, 400, "malformed request line")
        method, target, _ = parts
        if method != "GET":
            return await _error(writer, 405, "only GET is served")
        path = urllib.parse.urlsplit(target).path
        if self._verifier is not None:
            why = self._verifier.check(method, path, _headers(header_lines))
            if why is not None:
                self.refused += 1
                peer = writer.get_extra_info("peername")
                log.warning("KV request from %s refused: %s", peer[0] if peer else "?", why)
                return await _error(writer, 401, f"peer not authenticated: {why}")
        if not path.startswith(KV_PATH) or len(path) == len(KV_PATH):
            return await _error(writer, 404, f"no such resource {path!r}")
        session_id = urllib.parse.unquote(path[len(KV_PATH) :])
        file = await self._export_path(session_id)
        if file is None:
            return await _error(writer, 404, f"session {session_id!r} has no KV here")
        await self._send_file(writer, file)

    async def _send_file(self, writer: asyncio.StreamWriter, path: Path) -> None:
        try:
            f = open(path, "rb")  # open first: a concurrent rewrite replaces the name, not this file
        except FileNotFoundError:
            return await _error(writer, 404, "session KV was just dropped")
        loop = asyncio.get_running_loop()
        with f:
            size = os.fstat(f.fileno()).st_size
            writer.write(_head(200, "application/octet-stream", size))
            while chunk := await loop.run_in_executor(None, f.read, CHUNK_BYTES):
                writer.write(chunk)
                await writer.drain()
                self.bytes_served += len(chunk)
        self.sessions_served += 1


def _headers(lines: list[str]) -> dict[str, str]:
    """Header lines as a dict with lower-case names (the last of a repeated name wins)."""
    out = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


def _head(status: int, content_type: str, length: int) -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


async def _error(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    writer.write(_head(status, "application/json", len(body)) + body)
    await writer.drain()
