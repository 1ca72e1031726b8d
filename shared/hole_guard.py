"""Step a consumer over a hole: offsets below a partition's high watermark that the broker will
never serve (the repair side of shared/broker_watch.py).

Why there are holes. The embedded broker (tansu 0.6, in memory) assigns a produce its offset by
advancing the partition's watermark *before* it stores the batch, and a topic's creation resets
the watermark to 0 without removing batches already stored under the topic's name. Right after a
restart both happen: producers with cached metadata write to topics the new broker does not have
yet (acknowledged, stored under the name), the topics are then created (by the repair, or by
tansu's auto-creation), and the next produces are given offsets whose batch already exists: the
store refuses them (`AlreadyExists`, `UnknownError` to the producer), but the watermark has moved
on. The partition's high watermark is then above every batch a fetch can find, and a fetch at a
position in that range returns nothing (tansu lists stored batches from the position up to the
watermark). A consumer there waits until a later produce lands above it, which on a quiet
partition (a worker's dispatch topic, a reply partition, `leases`) may be never: this is what
kept a lone broker restart from recovering for a minute, and broker + scheduler for minutes
(`tandem chaos`, docs/reliability.md). Nothing in a hole was ever stored, so nothing is lost by
stepping over it: its producers got an error for it.

How a hole is told apart from a consumer that is merely slow. Per assigned partition, a hole is:
- the position has not moved for `wait_s`, and
- the broker answered a fetch *at that position* after it stopped moving, plus `wait_s` (aiokafka
  updates `highwater` and `last_poll_timestamp` only from a fetch answered at the current
  position, and fetches a partition only while none of its records wait unread), and
- that answer's high watermark is above the position, and no fetched record of the partition is
  waiting to be read (a service that is slow to read is not in a hole).
Then the consumer is moved to the high watermark, and a warning names the range. On a broker that
serves every offset below its watermark (Apache Kafka) the first two never hold together with the
third: a fetch below the watermark returns records.

Confirmed before stepping (session 8). A busy tansu also answers a fetch below the watermark
with nothing: it answers with what it read by the fetch's deadline, and the consumers' short
token-path waits (a few ms, growing to 64 ms on empty answers, shared/quiet_consumer.py) can
expire before it reads a stored batch at load 20-30. The three conditions above then held for
records that were stored: in `tandem chaos` at load 26 the queue stepped over nine offsets of its
reply partition a minute after a restart, no produce had been refused since, and two batch items
whose results were among them stayed in flight for good. So a candidate is stepped over only when
a patient fetch confirms it: a probe consumer of its own fetches at the position with a
`PROBE_WAIT_MS` deadline, twice, and finds nothing (a hole has nothing to find, however long it
looks). A probe that fails or finds records leaves the position alone.

Past the end (session 9). The other stale position a restart leaves: a reader whose position is
*above* its partition's high watermark. tansu resets a topic's watermark to 0 when the topic is
created again (by a repair, by auto-creation) but keeps records stored under its name before;
a reader that read such early records (the deltas a worker's producer sent to the restarted
broker before its topic existed: 51 of them in the stalled broker-restart test, session 8) is
carried past where the next records will land, and tansu answers a fetch there with nothing,
never with `OffsetOutOfRange` (Apache Kafka would, and the consumer would reset). Every record
produced afterwards gets an offset below the reader's position until the watermark catches up,
which on a reply partition may be never: the gateway's results reader missed every result of a
request and answered 503 after its 60 s first-event timeout. So, while armed, a partition whose
latest answer (fetched at the current position, after the arming) shows a high watermark below
the position, with nothing of it buffered, is moved back to offset 0, its log start: everything
there is newer than the restart, and every reader drops what it already applied (results by
attempt and index, dispatches by attempt, compacted topics by key). No probe is needed: a high
watermark is the broker's own count, not a fetch that may have run out of time, and a healthy
broker never reports one below a position a consumer reached by reading. A sleeping
`QuietConsumer`'s partitions (paused by the consumer itself) are judged too, and the consumer is
woken to fetch from the new position; partitions a service paused itself are left alone.

Why the high watermark and not one offset at a time: a fetch at the position already looked at
every stored batch between it and the watermark and found none, so there is nothing between to
read; stepping one offset per check would take a check per missing offset (holes of a dozen were
seen). `wait_s` bounds how long a consumer sits at a hole; it is well above the few milliseconds a
produce spends between moving the watermark and storing its batch (a fetch in between sees the
watermark first), so a batch still being stored is never skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

log = logging.getLogger(__name__)
PROBE_WAIT_MS = 1000  # a confirming fetch's deadline: ample for a stored batch, even at load 30
PROBE_FETCHES = 2
PROBE_BOUND_S = 15.0  # a probe that takes longer (a starved machine) confirms nothing


async def nothing_served_at(consumer: AIOKafkaConsumer, tp: TopicPartition, position: int) -> bool:
    """True when patient fetches at `position` of `tp` find nothing (a hole); False when they find
    a record, or cannot tell (an error, the broker away, `PROBE_BOUND_S` passed). A consumer of its
    own, so the watched one's position and buffers are untouched."""
    bootstrap = consumer._client._bootstrap_servers  # noqa: SLF001 (aiokafka has no public view)
    probe = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        fetch_max_wait_ms=PROBE_WAIT_MS,
        client_id="hole-guard-probe",
    )
    try:
        async with asyncio.timeout(PROBE_BOUND_S):
            await probe.start()
            probe.assign([tp])
            probe.seek(tp, position)
            for _ in range(PROBE_FETCHES):
                if (await probe.getmany(tp, timeout_ms=2 * PROBE_WAIT_MS)).get(tp):
                    return False
            return True
    except Exception:  # noqa: BLE001 (cannot tell: leave the position alone, the next check looks again)
        log.debug("hole probe at %s[%d] %d failed", tp.topic, tp.partition, position, exc_info=True)
        return False
    finally:
        with contextlib.suppress(Exception):
            await probe.stop()


