"""Lease terms across a broker restart (shared/lease.py, `LeaseLog.forget_terms`), on a real tansu
killed and started again on the same port with its data gone.

The case: the active dies with the broker (`tandem chaos`, broker + scheduler), and its successor
starts on the new broker and claims term 1 on the new, empty `leases` topic. A standby that lived
through the restart had seen a higher term on the old broker; it used to ignore term 1 as stale,
claim the next term once the dead active's lease ran out, and depose the successor (a needless
handover). Now its broker watch tells its keeper, which takes the new topic's first claim as the
term, whatever its number, and stands by.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

import pytest

from services.broker import start_broker
from shared.broker_watch import BrokerWatch
from shared.kafka import KafkaClient, read_to_end
from shared.lease import LeaseKeeper
from shared.schemas.lease import LeaseRecord
from shared.settings import ServiceSettings
from shared.topics import Topics

pytestmark = pytest.mark.timeout(400)
PREFIX = "leaserestart"
# The successor must be up and claiming, and the standby must have noticed the restart, before the
# dead active's lease runs out in the standby's eyes; otherwise the standby's claim is a true
# takeover. 10 s was not enough at load 28 (the successor's start took longer and the standby,
# rightly, claimed first), so a lease far longer than any start of this busy host. The test waits
# for the standby's first announcement after that lease, so it lasts one to two leases.
LEASE_S = 30.0


class _Instance:
    """One service instance: its client, its broker watch (which tells its keeper of a restart,
    as the services' restart callbacks do) and its lease keeper."""

    def __init__(self, bootstrap: str, name: str, deposed: list[str]) -> None:
        self.topics = Topics(PREFIX)
        self.kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap, topic_prefix=PREFIX), name)
        self.keeper = LeaseKeeper(
            self.kafka, self.topics.leases.name, "scheduler", name, LEASE_S, on_deposed=lambda: deposed.append(name)
        )
        self.watch = BrokerWatch(self.kafka, PREFIX, self._on_restart, retry_s=0.2)

    async def _on_restart(self, _restart) -> None:
        self.keeper.broker_restarted()

    async def start(self) -> None:
        await self.kafka.start(self.topics.static())
        await self.watch.start()
        await self.keeper.start()

    async def die(self) -> None:
        """Stop running without a word (SIGKILL): nothing released, nothing sent."""
        await self.watch.stop()
        for t in self.keeper._tasks:  # noqa: SLF001 (simulating a process that is gone)
            t.cancel()
        await asyncio.gather(*self.keeper._tasks, return_exceptions=True)  # noqa: SLF001

    async def stop(self) -> None:
        await self.watch.stop()
        await self.keeper.stop(release=False)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.kafka.stop(), 30)


async def _records(bootstrap: str) -> list[LeaseRecord]:
    """Every record of `leases` so far, in log order."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "lease-probe")
    consumer = await kafka.consumer(group=None)
    out: list[LeaseRecord] = []
    try:
        await kafka.assign_all(consumer, Topics(PREFIX).leases.name, from_end=False)
        await read_to_end(consumer, lambda m: out.append(LeaseRecord.decode(m.value)))
    finally:
        await kafka.stop()
    return out


async def _until(what: str, done, timeout_s: float = 4 * LEASE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await done():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.2)


def test_a_standby_takes_the_new_brokers_first_claim_and_never_deposes_the_successor():
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host, port = bootstrap.rsplit(":", 1)

    async def run() -> None:
        nonlocal proc
        deposed: list[str] = []
        # A history: an earlier holder's term 5, released; `a` then claims term 6, `b` stands by.
        seed = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap, topic_prefix=PREFIX), "seed")
        await seed.start([Topics(PREFIX).leases])
        for state in ("held", "released"):
            rec = LeaseRecord(role="scheduler", holder="ghost", term=5, state=state, sent_at=time.time(), seq=1)
            await seed.send(Topics(PREFIX).leases.name, rec, key="scheduler")
        await seed.stop()
        a, b = _Instance(bootstrap, "a", deposed), _Instance(bootstrap, "b", deposed)
        await a.start()
        assert await asyncio.wait_for(a.keeper.wait_active(), 30) == 6
        await b.start()
        assert b.keeper.log.current.term == 6 and b.keeper.log.current.holder == "a"

        # `a` dies with the broker; the broker comes back empty; `a2` (its successor) starts there.
        await a.die()
        proc.kill()
        proc.wait()
        died_at = time.time()  # after a's last renewal was sent: b's lease deadline is before died_at + LEASE_S
        proc, _ = start_broker(host, int(port), tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        a2 = _Instance(bootstrap, "a2", deposed)
        try:
            await a2.start()
            assert await asyncio.wait_for(a2.keeper.wait_active(), 2 * LEASE_S) == 1  # the new topic's first term

            # The event: `b` sends its first lease record dated past the dead active's lease (the
            # moment the old rules made it claim). It must be a standby announcement of term 1.
            async def b_spoke_after_the_old_deadline() -> bool:
                return any(r.holder == "b" and r.sent_at > died_at + LEASE_S for r in await _records(bootstrap))

            await _until("b sends a lease record past the old lease's deadline", b_spoke_after_the_old_deadline)
            records = await _records(bootstrap)
            first_late = next(r for r in records if r.holder == "b" and r.sent_at > died_at + LEASE_S)
            assert (first_late.state, first_late.term) == ("standby", 1), first_late
            held = [(r.holder, r.term) for r in records if r.state == "held"]
            assert {h for h, _ in held} == {"a2"}, held  # on the new broker only the successor claimed
            assert b.keeper.log.current.term == 1 and b.keeper.log.current.holder == "a2"
            assert b.keeper.active_term is None and deposed == [], (b.keeper.active_term, deposed)
            assert a2.keeper.log.current.holder == "a2" and not a2.keeper.deposed
        finally:
            for inst in (a2, b, a):
                await inst.stop()

    try:
        asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
