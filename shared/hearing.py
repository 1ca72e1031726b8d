"""Up to when a reader has provably heard every record of a topic: the clock a liveness judge
(the scheduler judging workers' heartbeats, a worker judging its gateways') counts silence by.

Why (issue 22, eleventh session). Silence used to be judged by the time since a record was
*read*, on the judge's own clock. On a loaded host (load 40-50 on 2 cores) that silence was often
the judge's: its event loop starved, its reader seconds behind the topic, or the broker away
(every broker restart). The scheduler declared a live worker lost 27 times in one busy `tandem
chaos` run (re-running its requests and fencing it), and a worker judged both gateways dead on
the broker's silence and dropped the requests they sent next (a recovery probe waited 60 s).

The rule: silence is judged up to a time the judge can prove it heard everything before, never
up to "now". Each pass asks the broker for the end offsets of the read partitions (`probe`),
noting the time *before* asking. Once the reader's position reaches those offsets
(`caught_up`), every record the broker accepted before that time has been read, and a record is
read no earlier than it was accepted: a sender whose last record was read before
`heard_until - timeout` sent nothing the broker accepted for that long. A judge that was starved
(its probe answered late, its reader behind) or deaf (the broker away: the probe fails) does not
move the clock, so it judges nobody on a silence it did not watch; it judges once it has caught
up, on what it then read. Cost: one ListOffsets request per pass, and a dead sender is judged
about one pass later than before.

A restarted broker answers a probe with the offsets of its new, nearly empty topics, which an old
position is already past: that would "prove" hearing while nothing is read. So a probe whose end
is below one seen before on the same partition is not counted, until the service's restart
callback calls `restart` (the reader is rewound onto the new topics then).
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
# A reader this far behind its oldest unread probe is logged (once until it catches up).
_BEHIND_WARN_S = 30.0


class Hearing:
    def __init__(self, consumer: AIOKafkaConsumer, probe_timeout_s: float, what: str) -> None:
        self.consumer, self.what = consumer, what  # `what`: the records read, for the log ("heartbeat")
        self.probe_timeout_s = probe_timeout_s
        self.heard_until = time.monotonic()  # nobody is judged on silence before this scheduler listened
        self._probes: deque[tuple[float, dict[TopicPartition, int]]] = deque()
        self._deaf_since: float | None = None  # when probes began to fail (logged once per spell)
        self._generation = 0  # raised by a broker restart: a probe asked before it is dropped
        self._highest: dict[TopicPartition, int] = {}  # the highest end seen per partition
        self._behind_warned = False

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
                self._behind_warned = False
                break
        else:
            self._warn_if_behind()
        return self.heard_until

    def _warn_if_behind(self) -> None:
        """A reader that does not catch up judges nobody, so a dead worker (gateway) would keep
        its requests: that must not be silent either (once per spell)."""
        if self._probes and not self._behind_warned and time.monotonic() - self._probes[0][0] > _BEHIND_WARN_S:
            self._behind_warned = True
            log.warning(
                "%s reader has not reached the end offsets asked %.0f s ago (%s): no sender is judged until it does",
                self.what,
                time.monotonic() - self._probes[0][0],
                {
                    f"{tp.topic}[{tp.partition}]": (held_position(self.consumer, tp), e)
                    for tp, e in self._probes[0][1].items()
                },
            )

    def _read_past(self, ends: dict[TopicPartition, int]) -> bool:
        for tp, end in ends.items():
            position = held_position(self.consumer, tp)
            if position is None or position < end:
                return False
        return True

    async def probe(self) -> None:
        """Ask the broker where the read partitions end now (bounded: a broker away or a starved
        judge leaves the clock where it was, and says so once per spell)."""
        asked_at, generation = time.monotonic(), self._generation
        partitions = list(self.consumer.assignment())
        try:
            ends = await within(self.consumer.end_offsets(partitions), self.probe_timeout_s)
        except Exception as exc:  # noqa: BLE001 (the broker away or slow: judged again once it answers)
            if self._deaf_since is None:
                self._deaf_since = asked_at
                log.warning(
                    "%s end offsets not answered within %.1f s (%r): judging no sender's silence until they are",
                    self.what,
                    self.probe_timeout_s,
                    exc,
                )
            return
        if self._deaf_since is not None:
            log.info("%s end offsets answered again after %.1f s", self.what, time.monotonic() - self._deaf_since)
            self._deaf_since = None
        if generation != self._generation:
            return  # answered by the broker before a restart, or about its old topics
        if any(end < self._highest.get(tp, 0) for tp, end in ends.items()):
            return  # a broker that lost its data, not yet repaired here (module doc)
        for tp, end in ends.items():
            self._highest[tp] = end
        self._probes.append((asked_at, ends))
        if len(self._probes) > _MAX_PROBES:
            self._probes.popleft()

    def restart(self) -> None:
        """The broker restarted: offsets asked of the old one mean nothing on the new topics, and
        what was heard is judged from now on (the senders' records were refused meanwhile)."""
        self._probes.clear()
        self._highest.clear()
        self._generation += 1
        self.heard_until = time.monotonic()