Confirm = Callable[[AIOKafkaConsumer, TopicPartition, int], Awaitable[bool]]


@dataclass
class _Watch:
    position: int
    since_ms: float  # wall clock (ms, aiokafka's clock for poll timestamps) the position was first seen


class HoleGuard:
    """Checks `consumers()` every `wait_s / 2`, while armed (`arm`, after a broker restart), and
    steps any partition over a hole (module doc).

    `consumers` returns the live consumers to check (a `KafkaClient`'s); the guard makes no
    request of its own: everything it reads the consumers already hold."""

    def __init__(
        self,
        consumers: Callable[[], Iterable[AIOKafkaConsumer]],
        *,
        wait_s: float = 3.0,
        confirm: Confirm = nothing_served_at,
    ) -> None:
        self._consumers = consumers
        self._confirm = confirm
        self.wait_s = wait_s
        self._seen: dict[tuple[int, TopicPartition], _Watch] = {}
        self._task: asyncio.Task | None = None
        self._armed_until = 0.0  # monotonic; set by `arm` after a broker restart
        self._armed_at_ms = float("inf")  # wall clock (aiokafka's poll timestamps) of the last `arm`
        self.skipped = 0  # holes stepped over since start (tests and logs read it)
        self.rewound = 0  # partitions moved back from past their end since start (module doc)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="hole-guard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # gather, not `suppress(CancelledError)`: that would also swallow a cancellation of
            # this stop itself (its caller's timeout)
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.wait_s / 2)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 (a consumer mid-rebalance or stopping: the next check)
                log.debug("hole check failed", exc_info=True)

    def arm(self, for_s: float = 120.0) -> None:
        """The broker restarted and the consumers were rewound: judge holes for the next `for_s`
        only, from fresh observations (a high watermark read from the old broker says nothing
        about the new one's offsets). Holes are made only by a restart, and the rewound
        consumers reach them within seconds; outside that window the guard does nothing, so a
        healthy broker's consumers are never moved (on a loaded machine it fired, twice, on a
        broker that had not restarted: one heartbeat each, cause not found)."""
        self._seen.clear()
        self._armed_until = time.monotonic() + for_s
        self._armed_at_ms = time.time() * 1000

    async def check(self, now_ms: float | None = None) -> int:
        """One pass over every assigned partition; returns how many holes it stepped over."""
        if time.monotonic() > self._armed_until:
            self._seen.clear()
            return 0
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        live: set[tuple[int, TopicPartition]] = set()
        candidates = []
        for consumer in self._consumers():
            for tp in consumer.assignment():
                key = (id(consumer), tp)
                live.add(key)
                if self._rewind_if_past_the_end(consumer, tp):
                    self._seen.pop(key, None)
                    continue
                if self._looks_like_a_hole(consumer, tp, key, now_ms):
                    candidates.append((consumer, tp, key))
        for key in set(self._seen) - live:  # unassigned or stopped consumers
            del self._seen[key]
        stepped = 0
        for consumer, tp, key in candidates:
            stepped += await self._step_if_confirmed(consumer, tp, key)
        self.skipped += stepped
        return stepped

    def _rewind_if_past_the_end(self, consumer: AIOKafkaConsumer, tp: TopicPartition) -> bool:
        """Move `tp` back to offset 0 when its latest answer since the arming shows a high
        watermark below the position (module doc, "Past the end"); True when it did."""
        position = _position(consumer, tp, paused_ok=True)
        highwater, polled = consumer.highwater(tp), consumer.last_poll_timestamp(tp)
        if position is None or highwater is None or polled is None:
            return False
        if highwater >= position or polled < self._armed_at_ms or _buffered(consumer, tp):
            return False
        if tp in getattr(consumer, "_held", ()):  # noqa: SLF001 (paused by its service: not ours to move)
            return False
        log.warning(
            "%s[%d]: position %d is past the partition's high watermark %d (a topic created again "
            "by a restarted broker under records read before it, shared/hole_guard.py); reading it "
            "again from offset 0",
            tp.topic,
            tp.partition,
            position,
            highwater,
        )
        consumer.seek(tp, 0)
        wake = getattr(consumer, "wake", None)
        if wake is not None:  # a QuietConsumer may be asleep: fetch from the new position now
            wake()
        self.rewound += 1
        return True

    def _looks_like_a_hole(self, consumer: AIOKafkaConsumer, tp: TopicPartition, key, now_ms: float) -> bool:
        position = _position(consumer, tp)
        if position is None:
            self._seen.pop(key, None)
            return False
        watch = self._seen.get(key)
        if watch is None or watch.position != position:
            self._seen[key] = _Watch(position, now_ms)
            return False
        highwater, polled = consumer.highwater(tp), consumer.last_poll_timestamp(tp)
        wait_ms = self.wait_s * 1000
        if highwater is None or polled is None or highwater <= position:
            return False
        return not (now_ms - watch.since_ms < wait_ms or polled < watch.since_ms + wait_ms or _buffered(consumer, tp))

    async def _step_if_confirmed(self, consumer: AIOKafkaConsumer, tp: TopicPartition, key) -> int:
        position, highwater = self._seen[key].position, consumer.highwater(tp)
        if not await self._confirm(consumer, tp, position):
            log.info(
                "%s[%d]: offset %d looked like a hole (nothing served below the high watermark %s) but "
                "a patient fetch found records: a slow broker, not a hole; left in place",
                tp.topic,
                tp.partition,
                position,
                highwater,
            )
            self._seen.pop(key, None)  # judged again from fresh observations
            return 0
        if _position(consumer, tp) != position:
            return 0  # it moved while the probe looked: not stuck after all
        log.warning(
            "%s[%d]: offsets %d-%d are below the high watermark but the broker serves none of them "
            "(a hole left by a broker restart, shared/hole_guard.py); reading on from %d",
            tp.topic,
            tp.partition,
            position,
            highwater - 1,
            highwater,
        )
        consumer.seek(tp, highwater)
        self._seen[key] = _Watch(highwater, time.time() * 1000)
        return 1


def held_position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The next offset `consumer` hands over for `tp`, from what it holds (no request; a sleeping
    `QuietConsumer`'s paused partition included); None without a valid position."""
    return _position(consumer, tp, paused_ok=True)


def _position(consumer: AIOKafkaConsumer, tp: TopicPartition, *, paused_ok: bool = False) -> int | None:
    """The consumer's position if it has a valid one (without asking the broker); a paused
    partition has none unless `paused_ok`."""
    state = consumer._subscription.subscription  # noqa: SLF001 (aiokafka's position() may fetch)
    if state is None or state.assignment is None:
        return None
    tp_state = state.assignment.state_value(tp)
    if tp_state is None or not tp_state.has_valid_position or (tp_state.paused and not paused_ok):
        return None
    return tp_state.position


def _buffered(consumer: AIOKafkaConsumer, tp: TopicPartition) -> bool:
    """Whether fetched records of `tp` wait to be read (then the consumer is slow, not stuck)."""
    fetcher = consumer._fetcher  # noqa: SLF001 (aiokafka exposes no public view)
    return fetcher is None or tp in fetcher._records  # noqa: SLF001 (None: not started, not judged)
