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

Why the high watermark and not one offset at a time: a fetch at the position already looked at
every stored batch between it and the watermark and found none, so there is nothing between to
read; stepping one offset per check would take a check per missing offset (holes of a dozen were
seen). `wait_s` bounds how long a consumer sits at a hole; it is well above the few milliseconds a
produce spends between moving the watermark and storing its batch (a fetch in between sees the
watermark first), so a batch still being stored is never skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

log = logging.getLogger(__name__)


@dataclass
class _Watch:
    position: int
    since_ms: float  # wall clock (ms, aiokafka's clock for poll timestamps) the position was first seen


class HoleGuard:
    """Checks `consumers()` every `wait_s / 2`, while armed (`arm`, after a broker restart), and
    steps any partition over a hole (module doc).

    `consumers` returns the live consumers to check (a `KafkaClient`'s); the guard makes no
    request of its own: everything it reads the consumers already hold."""

    def __init__(self, consumers: Callable[[], Iterable[AIOKafkaConsumer]], *, wait_s: float = 3.0) -> None:
        self._consumers = consumers
        self.wait_s = wait_s
        self._seen: dict[tuple[int, TopicPartition], _Watch] = {}
        self._task: asyncio.Task | None = None
        self._armed_until = 0.0  # monotonic; set by `arm` after a broker restart
        self.skipped = 0  # holes stepped over since start (tests and logs read it)

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
                self.check()
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

    def check(self, now_ms: float | None = None) -> int:
        """One pass over every assigned partition; returns how many holes it stepped over."""
        if time.monotonic() > self._armed_until:
            self._seen.clear()
            return 0
        now_ms = time.time() * 1000 if now_ms is None else now_ms
        live: set[tuple[int, TopicPartition]] = set()
        stepped = 0
        for consumer in self._consumers():
            for tp in consumer.assignment():
                key = (id(consumer), tp)
                live.add(key)
                stepped += self._check_one(consumer, tp, key, now_ms)
        for key in set(self._seen) - live:  # unassigned or stopped consumers
            del self._seen[key]
        self.skipped += stepped
        return stepped

    def _check_one(self, consumer: AIOKafkaConsumer, tp: TopicPartition, key, now_ms: float) -> int:
        position = _position(consumer, tp)
        if position is None:
            self._seen.pop(key, None)
            return 0
        watch = self._seen.get(key)
        if watch is None or watch.position != position:
            self._seen[key] = _Watch(position, now_ms)
            return 0
        highwater, polled = consumer.highwater(tp), consumer.last_poll_timestamp(tp)
        wait_ms = self.wait_s * 1000
        if highwater is None or polled is None or highwater <= position:
            return 0
        if now_ms - watch.since_ms < wait_ms or polled < watch.since_ms + wait_ms or _buffered(consumer, tp):
            return 0
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
        self._seen[key] = _Watch(highwater, now_ms)
        return 1


def _position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The consumer's position if it has a valid one (without asking the broker)."""
    state = consumer._subscription.subscription  # noqa: SLF001 (aiokafka's position() may fetch)
    if state is None or state.assignment is None:
        return None
    tp_state = state.assignment.state_value(tp)
    if tp_state is None or not tp_state.has_valid_position or tp_state.paused:
        return None
    return tp_state.position


def _buffered(consumer: AIOKafkaConsumer, tp: TopicPartition) -> bool:
    """Whether fetched records of `tp` wait to be read (then the consumer is slow, not stuck)."""
    fetcher = consumer._fetcher  # noqa: SLF001 (aiokafka exposes no public view)
    return fetcher is None or tp in fetcher._records  # noqa: SLF001 (None: not started, not judged)
