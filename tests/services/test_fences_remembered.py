"""Fences remembered (issue 22 part B): the scheduler keeps every fence on the compacted
`scheduler.fences` topic, so a scheduler started after a fence (a restart, or a standby taking
over) still fences the lost epoch instead of admitting it; the queue and advisory services' views
of live workers read the same topic (`shared/fence_feed.py`)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from services.scheduler.assignments import AssignmentTable
from services.scheduler.failures import FailureHandler
from services.scheduler.registry import Admission, WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from shared.fence_feed import follow_fences
from shared.kafka import KafkaClient
from shared.live_workers import LiveWorkers
from shared.metrics import ServiceMetrics
from shared.schemas.control import Fence
from shared.schemas.telemetry import Heartbeat
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import LEASE_S, worker_heartbeat

pytestmark = pytest.mark.timeout(400)


def _hb(epoch: int) -> Heartbeat:
    return Heartbeat(
        worker_id="w", model="m", max_model_len=1, dispatch_topic="d", started_at=1.0, sent_at=2.0, epoch=epoch
    )


async def _publish_fence(bootstrap: str, prefix: str, epoch: int) -> None:
    topics = Topics(prefix)
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix), "test-fence")
    await kafka.start(topics.static())
    await kafka.send(topics.scheduler_fences.name, Fence(worker_id="w", epoch=epoch), key="w")
    await kafka.stop()


def test_a_new_scheduler_reads_the_fences_back(kafka_bootstrap):
    asyncio.run(_publish_fence(kafka_bootstrap, "fr1", 5))
    asyncio.run(_publish_fence(kafka_bootstrap, "fr1", 4))  # an older one read later never lowers the bar

    async def load() -> WorkerRegistry:
        settings = SchedulerSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix="fr1")
        kafka = KafkaClient(settings, "test-scheduler")
        await kafka.start()
        registry = WorkerRegistry(60.0)
        table = AssignmentTable(kafka, Topics("fr1").scheduler_state.name)
        counter = ServiceMetrics("test").counter("rerouted_total", "x")
        handler = FailureHandler(kafka, settings, registry, table, counter, is_active=lambda: True)
        assert await handler.load_fences() == 1
        await kafka.stop()
        return registry

    registry = asyncio.run(load())
    assert registry.fenced == {"w": 5}
    assert registry.on_heartbeat(_hb(5)) is Admission.STALE  # not admitted at its lost epoch
    assert registry.on_heartbeat(_hb(6)) is Admission.NEW  # it rejoined: admitted


def test_the_queue_and_advisory_view_of_live_workers_reads_the_fences(kafka_bootstrap):
    async def run() -> None:
        prefix = "fr2"
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=prefix), "test-feed")
        await kafka.start(Topics(prefix).static())
        workers = LiveWorkers(timeout_s=60.0)
        workers.on_heartbeat(_hb(5))
        await _publish_fence(kafka_bootstrap, prefix, 3)  # an old fence, published before the reader started
        feed = asyncio.create_task(follow_fences(kafka, Topics(prefix).scheduler_fences.name, workers))
        try:
            await asyncio.sleep(0)
            await _publish_fence(kafka_bootstrap, prefix, 5)
            async with asyncio.timeout(60):
                while workers.live():
                    await asyncio.sleep(0.05)
            workers.on_heartbeat(_hb(6))  # rejoined at a higher epoch
            assert list(workers.live()) == ["w"]
        finally:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            await kafka.stop()

    asyncio.run(run())


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(TANDEM_LEASE_S=LEASE_S).start(("w0", "w1"))


def test_a_scheduler_started_after_a_fence_still_fences_the_lost_epoch(stack):
    """SIGSTOP w0 past the timeout: fenced. SIGKILL the scheduler while w0 is still stopped and
    start another: it reads the fence back, so when w0 resumes at its lost epoch it is fenced
    again (it drops its work and rejoins at epoch + 1), not admitted as if nothing happened."""
    before = asyncio.run(worker_heartbeat(stack, "w0"))
    stack.paused.add("w0")
    stack.procs["w0"].send_signal(signal.SIGSTOP)
    try:
        stack.wait_until("w0 lost", lambda: "w0" not in stack.scheduler_workers() and stack.gateway_workers() == 1)
        stack.wait_log("scheduler", "worker w0 lost")
        stack.kill("scheduler", signal.SIGKILL)
        stack.scheduler("scheduler-2")
        stack.wait_log("scheduler-2", "remembered 1 fenced worker epochs")
    finally:
        stack.procs["w0"].send_signal(signal.SIGCONT)
    after = asyncio.run(worker_heartbeat(stack, "w0", lambda hb: hb.epoch > before.epoch))
    assert after.epoch == before.epoch + 1  # re-admitted through a fence, not at its lost epoch
    assert f"declared lost at epoch {before.epoch}" in (stack.log_dir / "w0.log").read_text(errors="replace")
    # w0 also reads the first scheduler's fence on `control` when it resumes, so its rejoining
    # alone proves little: what only a remembered fence gives is that the new scheduler counts
    # it as re-admitted past the fence (without it, w0 would simply have "joined" at either epoch).
    stack.wait_log("scheduler-2", f"worker w0 re-admitted at epoch {before.epoch + 1} (lost at {before.epoch})")
    stack.wait_workers(2)  # the new scheduler places on it again
