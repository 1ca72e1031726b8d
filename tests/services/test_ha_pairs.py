"""HA pairs (issue 22 part B): two schedulers and two queue services on one stack, one of each
active. SIGKILL the active while RT streams run (or a batch runs): the standby takes over and
every stream completes once with the uninterrupted greedy text (nothing lost, no token twice),
every batch item has exactly one output. The figures each test logs (kill -> the standby's
"active" line) are measured on whatever machine runs the tests: docs/reliability.md says where
its numbers come from."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
import time

import httpx
import pytest

from tests.services.conftest import LEASE_S, openai_client
from tests.services.test_batch_api import attempts, chat_lines, submit, wait_final, wait_until
from tests.services.test_queue_service import _exactly_once, _same_as_sync, _wait_in_flight
from tests.services.test_streaming_cluster import _bodies, _reference, _stream

pytestmark = pytest.mark.timeout(600)
log = logging.getLogger(__name__)


def _active_line(role: str, term: int) -> str:
    return f"{role} active (term {term})"


def _log_has(stack, name: str, text: str) -> bool:
    return text in (stack.log_dir / f"{name}.log").read_text(errors="replace")


class HandoverWatch:
    """From a kill (or a SIGSTOP) until the standby logs that it is active, polled every 20 ms in a thread
    started at the kill: a figure to report, not a bound (nothing asserts on it)."""

    def __init__(self, stack, name: str, role: str) -> None:
        self.path, self.role = stack.log_dir / f"{name}.log", role
        self.killed_at = time.monotonic()
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        pattern = re.compile(rf"{self.role} active \(term (\d+)\)")
        while self.seconds is None and time.monotonic() - self.killed_at < 300:
            if pattern.search(self.path.read_text(errors="replace")):
                self.seconds = time.monotonic() - self.killed_at
            time.sleep(0.02)

    def wait(self, stack) -> float:
        stack.wait_until(f"{self.path.stem} active", lambda: not self._thread.is_alive())
        assert self.seconds is not None, f"{self.path.stem} never became active"
        log.warning(
            "%s handover: %.2f s from the kill (or SIGSTOP) to the standby's active line", self.role, self.seconds
        )
        return self.seconds


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(TANDEM_LEASE_S=LEASE_S, TANDEM_BE_PER_WORKER=6)
    s.urls = {"sched-a": s.scheduler("sched-a")}
    s.wait_log("sched-a", _active_line("scheduler", 1))
    s.urls["sched-b"] = s.scheduler("sched-b")
    s.wait_log("sched-b", "scheduler standing by")
    s.scheduler_url = s.urls["sched-a"]  # the active one counts the workers
    for w in ("w0", "w1"):
        s.worker(w)
    s.gateway()
    s.queue("queue-a")
    s.wait_log("queue-a", _active_line("queue", 1))
    s.queue("queue-b")
    s.wait_log("queue-b", "queue standing by")
    s.wait_workers(2)
    return s


def test_killing_the_active_scheduler_mid_stream_loses_and_repeats_nothing(stack):
    """Streams running when the active scheduler dies finish on their workers; requests sent
    while no scheduler is active wait in Kafka and are placed by the new active. Every text is
    the greedy reference, every count exact."""
    running = _bodies(6, 120)
    late = [{**b, "messages": [{"role": "user", "content": f"late request {i}"}]} for i, b in enumerate(_bodies(4, 40))]
    reference = _reference(stack.url, running + late)
    killed_at: list[HandoverWatch] = []

    def kill() -> None:
        stack.kill("sched-a", signal.SIGKILL)
        killed_at.append(HandoverWatch(stack, "sched-b", "scheduler"))

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:

            async def kill_once(n_chunks: int) -> None:
                if n_chunks == 10 and not killed_at:
                    await asyncio.to_thread(kill)

            first = asyncio.gather(
                *[_stream(client, stack.url, b, on_chunk=kill_once if i == 0 else None) for i, b in enumerate(running)]
            )
            while not killed_at:
                await asyncio.sleep(0.05)
            after = await asyncio.gather(*[_stream(client, stack.url, b) for b in late])
            return await first, after

    first, after = asyncio.run(run())
    killed_at[0].wait(stack)
    for r, ref, body in zip(first + after, reference, running + late):
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == body["max_tokens"]
        assert r["text"] == ref  # nothing lost, nothing repeated
    assert _log_has(stack, "sched-b", "recovered")
    stack.scheduler_url = stack.urls["sched-b"]
    stack.wait_workers(2)  # the new active places on both workers


def test_killing_the_active_queue_service_mid_batch_loses_and_duplicates_nothing(stack):
    client = openai_client(stack)
    lines = chat_lines(30, max_tokens=60, prefix="ha")
    batch = submit(client, lines)
    wait_until(client, batch.id, 3, stack)
    _wait_in_flight(stack, batch.id)  # kill mid-item
    stack.kill("queue-a", signal.SIGKILL)
    HandoverWatch(stack, "queue-b", "queue").wait(stack)
    done = wait_final(client, batch.id, stack)
    bodies = _exactly_once(client, done, lines)
    assert max(attempts(stack, batch.id).values()) >= 1  # what was in flight was released again
    assert _log_has(stack, "queue-b", "re-queued")
    _same_as_sync(stack, lines, bodies)


def test_a_paused_active_scheduler_is_deposed_and_acts_on_nothing(stack):
    """SIGSTOP the active scheduler past its lease: the standby takes over and places the
    requests sent meanwhile. SIGCONT: the old active finds its window over (it places nothing
    of what it reads on waking), reads the new term, and exits as deposed (75), the exit
    `tandem up --ha` restarts as a standby. Every stream ends with the exact greedy text."""
    stack.urls["sched-c"] = stack.scheduler("sched-c")
    stack.wait_log("sched-c", "scheduler standing by")
    stack.scheduler_url = stack.urls["sched-b"]
    bodies = [{**b, "messages": [{"role": "user", "content": f"paused {i}"}]} for i, b in enumerate(_bodies(4, 30))]
    reference = _reference(stack.url, bodies)  # placed by sched-b, still active
    stack.stopped.add("sched-b")  # its exit below is the point, not a failure
    stack.procs["sched-b"].send_signal(signal.SIGSTOP)
    try:
        HandoverWatch(stack, "sched-c", "scheduler").wait(stack)

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*[_stream(client, stack.url, b) for b in bodies])

        results = asyncio.run(run())
    finally:
        stack.procs["sched-b"].send_signal(signal.SIGCONT)
    assert stack.procs["sched-b"].wait(timeout=120) == 75
    log_b = (stack.log_dir / "sched-b.log").read_text(errors="replace")
    assert "scheduler: deposed: term 3 is held by sched-c/" in log_b
    for r, ref in zip(results, reference):
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == 30 and r["text"] == ref
    # What the woken scheduler may still have sent is dropped by the workers (a stale term):
    # counted, not asserted, since which fence stops it depends on timing.
    stale = sum(
        (stack.log_dir / f"{w}.log").read_text(errors="replace").count("dispatched at stale scheduler term")
        for w in ("w0", "w1")
    )
    log.warning("dispatches dropped by workers as of a stale scheduler term: %d", stale)
    stack.scheduler_url = stack.urls["sched-c"]
    stack.wait_workers(2)
