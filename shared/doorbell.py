"""Per-topic wake-ups between the processes of one machine, for a broker that cannot long-poll.

The embedded tansu broker answers a fetch only at its `fetch.max.wait.ms` deadline, whether or
not data arrived meanwhile (docs/services.md, "Fetch waits"). A consumer that must see a record
within a few milliseconds therefore had to fetch every 2 ms forever, idle or not. With a
doorbell, an idle consumer stops fetching (`shared/quiet_consumer.py`) and a producer that has a
record acked on a topic rings that topic's doorbells, which wakes the consumers reading it.

The bell is a Unix datagram socket per (reading client, topic), bound under
`<directory>/<topic>/`; ringing is one datagram to each socket in the topic's folder after
the broker acked the record, so the woken consumer's next fetch finds it. The datagram may say
where the record is (`partition:offset`): a reader then knows when it has read what it was rung
for and can sleep at once (`shared/quiet_consumer.py`); an empty one only says "look". A ring that is lost
(a full socket buffer, a producer outside this package) costs latency, never a record: quiet
consumers also wake on their own every `kafka_idle_poll_ms`. Sockets of dead processes are
removed by the first ringer that finds nobody listening.

Why sockets and not the broker itself: the doorbell is a latency hint beside Kafka, not a second
data path; it carries no payload, and everything a consumer reads still comes from the broker.
It exists only while the broker is the embedded one (one machine); with Apache Kafka
(`TANDEM_KAFKA_LONG_POLL=true`) fetches wait on the broker and no bell is made.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import tempfile
import uuid
from collections.abc import Callable

log = logging.getLogger(__name__)


def doorbell_directory(bootstrap: str) -> str:
    """The folder every process using the broker at `bootstrap` agrees on without being told."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", bootstrap)
    return os.path.join(tempfile.gettempdir(), "tandem-bells", safe)


class Doorbell:
    """The bells of one client: `listen(topic, on_ring)` makes one; `ring(topic)` rings everyone's."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._token = uuid.uuid4().hex[:12]
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self._bells: dict[str, tuple[socket.socket, str, list[Callable[[list[bytes]], None]]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def listen(self, topic: str, on_ring: Callable[[list[bytes]], None]) -> None:
        """Call `on_ring(payloads)` (on the event loop) whenever someone rings `topic`, with what
        each ring since the last call carried (b"" for a bare ring)."""
        if topic in self._bells:
            self._bells[topic][2].append(on_ring)
            return
        folder = os.path.join(self.directory, topic)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{self._token}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(path)
        callbacks = [on_ring]
        self._bells[topic] = (sock, path, callbacks)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._drain, sock, callbacks)

    @staticmethod
    def _drain(sock: socket.socket, callbacks: list[Callable[[list[bytes]], None]]) -> None:
        payloads = []
        while True:  # several rings since the last wake-up are one wake-up
            try:
                payloads.append(sock.recv(64))
            except (BlockingIOError, InterruptedError):
                break
        if payloads:
            for cb in callbacks:
                cb(payloads)

    def ring(self, topic: str, payload: bytes = b"") -> None:
        """Wake every client listening on `topic` (best effort; see the module docstring)."""
        folder = os.path.join(self.directory, topic)
        try:
            entries = os.scandir(folder)
        except FileNotFoundError:
            return  # nobody listens
        with entries:
            for entry in entries:
                try:
                    self._sender.sendto(payload, entry.path)
                except ConnectionRefusedError:  # the socket of a process that died
                    _unlink(entry.path)
                except (BlockingIOError, FileNotFoundError, PermissionError, OSError):
                    pass  # full (already rung) or gone: the consumer's own wake-up covers it

    def close(self) -> None:
        for sock, path, _ in self._bells.values():
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(sock.fileno())
            sock.close()
            _unlink(path)
        self._bells.clear()
        self._sender.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
