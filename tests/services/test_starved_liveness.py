"""Starvation is not silence (issue 22, eleventh session; docs/reliability.md): a live worker
is not declared lost because the *scheduler* could not hear it, nor because its heartbeats were
slow to be acknowledged or refused by a restarting broker.

A real stack (scheduler, one worker, gateway) on its own tansu, at the production heartbeat
timing (a beat every 1 s, lost after 3 s: what `tandem chaos` runs, where a live worker was
declared lost 27 times on a busy host), with a long lease so that the lease's own lapse (a
different rule, shared/lease.py) does not stand in for the one tested here:
- the scheduler SIGSTOPped for longer than the worker timeout, then resumed;
- the broker SIGSTOPped for longer than the worker timeout, then resumed; the worker's
  heartbeats keep their cadence across it (each beat is built on time, not after the previous
  one's acknowledgement);
- the broker killed, left down for two housekeeping passes, and started again (its data gone).
After each, the scheduler has run several housekeeping passes and has not declared the worker
lost; across the broker's pause and restart the worker has not judged the gateway dead either
(the same rule, on its watch of its requests' owners). That the rule still declares a worker
that is really silent lost is `tests/services/test_worker_epochs.py` (a worker SIGSTOPped past
the timeout).
"""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import httpx
import pytest
from aiokafka.errors import UnknownError
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler import liveness
from services.worker.reports import WorkerReports
from shared.kafka import KafkaClient, read_to_end
from shared.schemas.telemetry import Heartbeat
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import START_TIMEOUT_S, Stack, worker_heartbeat
from tests.services.test_broker_restart import RestartableBroker

pytestmark = pytest.mark.timeout(900)

INTERVAL_S, TIMEOUT_S = 1.0, 3.0  # production defaults (shared/settings.py)
LOST = "worker w0 lost"
OWNER_LOST = "silent for over"  # the worker's line when it judges a gateway dead (services/worker/service.py)
# Safety net for passes while the broker is away: each takes about two seconds (the interval and
# a probe's timeout); this is only a bound against a housekeeping loop stuck on the broker.
PAUSED_PASSES_S = 120.0


@pytest.fixture(scope="module")
def broker():
    b = RestartableBroker()
    yield b
    b.kill()


@pytest.fixture(scope="module")
def stack(broker, tiny_model_dir, tmp_path_factory):
    env = {
        "TANDEM_HEARTBEAT_INTERVAL_S": INTERVAL_S,
        "TANDEM_WORKER_TIMEOUT_S": TIMEOUT_S,
        "TANDEM_UNKNOWN_REQUEST_GRACE_S": TIMEOUT_S,
        "TANDEM_LEASE_S": 30.0,
        "TANDEM_BROKER_RECOVERY_LOG_S": 3600,
    }
    s = Stack(broker.bootstrap, tiny_model_dir("llama"), tmp_path_factory.mktemp("starved"), "sl", **env)
    s.start(("w0",))
    yield s
    hung = s.stop()
    if hung:
        pytest.fail("a child of the test stack did not stop cleanly:\n" + "\n".join(hung), pytrace=False)


