"""Up to when the scheduler has provably heard every heartbeat: the clock it judges silence by.

Why (issue 22, eleventh session). The scheduler declared a worker lost when it had *read* no
heartbeat of it for `worker_timeout_s` by its own clock. On a loaded host (load 40-50 on 2
cores) that silence was often the scheduler's, not the worker's: its event loop starved, its
heartbeat reader seconds behind the topic, or the broker away (every broker restart). A live
worker was declared lost, its requests re-run elsewhere, and it was fenced; 27 times in one
busy `tandem chaos` run, until both gateways answered 503 past a client's retry budget.

The rule: silence is judged up to a time the scheduler can prove it heard everything before,
never up to "now". Each housekeeping pass asks the broker for the end offsets of the heartbeat
partitions (`probe`), noting the time *before* asking. Once the reader's position reaches those
offsets (`heard_until`), every heartbeat the broker accepted before that time has been read, and
a heartbeat is read no earlier than it was accepted: a worker whose last heartbeat was read
before `heard_until - worker_timeout_s` sent nothing the broker accepted for that long. An
observer that was starved (its probe answered late, its reader behind) or deaf (the broker
away: the probe fails) does not move the clock, so it judges nobody on a silence it did not
watch; it judges once it has caught up, on what it then read. Cost: one ListOffsets request per
pass, and a dead worker is declared lost about one pass later than before.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from aiokafka import AIOKafkaConsumer, TopicPartition

from shared.aio import within
from shared.hole_guard import held_position

log = logging.getLogger(__name__)

# Probes not yet caught up with, kept in order; a reader that never catches up with any of these
# judges nobody (it is not hearing), and the oldest probe is dropped to bound the memory.
_MAX_PROBES = 64


class Hearing:
    def __init__(self, consumer: AIOKafkaConsumer, probe_timeout_s: float) -> None:
        self.consumer = consumer
        self.probe_timeout_s = probe_timeout_s
        self.heard_until = time.monotonic()  # nobody is judged on silence before this scheduler listened
        self._probes: deque[tuple[float, dict[TopicPartition, int]]] = deque()
        self._deaf_since: float | None = None  # when probes began to fail (logged once per spell)
        self._generation = 0  # raised by a broker restart: a probe asked before it is dropped

    def caught_up(self) -> float:
        """Advance `heard_until` to the newest probe the reader has read up to (older ones go
        with it: a later probe read proves the earlier times heard too, and one that can never be
        reached, offsets of a topic since re-created, must not hold the clock); returns it."""
        for i in range(len(self._probes) - 1, -1, -1):
            asked_at, ends = self._probes[i]
            if self._read_past(ends):
                self.heard_until = max(self.heard_until, asked_at)
                for _ in range(i + 1):
                    self._probes.popleft()
                break
        return self.heard_until

    def _read_past(self, ends: dict[TopicPartition, int]) -> bool:
        for tp, end in ends.items():
            position = held_position(self.consumer, tp)
            if position is None or position < end:
                return False
        return True

    async def probe(self) -> None:
        """Ask the broker where the heartbeat partitions end now (bounded: a broker away or a
        starved scheduler leaves the clock where it was, and says so once per spell)."""
        asked_at, generation = time.monotonic(), self._generation
        partitions = list(self.consumer.assignment())
        try:
            ends = await within(self.consumer.end_offsets(partitions), self.probe_timeout_s)
        except Exception as exc:  # noqa: BLE001 (the broker away or slow: judged again once it answers)
            if self._deaf_since is None:
                self._deaf_since = asked_at
                log.warning(
                    "heartbeat end offsets not answered within %.1f s (%r): judging no worker's silence until they are",
                    self.probe_timeout_s,
                    exc,
                )
            return
        if self._deaf_since is not None:
            log.info("heartbeat end offsets answered again after %.1f s", time.monotonic() - self._deaf_since)
            self._deaf_since = None
        if generation != self._generation:
            return  # answered by the broker before a restart, or about its old topics
        self._probes.append((asked_at, ends))
        if len(self._probes) > _MAX_PROBES:
            self._probes.popleft()

    def restart(self) -> None:
        """The broker restarted: offsets asked of the old one mean nothing on the new topics, and
        what was heard is judged from now on (the workers' heartbeats were refused meanwhile)."""
        self._probes.clear()
        self._generation += 1
        self.heard_until = time.monotonic()
