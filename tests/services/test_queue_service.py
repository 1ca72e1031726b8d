"""The queue service under failure and load: a worker or the queue service itself SIGKILLed mid-job
loses and duplicates nothing; RT requests keep priority over a running batch; `tandem batch submit`."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.kafka import KafkaClient, fetch_decoded
from shared.schemas.capacity import BECapacity
from shared.schemas.results import Accepted, Delta, ResultBatch
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import chat_body, openai_client, worker_heartbeat
from tests.services.test_batch_api import (
    IDLE_TICK_S,
    attempts,
    chat_lines,
    comparable,
    in_flight,
    jsonl,
    read_lines,
    submit,
    wait_final,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(make_stack):
    return make_stack(TANDEM_BE_PER_WORKER=6, TANDEM_IDLE_TICK_S=IDLE_TICK_S).start(("w0", "w1"), queue=True)


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


def _exactly_once(client, done, lines) -> dict[str, dict]:
    """Every input has exactly one output line, and it succeeded."""
    assert done.status == "completed", done
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (len(lines), len(lines), 0)
    out = read_lines(client, done.output_file_id)
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(ln["custom_id"] for ln in lines)  # none lost, none twice
    assert all(o["response"]["status_code"] == 200 for o in out)
    return {o["custom_id"]: o["response"]["body"] for o in out}


def _same_as_sync(stack, lines, bodies: dict[str, dict], n: int = 4) -> None:
    for ln in lines[:n]:
        sync = httpx.post(f"{stack.url}/v1/chat/completions", json=ln["body"], timeout=120).json()
        assert comparable(bodies[ln["custom_id"]]) == comparable(sync)


def _wait_running_on(stack, worker: str, batch_id: str) -> None:
    """Until the worker's heartbeat lists an item of the batch as running."""

    def running() -> bool:
        hb = asyncio.run(worker_heartbeat(stack, worker))
        return any(k.startswith(batch_id) for k in hb.running_ids)

    stack.wait_until(f"an item of {batch_id} running on {worker}", running)


def test_worker_killed_mid_job_items_rerun_elsewhere_exactly_once(stack, client):
    lines = chat_lines(24, max_tokens=300, prefix="wk")
    batch = submit(client, lines)
    _wait_running_on(stack, "w1", batch.id)
    stack.kill("w1", signal.SIGKILL)  # mid-item: its items are re-run on w0
    done = wait_final(client, batch.id, stack)
    bodies = _exactly_once(client, done, lines)
    assert max(attempts(stack, batch.id).values()) >= 1  # the killed worker's items ran again
    _same_as_sync(stack, lines, bodies)  # greedy: re-run items give the uninterrupted text
    stack.worker("w2")
    stack.wait_workers(2)


def _wait_in_flight(stack, batch_id: str) -> None:
    stack.wait_until(f"an item of {batch_id} in flight", lambda: in_flight(stack, batch_id) > 0)


async def _wait_orphan_result(stack, batch_id: str, killed: threading.Event, reading: threading.Event) -> str:
    """The first item of the batch that finishes on a worker after `killed` is set: its result
    lands on the queue's results partition (read from its end; `reading` is set once the probe
    reads it). Returns the item's request id."""
    topics = Topics(stack.prefix)
    queue_partition = zlib.crc32(f"{stack.prefix}-queue".encode()) % topics.results.partitions
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-results-probe")
    consumer = await kafka.consumer(group=None, hot=True)
    try:
        await kafka.assign_all(consumer, topics.results.name, from_end=True, partitions=[queue_partition])
        reading.set()
        while True:
            for batch in await fetch_decoded(consumer, ResultBatch):
                if not killed.is_set():
                    continue  # the live queue service records these
                for e in batch.events:
                    if isinstance(e, Delta) and e.finish_reason and e.request_id.startswith(batch_id):
                        return e.request_id
    finally:
        await kafka.stop()


def test_queue_service_killed_mid_job_loses_and_duplicates_nothing(stack, client):
    lines = chat_lines(40, max_tokens=120, prefix="qk")
    batch = submit(client, lines)
    wait_until(client, batch.id, 3, stack)
    # An item released by the dead queue service finishes while none runs: its result is on the
    # broker, and must neither be lost (the item runs again) nor be recorded twice. The probe
    # reads the queue's results partition *before* the kill: subscribing after it, under load,
    # took longer than the in-flight items needed to finish, and then no result ever came.
    killed, reading = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(asyncio.run, asyncio.wait_for(_wait_orphan_result(stack, batch.id, killed, reading), 300))
        stack.wait_until("the results probe reads the queue's partition", reading.is_set)
        _wait_in_flight(stack, batch.id)  # between two releases nothing may be in flight: kill mid-item
        stack.kill("queue", signal.SIGKILL)
        killed.set()
        during = client.batches.retrieve(batch.id)  # the gateway still answers from the database
        assert during.status == "in_progress" and during.request_counts.completed < 40
        probe.result()  # 300 s is a safety net against a hang; the result comes in seconds
    stack.queue("queue-2")
    done = wait_final(client, batch.id, stack)
    bodies = _exactly_once(client, done, lines)
    assert max(attempts(stack, batch.id).values()) >= 1  # what was in flight was released again
    _same_as_sync(stack, lines, bodies)


