"""Worker epochs (issue 22 part B): a worker declared lost that comes back is fenced and then
re-admitted, not ignored forever; its stale work is dropped, and `/health` does not count it
while it is lost."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from services.scheduler.registry import LOST_BUT_ALIVE, Admission, WorkerRegistry
from shared.live_workers import LiveWorkers
from shared.schemas.telemetry import Heartbeat
from tests.services.conftest import chat_body, worker_heartbeat
from tests.services.test_streaming_cluster import _bodies, _reference, _stream

pytestmark = pytest.mark.timeout(400)


def _hb(epoch: int, sent_at: float = 2.0) -> Heartbeat:
    return Heartbeat(
        worker_id="w", model="m", max_model_len=1, dispatch_topic="d", started_at=1.0, sent_at=sent_at, epoch=epoch
    )


def test_registry_fences_a_lost_epoch_and_readmits_a_higher_one(caplog):
    reg = WorkerRegistry(timeout_s=-1.0)  # everything heard is already overdue
    assert reg.on_heartbeat(_hb(5)) is Admission.NEW and reg.expire() == ["w"]
    assert reg.fenced == {"w": 5}
    for t in (3.0, 4.0):  # the lost process is alive after all: stale, said once, loudly
        assert reg.on_heartbeat(_hb(5, sent_at=t)) is Admission.STALE and "w" not in reg.workers
    alive = [r for r in caplog.records if LOST_BUT_ALIVE in r.getMessage()]
    assert len(alive) == 1 and alive[0].levelname == "WARNING" and "worker w " in alive[0].getMessage()
    assert reg.on_heartbeat(_hb(4)) is Admission.STALE  # an older epoch read late: stale too
    assert reg.on_heartbeat(_hb(6)) is Admission.NEW and "w" in reg.workers and not reg.fenced  # re-admitted
    reg.timeout_s = 60.0
    assert reg.on_heartbeat(_hb(6)) is Admission.KNOWN


def test_live_workers_do_not_count_a_fenced_epoch():
    workers = LiveWorkers(timeout_s=60.0)
    workers.on_heartbeat(_hb(5))
    assert list(workers.live()) == ["w"]
    workers.on_fence("w", 5)
    assert workers.live() == {}  # its heartbeats of epoch 5 keep coming: still not live
    workers.on_heartbeat(_hb(5, sent_at=3.0))
    assert workers.live() == {}
    workers.on_fence("w", 4)  # a fence read late does not lower the bar
    workers.on_heartbeat(_hb(6))
    assert list(workers.live()) == ["w"]


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack().start(("w0", "w1"))


def test_a_paused_worker_is_fenced_then_readmitted_and_its_stale_work_dropped(stack):
    """SIGSTOP w0 mid-stream past the worker timeout: the scheduler declares it lost and its
    streams resume on w1 (identical text: nothing lost or repeated), the gateway stops counting it.
    SIGCONT: its heartbeats of the lost epoch are fenced, it drops the requests it still held
    (re-placed already) and rejoins at a higher epoch, and it serves again."""
    bodies = _bodies(4, 200)
    reference = _reference(stack.url, bodies)
    before = asyncio.run(worker_heartbeat(stack, "w0"))
    paused: list[str] = []

    def pause_past_the_timeout() -> None:
        stack.paused.add("w0")
        stack.procs["w0"].send_signal(signal.SIGSTOP)
        try:
            # Lost as the scheduler sees it (no longer placed on) and as /health counts.
            stack.wait_until("w0 lost", lambda: "w0" not in stack.scheduler_workers() and stack.gateway_workers() == 1)
        finally:
            stack.procs["w0"].send_signal(signal.SIGCONT)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:

            async def pause_once(n_chunks):
                if n_chunks == 20 and not paused:
                    paused.append("w0")
                    await asyncio.to_thread(pause_past_the_timeout)

            tasks = [
                _stream(client, stack.url, b, on_chunk=pause_once if i == 0 else None) for i, b in enumerate(bodies)
            ]
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert paused == ["w0"]
    assert any(r["worker"] == "w0" for r in results), "no stream started on the paused worker"
    for r, ref in zip(results, reference):
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 200
        assert r["text"] == ref

    # Re-admitted: a heartbeat at a higher epoch, holding nothing of the old one (its KV freed).
    after = asyncio.run(worker_heartbeat(stack, "w0", lambda hb: hb.epoch > before.epoch and not hb.running_ids))
    assert after.epoch == before.epoch + 1
    stack.wait_workers(2)  # placed on by the scheduler and counted by /health again
    log = (stack.log_dir / "w0.log").read_text(errors="replace")
    assert f"declared lost at epoch {before.epoch}: dropping" in log
    dropped = int(log.split(f"declared lost at epoch {before.epoch}: dropping ")[1].split()[0])
    assert dropped >= 1  # it still held the streams that had moved to w1

    # Not ignored: with w1 gone, w0 serves.
    stack.kill("w1")
    stack.wait_until("w1 lost", lambda: stack.gateway_workers() == 1 and stack.scheduler_workers() == {"w0"})
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("after", 4), timeout=120)
    assert r.status_code == 200 and r.headers.get("x-tandem-worker") == "w0", r.text