def _passes(stack: Stack) -> int:
    """Housekeeping passes the scheduler completed (-1 while its metrics do not answer)."""
    try:
        text = httpx.get(f"{stack.scheduler_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return -1
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_scheduler_housekeeping_passes_total":
                return int(sample.value)
    return -1


def _wait_passes(stack: Stack, n: int, what: str, timeout: float = START_TIMEOUT_S) -> None:
    """Until the scheduler has completed `n` more housekeeping passes than now."""
    start = _passes(stack)
    stack.wait_until(f"{n} housekeeping passes {what}", lambda: start >= 0 and _passes(stack) >= start + n, timeout)


def _scheduler_log(stack: Stack) -> str:
    return (stack.log_dir / "scheduler.log").read_text(errors="replace")


def _worker_log(stack: Stack) -> str:
    return (stack.log_dir / "w0.log").read_text(errors="replace")


async def _heartbeats_of(stack: Stack, worker_id: str) -> list[Heartbeat]:
    """Every heartbeat of `worker_id` the broker holds, in order."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-probe")
    out: list[Heartbeat] = []
    try:
        consumer = await kafka.consumer(group=None)
        await kafka.assign_all(consumer, Topics(stack.prefix).heartbeats.name, from_end=False)
        await read_to_end(consumer, lambda m: out.append(Heartbeat.decode(m.value)))
    finally:
        await kafka.stop()
    return sorted((hb for hb in out if hb.worker_id == worker_id), key=lambda hb: hb.sent_at)


def test_a_scheduler_paused_past_the_timeout_declares_no_live_worker_lost(stack):
    _wait_passes(stack, 3, "before the pause")  # it has heard the worker up to a probe
    before = len(_scheduler_log(stack))
    paused_at = time.time()
    stack.procs["scheduler"].send_signal(signal.SIGSTOP)
    try:
        # The worker heartbeats on for longer than the timeout while the scheduler hears nothing.
        asyncio.run(worker_heartbeat(stack, "w0", lambda hb: hb.sent_at > paused_at + TIMEOUT_S + INTERVAL_S))
    finally:
        stack.procs["scheduler"].send_signal(signal.SIGCONT)
    _wait_passes(stack, 4, "after the pause")
    assert LOST not in _scheduler_log(stack)[before:], _scheduler_log(stack)[before:]
    assert "w0" in stack.scheduler_workers()


def test_a_broker_paused_past_the_timeout_costs_no_worker_and_no_heartbeat_cadence(stack, broker):
    _wait_passes(stack, 2, "before the pause")
    before, worker_before = len(_scheduler_log(stack)), len(_worker_log(stack))
    paused_at = time.time()
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        # The scheduler keeps running its passes, past the timeout, with nothing heard. Bounded
        # well below the producer's 10 s request timeout per pass: a pass that waits on the
        # paused broker (a fence sent to it, as before) is the stall this must not have.
        _wait_passes(stack, int(TIMEOUT_S / INTERVAL_S) + 1, "while the broker is paused", PAUSED_PASSES_S)
    finally:
        broker.proc.send_signal(signal.SIGCONT)
    resumed_at = time.time()
    assert resumed_at - paused_at > TIMEOUT_S
    asyncio.run(worker_heartbeat(stack, "w0", lambda hb: hb.sent_at > resumed_at))
    _wait_passes(stack, 3, "after the pause")
    assert LOST not in _scheduler_log(stack)[before:], _scheduler_log(stack)[before:]
    assert OWNER_LOST not in _worker_log(stack)[worker_before:], _worker_log(stack)[worker_before:]
    # Every beat was built on time while the broker could not acknowledge any: the gaps between
    # consecutive beats across the pause stay near the interval (they were the pause's length,
    # when each beat waited for the previous one's acknowledgement).
    beats = [hb.sent_at for hb in asyncio.run(_heartbeats_of(stack, "w0"))]
    around = [t for t in beats if paused_at - 2 * INTERVAL_S <= t <= resumed_at + 2 * INTERVAL_S]
    gaps = [b - a for a, b in zip(around, around[1:], strict=False)]
    assert around and max(gaps) < 2.5 * INTERVAL_S, (paused_at, resumed_at, around)


def test_a_broker_restart_declares_no_live_worker_lost(stack, broker):
    _wait_passes(stack, 2, "before the restart")
    before, worker_before = len(_scheduler_log(stack)), len(_worker_log(stack))
    broker.kill()
    try:  # down for two passes or more, as `tandem chaos` leaves it down (--restart-delay 1 s)
        _wait_passes(stack, 2, "while the broker is down", PAUSED_PASSES_S)
    finally:
        broker.start()
    stack.wait_until("the scheduler saw the restart", lambda: "broker restarted" in _scheduler_log(stack)[before:])
    restarted_at = time.time()
    asyncio.run(worker_heartbeat(stack, "w0", lambda hb: hb.sent_at > restarted_at + TIMEOUT_S))
    _wait_passes(stack, int(TIMEOUT_S / INTERVAL_S) + 2, "after the restart")
    assert LOST not in _scheduler_log(stack)[before:], _scheduler_log(stack)[before:]
    # nor did the worker judge the gateway dead (it would drop the requests it sends next)
    assert OWNER_LOST not in _worker_log(stack)[worker_before:], _worker_log(stack)[worker_before:]
    stack.wait_workers(1)


class _RefusingKafka:
    """Refuses the first `refusals` sends as tansu does right after a restart, then accepts."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.sent = refusals, []

    async def send(self, topic, message, **kwargs):
        self.sent.append(message)
        if len(self.sent) <= self.refusals:
            raise UnknownError()


def _reports(kafka: _RefusingKafka, interval_s: float) -> WorkerReports:
    """The heartbeat path of `WorkerReports` alone: a heartbeat numbered by when it was built."""
    reports = object.__new__(WorkerReports)
    reports.settings = SimpleNamespace(heartbeat_interval_s=interval_s)
    reports.identity = SimpleNamespace(worker_id="w0")
    reports.topics, reports.kafka, reports._beats = Topics("t"), kafka, 0
    built = iter(range(1000))
    reports.heartbeat = lambda: next(built)
    return reports


def test_a_refused_heartbeat_is_sent_again_fresh_within_the_interval():
    kafka = _RefusingKafka(refusals=2)
    began = time.monotonic()
    asyncio.run(_reports(kafka, interval_s=1.0).send_heartbeat())
    assert kafka.sent == [0, 1, 2]  # sent again twice, each time built anew (newer state)
    assert time.monotonic() - began < 1.0  # before the next beat was due


def test_a_heartbeat_refused_for_longer_than_the_interval_is_left_to_the_next_beat():
    kafka = _RefusingKafka(refusals=100)
    asyncio.run(_reports(kafka, interval_s=0.2).send_heartbeat())
    assert 1 < len(kafka.sent) < 5  # tried again within the interval only (0.05 s, then 0.1 s)

    async def superseded() -> list:
        kafka = _RefusingKafka(refusals=100)
        reports = _reports(kafka, interval_s=1.0)
        reports.heartbeat = lambda: asyncio.current_task().get_name()  # which beat built each send
        first = asyncio.create_task(reports.send_heartbeat(), name="first")
        await asyncio.sleep(0)  # the first beat is refused and waits to try again ...
        await asyncio.create_task(reports.send_heartbeat(), name="second")  # ... a newer beat starts
        await first
        return kafka.sent

    sent = asyncio.run(superseded())
    assert sent.count("first") == 1 and sent.count("second") > 1  # only the newer beat was tried again


def test_a_housekeeping_step_that_hangs_is_given_up_and_named(caplog, monkeypatch):
    """(c) of issue 22: a step waiting on something that never comes (the broker, a position)
    no longer stalls housekeeping silently: it is given up at its limit, by name, and the pass
    goes on; a step that fails is named too."""
    monkeypatch.setattr(liveness, "STEP_LIMIT_S", 0.05)
    steps = liveness.Liveness(svc=None)

    async def fails() -> None:
        raise RuntimeError("refused")

    async def run() -> dict[str, float]:
        timings: dict[str, float] = {}
        await steps._step("probe", asyncio.Event().wait(), timings)  # never set
        await steps._step("grant", fails(), timings)
        return timings

    caplog.set_level("WARNING")
    timings = asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert any("housekeeping step probe did not finish within" in ln for ln in lines), lines
    assert any("housekeeping step grant failed" in ln for ln in lines), lines
    assert set(timings) == {"probe", "grant"} and timings["probe"] >= 0.05
