"""Active/standby election for the doubled services (scheduler, queue, advisory), on `leases`.

Each instance of a role runs a `LeaseKeeper`. They all read the one-partition `leases` topic from
its start and apply the same rules (`LeaseLog`) in the same order, so they agree on each term's
holder without talking to each other:

- a `held` record of a term above the current one starts that term, and its sender holds it
  (the *first* such record wins: a second claimant of the same term lost the race);
- a `held` record of the current term by its holder renews it; anything else older is ignored
  (a deposed active that woke up renewing its old term changes nothing);
- a `released` record by the holder ends its term at once (a clean stop: the standby claims
  without waiting out the lease).

The active renews every `lease_s / 2` (`renew_s`), counted from its previous send. A standby that
has read no renewal for `lease_s` claims the next term, at that deadline and once it has read
everything the broker held then (`_read_up_to_now`: a renewal it missed forbids the claim). The
active counts itself active only within `lease_s` of the *send* time of a renewal it has *read
back* while still the holder (`is_active`): a paused active that wakes finds its window over
before it can act, and a renewal it sends then is read back only after the standby's claim (one
partition, one order), which deposes it. A standby claims no earlier than `lease_s` after it read
the active's last renewal, which is after that renewal was sent, so the two windows do not overlap
(on one clock rate; across hosts the skew of *rates* matters, not of clocks). That holds for any
renewal period: the period decides only how much lateness a live active survives, here
`lease_s / 2` (a renewal read back or heard that much late; it was `lease_s / 3`, issue 21: each
renewal wakes its readers, and renewals were the largest idle cost). What remains is the gap
between an active's check and its send; every output that matters carries the term and readers
drop stale ones (docs/reliability.md, "HA pairs").

Readers of one role are woken only by that role's records (a bell of their own, `role_bell`),
not by the other roles' renewals on the shared one-partition topic; between rings a reader looks
by itself every `kafka_idle_poll_ms` like any quiet consumer. A lost ring can only make a renewal
read late: the active wakes its own reader after each send, and a standby reads up to the log's
end before it claims.

A deposed active does not step down in place: the service exits (`on_deposed`) and its
supervisor starts it again as a standby, since its memory (pending requests, claimed items) may
be stale in ways only a restart reliably clears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import ConsumerRecord

from shared.aio import within
from shared.kafka import NO_RESEND, KafkaClient, read_to_end
from shared.quiet_consumer import QuietConsumer, ring_payload
from shared.records import decode_record
from shared.schemas.lease import LeaseRecord, LeaseState

log = logging.getLogger(__name__)
RELEASE_WAIT_S = 1.0  # how long a clean stop waits for its release to be acknowledged
LEASE_PARTITION = 0  # `leases` has one partition; readers read it only (`LeaseKeeper._send` says why)


@dataclass
class Lease:
    term: int
    holder: str
    heard: float  # reader's monotonic clock: when the holder's claim or latest renewal was read
    released: bool = False


@dataclass
class StandbySeen:
    holder: str
    term: int
    sent_at: float  # wall clock of its last record


class LeaseLog:
    """The rules, applied to one role's records in log order (no I/O: unit-testable)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.current: Lease | None = None
        self.members: dict[str, StandbySeen] = {}  # every instance heard, active or standby
        self.fresh_topic = False  # the broker lost its data: the next `held` record starts a term

    def forget_terms(self) -> None:
        """The broker restarted with its data gone, so `leases` is a new, empty topic and terms
        start again (a successor that starts now claims term 1). The next `held` record read
        starts a term whatever its number, as on a topic read for the first time; until then the
        current lease stands, with its holder and when it was last heard, so a standby still waits
        out the lease before claiming and a surviving active's renewal (of its old term) simply
        continues it. Without this, a standby that saw term N on the old broker ignored the
        successor's term 1 as stale, claimed N + 1 and deposed it (a needless handover)."""
        self.fresh_topic = True

    def apply(self, r: LeaseRecord, now: float) -> bool:
        """Apply one record; True when it renewed or started the current term."""
        if r.role != self.role:
            return False
        self.members[r.holder] = StandbySeen(r.holder, r.term, r.sent_at)
        cur = self.current
        if r.state == "standby":
            return False
        if r.state == "held" and (cur is None or r.term > cur.term or self.fresh_topic):
            self.current = Lease(r.term, r.holder, now)
            self.fresh_topic = False
            return True
        if cur is None:
            return False
        if r.term == cur.term and r.holder == cur.holder:
            if r.state == "released":
                cur.released = True
                return False
            cur.heard = now
            return True
        return False

    def expired(self, now: float, lease_s: float) -> bool:
        cur = self.current
        return cur is None or cur.released or now - cur.heard > lease_s