async def _wait_capacity(stack, match) -> BECapacity:
    """The first BE capacity report the scheduler publishes from now on that `match`es."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-capacity-probe")
    consumer = await kafka.consumer(group=None)
    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).be_capacity.name, from_end=True)
        while True:
            for report in await fetch_decoded(consumer, BECapacity):
                if match(report):
                    return report
    finally:
        await kafka.stop()


async def _record_results(
    stack, reading: threading.Event, done: threading.Event, rt_expected: int, batch_ids: list[str]
) -> list[tuple[int, ResultBatch]]:
    """Every result batch the workers publish (all partitions: the gateway's and the queue's)
    from `reading` until `done` *and* the last token of `rt_expected` RT requests (ids not of a
    batch in `batch_ids`, filled in before `done`) have been read: the test's HTTP responses can
    return before this log has read their final deltas (it missed one that way under load). With
    the broker record's timestamp: a worker stamps its records when it hands them to the
    producer, one flush per engine step, so within one worker the timestamps order its steps'
    events across partitions (the same clock, the same process)."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-results-log")
    consumer = await kafka.consumer(group=None, hot=True)
    out: list[tuple[int, ResultBatch]] = []
    # Only RT requests this log saw accepted count: a previous test's request finishing after the
    # log started (read from the end) once stood in for one of ours, so the log stopped before
    # our fourth request's last token and the test saw three RT requests.
    rt_accepted: set[str] = set()
    rt_finished: set[str] = set()

    def all_read() -> bool:
        return done.is_set() and len(rt_finished) >= rt_expected

    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).results.name, from_end=True)
        reading.set()
        while not all_read():
            for msgs in (await consumer.getmany(timeout_ms=200)).values():
                for m in msgs:
                    batch = ResultBatch.decode(m.value)
                    out.append((m.timestamp, batch))
                    rt = [e for e in batch.events if not e.request_id.startswith(tuple(batch_ids))]
                    rt_accepted.update(e.request_id for e in rt if isinstance(e, Accepted))
                    rt_finished.update(
                        e.request_id
                        for e in rt
                        if isinstance(e, Delta) and e.finish_reason and e.request_id in rt_accepted
                    )
    finally:
        await kafka.stop()
    return out


def _be_progress_while_rt_ran(results: list[tuple[int, ResultBatch]], batch_id: str) -> dict[str, int]:
    """For each RT request in `results`: the most tokens any one BE item of the batch gained on
    the RT request's worker between the RT request entering that worker's engine (its
    `Accepted`) and its last token. Counted in engine steps, not seconds, so a busy machine
    slows both sides alike and cannot change it."""
    events = sorted(((ts, b.source, e) for ts, b in results for e in b.events), key=lambda x: x[0])
    accepted = {e.request_id: (ts, w) for ts, w, e in events if isinstance(e, Accepted)}
    finished = {e.request_id: ts for ts, _, e in events if isinstance(e, Delta) and e.finish_reason}
    rt_ids = [r for r in accepted if not r.startswith(batch_id) and r in finished]
    progress = {}
    for rt in rt_ids:
        (start, worker), end = accepted[rt], finished[rt]
        gained: dict[str, int] = {}
        for ts, source, e in events:
            if start < ts <= end and source == worker and isinstance(e, Delta) and e.request_id.startswith(batch_id):
                gained[e.request_id] = gained.get(e.request_id, 0) + len(e.token_ids)
        progress[rt] = max(gained.values(), default=0)
    return progress


