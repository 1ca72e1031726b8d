"""Notice a restarted broker and repair what the restart broke, for one service's `KafkaClient`.

The embedded broker (tansu, in memory) keeps nothing across a restart, and aiokafka clients
reconnect to it without noticing (docs/reliability.md, "Broker restarts"): topics come back
auto-created with tansu's default 4 partitions on the first metadata request or produce
(`results` needs 8: sends to its partitions 4-7 then fail forever), a consumer assigned by hand
keeps its old position and silently skips the new topic's first records, and consumer groups,
committed offsets and the compacted topics are gone.

When it looks. A check is one metadata request; sending one every second from every service was
a fifth of the idle stack's broker work (issue 21), so the watch waits for a sign of trouble
instead: it holds one idle TCP connection to the broker (no Kafka request on it, so it costs
neither side anything) and checks when that connection closes or cannot be opened. A broker
process that dies closes it at once, on this machine (tansu) as on another (the peer's kernel
resets it, or the next connect is refused). After such a sign it checks every `retry_s` until a
check gets an answer (the broker may still be starting), then holds a new connection. Each
`interval_s` (`TANDEM_BROKER_WATCH_INTERVAL_S`, 30 s) it also checks without a sign: the safety
net for a restart the connection did not show (a proxy in between, a broker of a cluster that is
not the bootstrap one; Apache Kafka also closes connections idle for `connections.max.idle.ms`,
10 minutes, which only costs one check).

How a restart is recognised. A check reads the broker's topic list with partition counts and
finds a restart when:
- its incarnation marker is gone. Each watch makes sure a topic `<prefix>.incarnation.<ms>-<hex>`
  exists (it adopts any one it finds, or creates one) and remembers its name; only a broker
  that lost its data loses it. This catches a restart even when another service repaired the
  topics first, which the two checks below cannot.
- a catalogue topic this client ensured (created or found at start) is missing or has fewer
  partitions than the catalogue says. Topics it was only told about (`KafkaClient.remember`,
  such as the scheduler's `dispatch.<worker>`) are repaired with the rest but are no sign: their
  owner may not have created them yet (a worker that heartbeats before its topic exists, or never
  makes it) or may have deleted them, and reading that as a restart dropped the scheduler's
  pending requests and rewound its consumers over old heartbeats.
A cluster id would be the natural marker, but tansu reports the same one (`tansu_cluster`) after
a restart; a consumer's position past its partition's end is not checked either: reading end
offsets blocks for 40 s on a partition an auto-created topic lacks, and new records soon hide it.

What the repair does, in this order, before the service hears of it:
1. Catalogue topics with the wrong partition count are deleted and created again with the
   catalogue's (tansu has no CreatePartitions); missing ones are created. Wrong means fewer,
   or, once the marker is gone (the broker lost its data), more: tansu auto-creates with 4, and
   a keyed record of a one-partition topic (`leases`) then lands where no reader looks. Looked
   at again after the repair (up to three rounds): a metadata request may auto-create a topic
   between the look and the create. It is idempotent and
   safe when several services repair at once: each deletes only a topic it has just seen short
   (re-read right before the delete), and "already exists" on create is success.
2. The client's producer and consumers refresh their metadata (aiokafka otherwise keeps the old
   partition counts for 5 minutes and fails sends to partitions it thinks are missing).
3. Every consumer is moved to the beginning of what it reads: all records of the new topics
   were written after the restart, so nothing there has been seen; readers are idempotent.
4. The service's callback gets a `BrokerRestart`: what to do with in-flight work is the
   service's decision (the gateway fails its open streams, the queue re-releases from its
   database, the scheduler drops its old assignments; docs/reliability.md).
And all along, a `HoleGuard` (shared/hole_guard.py) steps the client's consumers over offsets a
restarted tansu acknowledged but never serves, which no repair above can remove.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from shared.hole_guard import HoleGuard
from shared.kafka import with_backoff

log = logging.getLogger(__name__)

# One metadata request, or one repair step, that takes longer than this is treated as a failure
# (the broker is still down or starting) and the next check tries again with a new connection. A
# request in flight when the broker died waits this long, so it bounds how late a restart is seen
# (with 10 s a scheduler noticed 10 s after the others in the test).
_CALL_TIMEOUT_S = 3.0


class RecoveryWindow:
    """The level of a service's per-request log lines: INFO for `seconds` after a broker restart
    this watch repaired, DEBUG otherwise. A request that is slow to be served after a restart
    (`tandem chaos` measured 62 s twice, with nothing at INFO to say where the request was) can
    then be followed through the services' logs without running them at DEBUG, at no cost in
    steady state."""

    def __init__(self, seconds: float = 120.0) -> None:
        self.seconds = seconds
        self._until = float("-inf")

    def open(self) -> None:
        self._until = time.monotonic() + self.seconds

    def level(self) -> int:
        return logging.INFO if time.monotonic() < self._until else logging.DEBUG


@dataclass(frozen=True)
class BrokerRestart:
    """What the watch knows about a restart it repaired."""

    last_seen_alive: float  # wall time of the last check that still saw the old broker's data
    detected_at: float  # wall time the restart was noticed
    reasons: tuple[str, ...]  # what gave it away (marker gone, a short or missing topic)
    recreated: tuple[str, ...]  # topics deleted and created again with the catalogue's partitions


OnRestart = Callable[[BrokerRestart], Awaitable[None]]


class BrokerWatch:
    """Checks the broker for a restart when its connection drops (and every `interval_s`), and
    repairs it (module docstring).

    `kafka` is the service's `KafkaClient` (its `catalogue`, producer and consumers); `prefix` the
    topic prefix the marker lives under; `on_restart` the service's reaction, called once per
    restart after the repair; `retry_s` how often it checks after a sign of trouble until the
    broker answers.
    """

    def __init__(
        self, kafka, prefix: str, on_restart: OnRestart, *, interval_s: float = 30.0, retry_s: float = 0.5
    ) -> None:
        self._kafka = kafka
        self._marker_prefix = f"{prefix}.incarnation."
        self._on_restart = on_restart
        self._interval_s = interval_s
        self._retry_s = min(retry_s, interval_s)
        self._admin: AIOKafkaAdminClient | None = None
        self._marker: str | None = None
        self._last_alive = time.time()
        self._task: asyncio.Task | None = None
        self.restarts = 0  # restarts repaired since start (tests and metrics read it)
        self.checks = 0  # checks that got an answer (the idle cost: one metadata request each)
        self.holes = HoleGuard(kafka.live_consumers, wait_s=kafka.settings.broker_hole_wait_s)
        # opened at each repaired restart: per-request lines at INFO for a while
        self.recovery = RecoveryWindow(kafka.settings.broker_recovery_log_s)

    async def start(self, *, background: bool = True) -> None:
        """Adopt or create the incarnation marker, then watch in the background (`background=False`:
        only when `check()` is called, for tests that decide when to look). The hole guard runs
        either way: it makes no broker requests."""
        topics = await with_backoff("broker watch start", self._first_look)
        self._marker = await self._ensure_marker(topics)
        self._last_alive = time.time()
        if background:
            self._task = asyncio.create_task(self._run(), name="broker-watch")
        self.holes.start()

    async def _first_look(self) -> dict[str, int]:
        """The topic list at start; a call that times out (a starved machine: a queue service
        died of it at load 40 in `tandem chaos`) is retried with a new admin client."""
        try:
            return await self.partition_counts()
        except Exception:
            await self.close_admin()
            raise

    async def stop(self) -> None:
        await self.holes.stop()
        if self._task is not None:
            self._task.cancel()
            # gather, not `suppress(CancelledError)`: that would also swallow a cancellation of
            # this stop itself (its caller's timeout)
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.close_admin()

    async def _run(self) -> None:
        while True:
            await self._wait_for_a_sign()
            while not await self._try_check():
                await asyncio.sleep(self._retry_s)

    async def _wait_for_a_sign(self) -> None:
        """Return when the broker connection closes, cannot be opened, or `interval_s` passed."""
        host, port = _first_broker(self._kafka.bootstrap)
        try:
            async with asyncio.timeout(_CALL_TIMEOUT_S):  # not wait_for: see shared/aio.py
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return  # unreachable: look now (and again every retry_s until it answers)
        try:
            # The broker never writes unasked, so this returns only on EOF or a reset (or data,
            # which is just as odd): either way, look.
            async with asyncio.timeout(self._interval_s):
                await reader.read(1)
        except (OSError, TimeoutError):
            pass  # a reset, or the safety interval
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _try_check(self) -> bool:
        """One check; False when the broker did not answer (down or starting)."""
        try:
            await self.check()
        except Exception as exc:  # noqa: BLE001 (the broker is down or starting: the caller retries)
            log.debug("broker check failed: %r", exc)
            await self.close_admin()  # a fresh admin client next time (it may hold a dead connection)
            return False
        return True

    async def check(self) -> BrokerRestart | None:
        """One check; repairs and reports a restart when it finds one."""
        topics = await self.partition_counts()
        self.checks += 1
        reasons = self._restart_signs(topics)
        if not reasons:
            self._last_alive = time.time()
            return None
        restart = await self._repair(topics, reasons)
        self.restarts += 1
        self.recovery.open()
        log.warning(
            "broker restarted (%s); recreated %s; telling the service",
            "; ".join(restart.reasons),
            ", ".join(restart.recreated) or "nothing",
        )
        await self._on_restart(restart)
        return restart

    def _restart_signs(self, topics: dict[str, int]) -> list[str]:
        reasons = []
        if self._marker is not None and self._marker not in topics:
            reasons.append(f"marker {self._marker} gone")
        for spec in self._kafka.catalogue.values():
            if spec.name not in self._kafka.ensured:
                continue  # remembered only: another service's topic (module docstring)
            have = topics.get(spec.name)
            if have is None:
                reasons.append(f"{spec.name} missing")
            elif have < spec.partitions:
                reasons.append(f"{spec.name} has {have} partitions, not {spec.partitions}")
        return reasons

    async def _repair(self, topics: dict[str, int], reasons: list[str]) -> BrokerRestart:
        detected = time.time()
        # Only a broker that lost its data (the marker gone) may have a catalogue topic with
        # *more* partitions than it should: tansu auto-created it with its default 4 (`leases`,
        # `be.capacity`: keyed records then went to partitions nobody reads). On a broker that
        # kept its data, more partitions are an operator's choice and are left alone.
        lost_data = any(r.startswith("marker ") for r in reasons)
        recreated: list[str] = []
        for _ in range(3):  # a client's metadata request may auto-create a topic mid-repair: look again
            recreated += await self._recreate_miscounted(topics, lost_data)
            await self._kafka.ensure_topics(list(self._kafka.catalogue.values()), own=False)
            topics = await self.partition_counts()
            if not self._miscounted(topics, lost_data):
                break
        self._marker = await self._ensure_marker(topics)
        await self._kafka.refresh_metadata()
        self._kafka.rewind_consumers()
        for consumer in self._kafka.live_consumers():
            if hasattr(consumer, "sleep_log_level"):  # a QuietConsumer: its sleeps at INFO for a while
                consumer.sleep_log_level = self.recovery.level
        self.holes.arm()
        restart = BrokerRestart(self._last_alive, detected, tuple(reasons), tuple(dict.fromkeys(recreated)))
        self._last_alive = time.time()
        return restart

    def _miscounted(self, topics: dict[str, int], more_too: bool) -> list[str]:
        """Catalogue topics present with fewer partitions than the catalogue says (or, with
        `more_too`, any other count)."""
        out = []
        for spec in self._kafka.catalogue.values():
            have = topics.get(spec.name, 0)
            if 0 < have < spec.partitions or (more_too and have > spec.partitions):
                out.append(spec.name)
        return out

    async def _recreate_miscounted(self, topics: dict[str, int], more_too: bool) -> list[str]:
        """Delete the catalogue topics an auto-creation left with the wrong partition count (seen
        so in `topics` and again right now, so a topic another service just fixed is kept)."""
        if not self._miscounted(topics, more_too):
            return []
        wrong = self._miscounted(await self.partition_counts(), more_too)
        if wrong:
            admin = await self._admin_client()
            async with asyncio.timeout(_CALL_TIMEOUT_S):
                await admin.delete_topics(wrong)
        return wrong

    async def _ensure_marker(self, topics: dict[str, int]) -> str:
        """The marker this watch remembers: one that exists already (any: they all vanish
        together), else a new one named by time and chance so that two creators never collide."""
        existing = sorted(name for name in topics if name.startswith(self._marker_prefix))
        if existing:
            return existing[0]
        name = f"{self._marker_prefix}{int(time.time() * 1000)}-{secrets.token_hex(4)}"
        admin = await self._admin_client()
        try:
            async with asyncio.timeout(_CALL_TIMEOUT_S):
                await admin.create_topics([NewTopic(name, 1, 1)])
        except TopicAlreadyExistsError:
            pass
        return name

    async def partition_counts(self) -> dict[str, int]:
        """Every topic on the broker and its partition count (one metadata request)."""
        admin = await self._admin_client()
        async with asyncio.timeout(_CALL_TIMEOUT_S):
            described = await admin.describe_topics()
        return {t["topic"]: len(t["partitions"]) for t in described if t.get("error_code", 0) == 0}

    async def _admin_client(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            admin = AIOKafkaAdminClient(
                bootstrap_servers=self._kafka.bootstrap, client_id=f"{self._kafka.client_id}-watch"
            )
            async with asyncio.timeout(_CALL_TIMEOUT_S):
                await admin.start()
            self._admin = admin
        return self._admin

    async def close_admin(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                await self._admin.close()
            self._admin = None


def _first_broker(bootstrap: str) -> tuple[str, int]:
    """Host and port of the first bootstrap server ("host:port[,host:port...]", IPv6 in brackets)."""
    host, port = bootstrap.split(",")[0].strip().rsplit(":", 1)
    return host.strip("[]"), int(port)