def role_bell(topic: str, role: str) -> str:
    """The doorbell of one role's lease records (`+` is not valid in a topic name: no clash)."""
    return f"{topic}+{role}"


def instance_name(service_id: str) -> str:
    """A holder name unique per process: a restarted instance is not its own predecessor."""
    return f"{service_id}/{os.getpid()}-{int(time.time() * 1000)}"


class LeaseKeeper:
    """One instance's side of a role's election; `wait_active()` returns once it holds the lease."""

    def __init__(
        self,
        kafka: KafkaClient,
        topic: str,
        role: str,
        holder: str,
        lease_s: float,
        on_deposed: Callable[[], None] | None = None,
    ) -> None:
        self.kafka, self.topic, self.role, self.holder, self.lease_s = kafka, topic, role, holder, lease_s
        self.renew_s = lease_s / 2  # the active's period; also the fastest any instance sends
        self.bell = role_bell(topic, role)
        self.log = LeaseLog(role)
        self._on_deposed = on_deposed
        self._seq = 0
        self._sent: dict[int, float] = {}  # seq -> monotonic send time, until read back
        self._renewed_at = float("-inf")  # send time of the latest own renewal read back as holder
        self.active_term: int | None = None  # the term this instance holds (or held, once deposed)
        self.active_since: float | None = None  # monotonic: when it read its winning claim back
        self.deposed = False
        self._active = asyncio.Event()
        self._announced = float("-inf")  # when this standby last said it is there
        self._last_held = float("-inf")  # monotonic: this instance's latest claim or renewal sent
        self._changed = asyncio.Event()  # a record of this role was applied: re-plan the next tick
        self._progress = asyncio.Event()  # the read loop applied a batch (its position moved)
        self._tasks: list[asyncio.Task] = []
        self._consumer = None

    # -- what the service asks -----------------------------------------------------------------

    def is_active(self) -> bool:
        """True while this instance holds the lease and its window has not run out: check it
        right before acting, and stamp `active_term` on what is produced."""
        cur = self.log.current
        return (
            not self.deposed
            and cur is not None
            and cur.holder == self.holder
            and cur.term == self.active_term
            and time.monotonic() - self._renewed_at < self.lease_s
        )

    async def wait_active(self) -> int:
        await self._active.wait()
        assert self.active_term is not None
        return self.active_term

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        # Woken by this role's records only; a lost ring makes a renewal late, never a false
        # claim (the active wakes its reader after each send, a standby reads to the end first).
        c = self._consumer = await self.kafka.consumer(group=None)
        await self.kafka.assign_all(c, self.topic, from_end=False, partitions=[LEASE_PARTITION], bell=self.bell)
        await read_to_end(c, self._apply)
        cur = self.log.current
        log.info(
            "%s lease: %s; this instance is %s",
            self.role,
            f"term {cur.term} held by {cur.holder}" if cur else "never held",
            self.holder,
        )
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._tick_loop())]

    async def stop(self, release: bool = True) -> None:
        """Stop; a clean stop of the active releases the lease so its standby claims at once."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        active = self.is_active()
        if self._consumer is not None:
            # First: the release rings this process's doorbell for `leases`, and a ring that
            # wakes this (no longer read) consumer made its later stop hang (measured).
            with contextlib.suppress(Exception):
                await self._consumer.stop()
        if release and active:
            # Bounded: when the broker went away with us (a whole stack stopping), the lease
            # simply runs out; an unacked send must not hold up the stop.
            with contextlib.suppress(Exception):
                await within(self._send("released", self.active_term), RELEASE_WAIT_S)
                log.info("%s lease term %d released", self.role, self.active_term)

    def broker_restarted(self) -> None:
        """The broker lost its data (its watch repaired the restart): terms start again on the new
        `leases` topic (`LeaseLog.forget_terms`), and that topic is read again from its start
        under that rule, since records of it read before this call were judged by the old terms."""
        self.log.forget_terms()
        c = self._consumer
        if c is not None:
            for tp in c.assignment():
                c.seek(tp, 0)
            if isinstance(c, QuietConsumer):
                c.wake()
        log.warning("%s lease: the broker lost its data; the next claim read starts a term", self.role)

    # -- the loops -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=1000)
            for msgs in batches.values():
                for m in msgs:
                    self._apply(m)
            if batches:
                self._progress.set()

    def _apply(self, m: ConsumerRecord) -> None:
        r = decode_record(LeaseRecord, m)
        if r is None or r.role != self.role:
            return
        now = time.monotonic()
        self.log.apply(r, now)
        self._changed.set()
        cur = self.log.current
        if r.holder == self.holder and r.seq in self._sent:
            sent = self._sent.pop(r.seq)
            for old in [s for s in self._sent if s < r.seq]:
                del self._sent[old]
            if r.state == "held" and cur is not None and cur.holder == self.holder and cur.term == r.term:
                self._renewed_at = sent
                if self.active_term != r.term:
                    self._became_active(r.term)
        if self.active_term is not None and not self.deposed and cur is not None and cur.holder != self.holder:
            self._was_deposed(cur)

    def _became_active(self, term: int) -> None:
        self.active_term = term
        self.active_since = time.monotonic()
        log.warning("%s: this instance (%s) is now active, term %d", self.role, self.holder, term)
        self._active.set()

    def _was_deposed(self, cur: Lease) -> None:
        self.deposed = True
        log.error(
            "%s: deposed: term %d is held by %s (this instance held term %d and missed its renewals)",
            self.role,
            cur.term,
            cur.holder,
            self.active_term,
        )
        if self._on_deposed is not None:
            self._on_deposed()

    async def _tick_loop(self) -> None:
        """Act when something is due (`_tick`), then sleep until the next deadline or until a
        record of this role changes the plan (a release is claimed at once, not a period later)."""
        while True:
            self._changed.clear()
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 (the broker is briefly away: the next tick retries)
                log.warning("%s lease tick failed; retrying", self.role, exc_info=True)
                self._last_held = time.monotonic()  # retry a period later, not in a tight loop
            with contextlib.suppress(TimeoutError):
                await within(self._changed.wait(), max(self._next_due() - time.monotonic(), 0.0))

    def _next_due(self) -> float:
        """When `_tick` may next have something to do (monotonic). Nothing is sent sooner than
        `renew_s` after this instance's previous claim or renewal: a claim not yet read back is
        not repeated at once, and the active renews exactly one period after its last renewal."""
        cur, paced = self.log.current, self._last_held + self.renew_s
        if self.deposed:
            return time.monotonic() + 3600.0
        if cur is not None and cur.holder == self.holder and not cur.released:
            return paced
        if self.log.expired(time.monotonic(), self.lease_s):
            return paced
        # a standby: the lease's deadline (just past it: `expired` is strict), or its next announce
        return min(cur.heard + self.lease_s + 0.005, self._announced + self.lease_s)

    async def _tick(self) -> None:
        if self.deposed:
            return
        cur, now = self.log.current, time.monotonic()
        paced = now < self._last_held + self.renew_s
        if cur is not None and cur.holder == self.holder and not cur.released:
            if not paced:
                await self._send("held", cur.term)  # renew (read back, it extends the window)
        elif self.log.expired(now, self.lease_s):
            if paced:
                return
            if cur is not None and not cur.released:
                await self._read_up_to_now()  # a renewal read late (a lost ring) forbids the claim
                cur = self.log.current
                if not self.log.expired(time.monotonic(), self.lease_s) or cur.holder == self.holder:
                    return
            term = (cur.term if cur else 0) + 1
            log.info("%s lease %s: claiming term %d", self.role, "free" if cur is None else "lapsed", term)
            await self._send("held", term)
        elif now - self._announced >= self.lease_s:  # a standby's presence needs no faster beat
            self._announced = now
            await self._send("standby", cur.term)

    async def _read_up_to_now(self) -> None:
        """Wait until the read loop has applied everything the broker holds now (bounded by
        `lease_s`: a broker that does not answer raises, and the claim waits for a later tick)."""
        c = self._consumer
        end = await c.end_offsets(list(c.assignment()))
        if isinstance(c, QuietConsumer):
            c.wake()  # asleep: fetch now, not at its next look
        deadline = time.monotonic() + self.lease_s
        while True:
            self._progress.clear()
            if all([await c.position(tp) >= e for tp, e in end.items()]):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role} lease: the log's end was not reached before claiming")
            with contextlib.suppress(TimeoutError):
                await within(self._progress.wait(), left)

    async def _send(self, state: LeaseState, term: int) -> None:
        self._seq += 1
        self._sent[self._seq] = time.monotonic()
        record = LeaseRecord(
            role=self.role, holder=self.holder, term=term, state=state, sent_at=time.time(), seq=self._seq
        )
        if state == "held":
            self._last_held = self._sent[self._seq]
        # Not re-sent when refused: the next tick sends the state of that moment (produce_resend.py).
        # Lands on partition 0 whatever the producer's metadata says (`KafkaClient._single_partition`:
        # a stale 4-partition count after a restart sent a successor's claims to partition 1,
        # never read back: the gated real-tansu test, session 8). Readers read partition 0 only.
        landed = await self.kafka.send(self.topic, record, key=self.role, resend=NO_RESEND)
        self.kafka.ring(self.bell, landed)  # this role's readers (the topic's own bell wakes no lease reader)
        if state == "held" and isinstance(self._consumer, QuietConsumer):
            self._consumer.wake(self.topic, [ring_payload(landed)])  # read back without a ring
