"""The active/standby lease (shared/lease.py): the log rules alone, then two keepers on the real
broker: one active, a paused active deposed by its standby's claim, a clean stop handing over at
once."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.kafka import KafkaClient
from shared.lease import LeaseKeeper, LeaseLog
from shared.schemas.lease import LeaseRecord
from shared.settings import ServiceSettings
from shared.topics import Topics

pytestmark = pytest.mark.timeout(120)
LEASE_S = 1.5
HANDOVER_LEASE_S = 30.0  # the clean-stop handover's lease: see the test


def _rec(holder: str, term: int, state: str = "held", role: str = "scheduler") -> LeaseRecord:
    return LeaseRecord(role=role, holder=holder, term=term, state=state, sent_at=time.time())


def test_first_claim_of_a_term_wins_and_stale_records_change_nothing():
    log = LeaseLog("scheduler")
    assert log.expired(0.0, 1.0)
    assert log.apply(_rec("a", 1), now=1.0) and log.current.holder == "a"
    assert not log.apply(_rec("b", 1), now=1.1)  # lost the race for term 1
    assert log.current.holder == "a" and log.current.heard == 1.0
    assert log.apply(_rec("a", 1), now=2.0) and log.current.heard == 2.0  # renewal
    assert not log.apply(_rec("b", 1, "standby"), now=2.5) and set(log.members) == {"a", "b"}
    assert not log.expired(2.9, 1.0) and log.expired(3.1, 1.0)
    assert log.apply(_rec("b", 2), now=3.2) and log.current.holder == "b"
    assert not log.apply(_rec("a", 1), now=3.3)  # the deposed active renewing its old term
    assert not log.apply(_rec("x", 5, role="queue"), now=3.4) and log.current.term == 2  # another role
    assert not log.apply(_rec("a", 2, "released"), now=3.5) and not log.current.released  # not the holder
    log.apply(_rec("b", 2, "released"), now=3.6)
    assert log.expired(3.7, 1.0)  # a clean stop: no need to wait out the lease


async def _keeper(
    bootstrap: str, prefix: str, name: str, deposed: list[str], lease_s: float = LEASE_S
) -> tuple[KafkaClient, LeaseKeeper]:
    topics = Topics(prefix)
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix), name)
    await kafka.start([topics.leases])
    keeper = LeaseKeeper(kafka, topics.leases.name, "scheduler", name, lease_s, on_deposed=lambda: deposed.append(name))
    await keeper.start()
    return kafka, keeper


async def _until(cond, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_one_active_a_silent_one_is_deposed_and_a_clean_stop_hands_over(kafka_bootstrap):
    async def run():
        deposed: list[str] = []
        ka, a = await _keeper(kafka_bootstrap, "lease1", "a", deposed)
        assert await asyncio.wait_for(a.wait_active(), 10) == 1 and a.is_active()
        kb, b = await _keeper(kafka_bootstrap, "lease1", "b", deposed)
        await asyncio.sleep(2 * LEASE_S)  # a keeps renewing: b stays standby
        assert a.is_active() and not b.is_active() and b.active_term is None
        assert set(b.log.members) == {"a", "b"}  # the standby announced itself

        # a "pauses": its loops stop without a word (like SIGSTOP); its window runs out first,
        # then b claims term 2
        for t in a._tasks:  # noqa: SLF001 (simulating a process that stopped running)
            t.cancel()
        stopped = time.monotonic()
        a_window_end = a._renewed_at + LEASE_S  # noqa: SLF001 (a's own view of its window)
        assert await asyncio.wait_for(b.wait_active(), 10) == 2
        # nobody acts while a's window may still be open: b became active only after it ended.
        # (Compared by timestamps, not by polling a then b: a slow event loop on a busy host may
        # wake the poller after both changes, which proves nothing either way.)
        assert b.active_since is not None and b.active_since > a_window_end, (b.active_since, a_window_end)
        assert not a.is_active()
        takeover = time.monotonic() - stopped
        assert takeover < 3 * LEASE_S + 2, takeover  # bounded: the lease plus a claim read back
        # a wakes: whatever it renews is read back after b's claim, so it is deposed, never active
        a._tasks = []  # noqa: SLF001
        a._tasks = [asyncio.create_task(a._read_loop()), asyncio.create_task(a._tick_loop())]  # noqa: SLF001
        await _until(lambda: deposed == ["a"])
        assert not a.is_active() and b.is_active()
        await a.stop()
        await ka.stop()

        await b.stop()
        await kb.stop()

        # A clean stop releases: a new standby takes over without waiting out the lease. With a
        # lease far longer than any stall of a loaded machine (not LEASE_S: a 1.5 s lease let a
        # starved active's renewal lapse, and a handover that took longer than 1.5 s read as
        # "waited out"), so the standby cannot claim before the release, and a takeover before
        # the lease could have run out is the release's doing.
        deposed.clear()
        kd, d = await _keeper(kafka_bootstrap, "lease2", "d", deposed, HANDOVER_LEASE_S)
        assert await asyncio.wait_for(d.wait_active(), 10) == 1
        kc, c = await _keeper(kafka_bootstrap, "lease2", "c", deposed, HANDOVER_LEASE_S)
        assert not c.is_active()
        t0 = time.monotonic()
        await d.stop()
        assert await asyncio.wait_for(c.wait_active(), HANDOVER_LEASE_S) == 2, "a released lease was waited out"
        assert time.monotonic() - t0 < HANDOVER_LEASE_S, "a released lease was waited out"
        assert deposed == []
        await c.stop()
        await kd.stop()
        await kc.stop()

    asyncio.run(run())