def test_rt_requests_complete_while_a_batch_runs(stack, client):
    """RT requests keep priority over a running batch: they are neither queued behind its items
    (the queue holds those back, the worker admits RT at once) nor starved by the BE items
    running beside them (each step serves the RT request too). Observed in engine steps from
    the workers' result events, so no load on the machine can break it; the latency ratio this
    used to assert could."""
    # Both workers idle (the previous test's requests may still be leaving them): 2 x 6 BE slots.
    idle = asyncio.run(asyncio.wait_for(_wait_capacity(stack, lambda r: r.slots == 2 * 6), 120))
    assert idle.by_model == {"tiny": 12}
    rt_tokens = 16

    def rt_request(i: int) -> None:
        body = chat_body(f"rt {i}", rt_tokens, ignore_eos=True)
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == rt_tokens

    reading, done, batch_ids = threading.Event(), threading.Event(), ["batch_"]
    with ThreadPoolExecutor(1) as pool:
        log = pool.submit(asyncio.run, _record_results(stack, reading, done, 4, batch_ids))
        stack.wait_until("the results log reads the results topic", reading.is_set)
        batch = submit(client, chat_lines(30, max_tokens=150, prefix="rt"))
        batch_ids[:] = [batch.id]
        # Items run on every worker before the first RT request is sent: the batch's items start
        # (and end) together, so the first completion, which this waited for before, was the
        # moment a worker had none running and an RT request there had nothing to compete with.
        for worker in sorted(stack.running_workers()):
            _wait_running_on(stack, worker, batch.id)
        for i in range(4):  # served while the batch holds the BE slots
            rt_request(i)
        # Not asserted: that the batch is still in progress now. Its 30 short items can end while
        # a slow loop serves the 4 RT requests one after another (it failed so under load); that
        # RT did not wait for the batch is shown in engine steps below.
        done.set()
        results = log.result(timeout=120)  # the 4 RT requests' last tokens were produced: they returned
    progress = _be_progress_while_rt_ran(results, batch.id)
    assert len(progress) == 4, progress
    # Each RT request took about one step per token (prefill, then 15 decodes): a BE item beside
    # it gained as many. Queued behind the batch's items (150 tokens each) or left out of steps,
    # it would have let BE items gain up to 150. Twice its tokens leaves room for the steps in
    # which its admission and its last token were flushed.
    assert max(progress.values()) <= 2 * rt_tokens, progress
    assert any(gained > 0 for gained in progress.values()), progress  # RT did run beside BE items
    assert wait_final(client, batch.id, stack).request_counts.completed == 30


def test_batch_submit_cli_waits_and_writes_the_output(stack, tmp_path):
    lines = chat_lines(12, max_tokens=6, prefix="cli")
    src = tmp_path / "jobs.jsonl"
    src.write_bytes(jsonl(lines))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "batch",
            "submit",
            str(src),
            "--wait",
            "--url",
            stack.url,
            "--poll-interval",
            "0.2",
            "--metadata",
            "team=qa",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(x) for x in (tmp_path / "jobs.output.jsonl").read_text().splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)
    assert "12 completed, 0 failed of 12" in proc.stderr and "req" in proc.stderr  # the progress bar ran
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "url": "/v1/chat/completions", "body": {}}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "batch",
            "submit",
            str(bad),
            "--wait",
            "--url",
            stack.url,
            "--poll-interval",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "line 1: invalid_request" in proc.stderr


def _in_flight_items(stack, batch_id: str) -> list[tuple[str, str, int]]:
    """(custom_id, request_id, attempt) of every item of the batch in flight now."""
    import sqlite3

    from tests.services.test_batch_api import _db

    with sqlite3.connect(_db(stack)) as conn:
        rows = conn.execute(
            "SELECT custom_id, request_id, attempt FROM tandem_batch_items WHERE batch_id = ? AND status = 'in_flight'",
            (batch_id,),
        )
        return list(rows)


async def _send_gap(stack, request_id: str, attempt: int) -> None:
    """A delta far ahead of anything the item has: what the queue reads when the deltas between
    were lost (a produce the broker refused, or one re-sent after later ones)."""
    topics = Topics(stack.prefix)
    partition = zlib.crc32(f"{stack.prefix}-queue".encode()) % topics.results.partitions
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-gap")
    await kafka.start()
    try:
        gap = Delta(request_id=request_id, attempt=attempt, index=100_000, token_ids=[1], text="?")
        await kafka.send(topics.results.name, ResultBatch(source="test-gap", events=[gap]), partition=partition)
    finally:
        await kafka.stop()


def test_a_gap_in_an_items_deltas_runs_it_again_and_the_job_ends_exactly_once(stack, client):
    """The queue used to drop a delta that skipped ahead and wait for the missing ones forever
    (the item stayed in flight until the queue or the broker restarted). Now, as the gateway
    resumes a stream, it runs the item again as the next attempt; the job completes with every
    item once and bodies equal to synchronous calls."""
    lines = chat_lines(6, max_tokens=300, prefix="gap")
    batch = submit(client, lines)
    _wait_in_flight(stack, batch.id)
    for custom_id, request_id, attempt in _in_flight_items(stack, batch.id):
        asyncio.run(_send_gap(stack, request_id, attempt))
        stack.wait_until(
            f"{custom_id} re-run or finished",
            lambda c=custom_id, a=attempt: (
                attempts(stack, batch.id)[c] > a or c not in {i[0] for i in _in_flight_items(stack, batch.id)}
            ),
        )
        if attempts(stack, batch.id)[custom_id] > attempt:
            break  # it was still running when the gap came: re-run (else it finished first: try another)
    else:
        pytest.fail("every item finished before its gap arrived")
    assert attempts(stack, batch.id)[custom_id] == attempt + 1
    bodies = _exactly_once(client, wait_final(client, batch.id, stack), lines)
    _same_as_sync(stack, lines, bodies)
