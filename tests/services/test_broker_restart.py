"""The broker restarting under a live stack (issue 22, part B): a real tansu killed with SIGKILL
and started again on the same port, with its data gone, under a real scheduler, worker, queue
and gateway (shared/broker_watch.py, docs/reliability.md "Broker restarts").

Afterwards: a new chat request gets the same greedy text as before; a stream open across the
restart ends with 503 `broker_restarted` in-band (never hangs); a running batch completes with
every item exactly once. Each stack here has its own broker (the session's broker is shared).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import httpx
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from services.broker import start_broker
from shared.broker_watch import BrokerWatch
from shared.kafka import KafkaClient
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import Stack, chat_body, openai_client
from tests.services.test_batch_api import attempts, chat_lines, in_flight, read_lines, submit, wait_final, wait_until

pytestmark = pytest.mark.timeout(900)

RESTART_LOGGED = "broker restarted"


class RestartableBroker:
    """tansu on a fixed port, killed and started again at will (in memory: a restart loses all)."""

    def __init__(self) -> None:
        self.proc, self.bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.host, port = self.bootstrap.rsplit(":", 1)
        self.port = int(port)

    def restart(self) -> None:
        self.kill()
        self.start()

    def start(self) -> None:
        """Start it again (after `kill`) on the same port, empty."""
        self.proc, _ = start_broker(
            self.host, self.port, tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def broker():
    b = RestartableBroker()
    yield b
    b.kill()


@pytest.fixture
def own_broker():
    b = RestartableBroker()
    yield b
    b.kill()


@pytest.fixture(scope="module")
def stack(broker, tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("broker-restart")
    # The watch's default: a check when its broker connection drops, the safety check every 30 s.
    s = Stack(broker.bootstrap, tiny_model_dir("llama"), log_dir, "br", TANDEM_BROKER_RECOVERY_LOG_S=3600)
    s.start(("w0",), queue=True)
    yield s
    hung = s.stop()
    if hung:
        pytest.fail("a child of the test stack did not stop cleanly:\n" + "\n".join(hung), pytrace=False)


def _stream_first_chunk(url: str, body: dict, out: dict, got_first: threading.Event) -> None:
    """Read a stream to its end in a thread: every `data:` payload in `out["events"]`."""
    out["events"] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(300.0)) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[len("data: ") :])
                    got_first.set()
    except Exception as exc:  # noqa: BLE001 (reported by the test)
        out["exception"] = repr(exc)
    finally:
        got_first.set()


def _restart_seen_by(stack: Stack, *names: str) -> None:
    for name in names:
        stack.wait_log(name, RESTART_LOGGED)


def test_stack_survives_a_broker_restart(stack, broker):
    client = openai_client(stack)
    prompt = chat_body("before and after the restart", max_tokens=12)
    reference = httpx.post(f"{stack.url}/v1/chat/completions", json=prompt, timeout=300).json()
    reference_text = reference["choices"][0]["message"]["content"]

    # A batch job running, and a long stream open, when the broker goes away.
    lines = chat_lines(40, max_tokens=200, prefix="br")
    batch = submit(client, lines)
    wait_until(client, batch.id, 1, stack)
    stream: dict = {}
    got_first = threading.Event()
    body = chat_body("a long answer please", max_tokens=400, ignore_eos=True, stream=True)
    reader = threading.Thread(target=_stream_first_chunk, args=(stack.url, body, stream, got_first), daemon=True)
    reader.start()
    assert got_first.wait(300), "the stream never started"
    assert stream.get("status") == 200 and stream["events"], stream

    assert in_flight(stack, batch.id) > 0, "the batch is not running when the broker restarts"
    broker.restart()
    _restart_seen_by(stack, "gateway", "scheduler", "queue", "w0")

    # The open stream ends, in-band, with the clear error (the thread would hang otherwise).
    reader.join(300)
    assert not reader.is_alive(), "the stream open across the restart hangs"
    assert stream.get("status") == 200 and "exception" not in stream, stream
    assert stream["events"][-1] == "[DONE]"
    error = json.loads(stream["events"][-2])["error"]
    assert error["code"] == "broker_restarted", error

    # A new request is served, with the same greedy text as before, once the gateway and the
    # scheduler count the worker again: until then a request gets 503 `no_workers` at once, which
    # the assertion below would read as a wrong answer. (Every broker restart of session 10's
    # chaos runs declared a worker lost for a moment; since session 11 a restart gives every
    # worker a fresh window and a refused heartbeat is re-sent, test_starved_liveness.py, but the
    # gateway still counts workers on its own clock.) What the test asks is that no request hangs.
    stack.wait_workers(1)
    # Right after a restart tansu refuses some produces for a while: a clear 503 with Retry-After
    # that a client retries, never a 500 or a hang.
    for _ in range(5):
        after = httpx.post(f"{stack.url}/v1/chat/completions", json=prompt, timeout=300)
        if after.status_code != 503:
            break
        assert after.json()["error"]["code"] == "broker_unavailable" and after.headers["Retry-After"], after.text
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["message"]["content"] == reference_text
    # the request's path, named at INFO for a minute after the restart (steady state: DEBUG)
    rid = after.headers["x-request-id"]
    assert f"[{rid}] submitted attempt" in (stack.log_dir / "gateway.log").read_text()
    # waited for, not read at once: "placed on" follows the acks of both the dispatch and the
    # assignment's state record, and a refused state record is re-sent after the worker has
    # already answered (a run failed reading the log at once, session 8)
    stack.wait_log("scheduler", f"[{rid}] placed on w0 (br.dispatch.w0[0]@")
    assert f"[{rid}] dispatch received (br.dispatch.w0[0]@" in (stack.log_dir / "w0.log").read_text()

    # The batch finishes with every item exactly once, all succeeded.
    done = wait_final(client, batch.id, stack)
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(lines), 0)
    out = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert max(attempts(stack, batch.id).values()) >= 1, "no item was re-released after the restart"


def test_broker_and_scheduler_killed_together_recover(own_broker, tiny_model_dir, tmp_path):
    """Broker and scheduler SIGKILLed together (a `tandem chaos` pair that never recovered): the
    new scheduler claims term 1 on the new broker's empty `leases` topic while the worker had seen
    term 2, so it dropped every dispatch as a deposed scheduler's. Workers (and the scheduler's
    session affinity) now forget their term floors on a broker restart: a request is served, with
    the reference text, and nothing is dropped for its term."""
    # the recovery log window as long as the test: what is checked is the line, not its duration
    env = {"TANDEM_BROKER_WATCH_INTERVAL_S": 0.5, "TANDEM_BROKER_RECOVERY_LOG_S": 3600}
    stack = Stack(own_broker.bootstrap, tiny_model_dir("llama"), tmp_path, "brs", **env)
    try:
        stack.start(("w0",))
        prompt = chat_body("broker and scheduler together", max_tokens=8)
        reference = httpx.post(f"{stack.url}/v1/chat/completions", json=prompt, timeout=300).json()
        reference_text = reference["choices"][0]["message"]["content"]

        stack.kill("scheduler")  # a successor at term 2 serves a request: the worker's floor is 2
        stack.scheduler("scheduler-2")
        stack.wait_log("scheduler-2", "scheduler active (term 2)")
        assert _served(stack, prompt) == reference_text

        stack.kill("scheduler-2")
        own_broker.restart()
        _restart_seen_by(stack, "gateway", "w0")
        stack.scheduler("scheduler-3")
        stack.wait_log("scheduler-3", "scheduler active (term 1)")  # the lease history began again
        assert _served(stack, prompt) == reference_text
        assert "stale scheduler term" not in (tmp_path / "w0.log").read_text()
        # For a minute after a restart the gateway names each request it submits at INFO (the
        # stack runs at INFO; in steady state that line is DEBUG), so a slow one can be followed.
        gateway_log = (tmp_path / "gateway.log").read_text()
        assert any("INFO" in ln and "submitted attempt 0" in ln for ln in gateway_log.splitlines())
        # ... and the worker each dispatch it reads, with its partition and offset (the scheduler
        # where it placed it: test_stack_survives_a_broker_restart): a request lost after a
        # restart shows which side lost it.
        worker_log = (tmp_path / "w0.log").read_text()
        assert any("INFO" in ln and "dispatch received (brs.dispatch.w0[0]@" in ln for ln in worker_log.splitlines())
    finally:
        stack.stop()


def test_a_scheduler_started_after_a_restart_ignores_commits_from_the_old_broker(own_broker, tiny_model_dir, tmp_path):
    """The `tandem chaos --ha --faults broker` stall: a request-offset commit in flight when the
    broker died is retried by aiokafka until the restarted broker has the topics again, and lands
    there with the old broker's offsets. The next scheduler to take over (the standby, or one
    started after the active died) started its request consumer at those offsets, past the end of
    the new topics, and tansu serves nothing there: no request was placed for minutes. The stale
    commit is made here by hand, as the retry makes it, between the restart and the successor's
    start; the successor must serve a request sent after it."""
    stack = Stack(own_broker.bootstrap, tiny_model_dir("llama"), tmp_path, "brc")
    try:
        stack.start(("w0",))
        prompt = chat_body("offsets from an old broker", max_tokens=8)
        reference_text = _served(stack, prompt)

        stack.kill("scheduler")  # the active dies with the broker
        own_broker.restart()
        _restart_seen_by(stack, "gateway", "w0")
        asyncio.run(_commit_old_offsets(own_broker.bootstrap, Topics("brc"), offset=50))
        stack.scheduler("scheduler-2")
        stack.wait_log("scheduler-2", "scheduler active (term 1)")
        assert _served(stack, prompt) == reference_text
        assert "past the partition's end" in (tmp_path / "scheduler-2.log").read_text()
    finally:
        stack.stop()


async def _commit_old_offsets(bootstrap: str, topics: Topics, offset: int) -> None:
    """What aiokafka's retried commit does once the restarted broker has the topics: the
    scheduler group's offsets from the old broker, on every request partition of the new one."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix), "old-commit")
    await kafka.start([topics.rt_requests, topics.be_requests])
    try:
        c = await kafka.consumer(group="tandem-scheduler", subscribe=False)
        tps = [TopicPartition(t.name, p) for t in (topics.rt_requests, topics.be_requests) for p in range(t.partitions)]
        c.assign(tps)
        await c.commit(dict.fromkeys(tps, offset))
    finally:
        await kafka.stop()


def _served(stack: Stack, body: dict) -> str:
    """The answer's text, once the gateway and the scheduler count the worker; a 503 (tansu
    refusing a produce right after its restart) is retried as a client would, after its
    Retry-After, at most 10 times."""
    stack.wait_workers(1)
    for _ in range(10):
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
        if r.status_code != 503:
            break
        time.sleep(float(r.headers.get("Retry-After", "1")))  # the server's own back-off
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_watch_recreates_short_topics_and_sees_a_restart_another_service_repaired(own_broker):
    """The watch alone: after a restart, tansu's auto-created 4-partition `results` is replaced
    by the catalogue's 8, and its auto-created 4-partition `leases` by the catalogue's 1 (a
    role's lease records went to a partition no reader reads: the `tandem chaos --ha` stall);
    a second watch that looks only after the first repaired everything still notices the
    restart (its marker is gone)."""
    asyncio.run(_two_watches(own_broker))


async def _two_watches(broker: RestartableBroker) -> None:
    topics = Topics("watch-only")
    settings = ServiceSettings(kafka_bootstrap=broker.bootstrap)
    seen: dict[str, list] = {"a": [], "b": []}
    clients, watches = [], []
    for name in ("a", "b"):
        kafka = KafkaClient(settings, f"watch-{name}")
        await kafka.start([topics.results, topics.control, topics.leases])

        async def on_restart(restart, name=name):
            seen[name].append(restart)

        watch = BrokerWatch(kafka, topics.prefix, on_restart)
        await watch.start(background=False)  # checked by hand here
        clients.append(kafka)
        watches.append(watch)
    try:
        assert await watches[0].check() is None  # nothing happened yet
        broker.restart()
        # What any client does before anyone repairs: a metadata request that names a topic
        # makes tansu auto-create it, with its default 4 partitions.
        assert await _auto_create(broker.bootstrap, topics.results.name) == 4
        assert await _auto_create(broker.bootstrap, topics.leases.name) == 4
        first = await _check_until_repaired(watches[0])
        assert topics.results.name in first.recreated and topics.leases.name in first.recreated
        counts = await watches[0].partition_counts()
        assert (counts[topics.results.name], counts[topics.leases.name]) == (8, 1)
        second = await _check_until_repaired(watches[1])
        assert second.recreated == () and any("marker" in r for r in second.reasons)
        await clients[1].send(topics.results.name, None, key="k", partition=7)  # metadata refreshed: 8 partitions
        assert await watches[0].check() is None and await watches[1].check() is None
        assert (len(seen["a"]), len(seen["b"])) == (1, 1)
    finally:
        for w in watches:
            await w.stop()
        for c in clients:
            await c.stop()


def test_watch_notices_a_restart_by_its_connection_without_polling(own_broker):
    """The watch in the background with no periodic check to speak of (an hour): the restart is
    seen because its idle connection to the broker closed, repaired once the new broker answers,
    and the service is told. Before the restart it sent no check at all."""
    asyncio.run(_watch_in_background(own_broker))


async def _watch_in_background(broker: RestartableBroker) -> None:
    topics = Topics("watch-bg")
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=broker.bootstrap), "watch-bg")
    await kafka.start([topics.results, topics.control])
    told = asyncio.Event()

    async def on_restart(restart):
        told.set()

    watch = BrokerWatch(kafka, topics.prefix, on_restart, interval_s=3600)
    await watch.start()
    try:
        # A round trip on the broker, so the watch's task has run up to its connection wait.
        await kafka.send(topics.control.name, None, key="k")
        assert watch.checks == 0
        broker.restart()
        await asyncio.wait_for(told.wait(), 120)  # a safety net only: the connection drop is immediate
        assert watch.restarts == 1
        assert (await watch.partition_counts())[topics.results.name] == topics.results.partitions
    finally:
        await watch.stop()
        await kafka.stop()


async def _auto_create(bootstrap: str, topic: str) -> int:
    """A metadata request naming `topic`, as every reader of it sends after the restart (tansu
    then auto-creates it); returns the partitions it came back with."""
    for _ in range(100):
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            await admin.start()
            described = await admin.describe_topics([topic])
            if described and described[0]["partitions"]:
                return len(described[0]["partitions"])
        except Exception:  # noqa: BLE001 (still starting)
            pass
        finally:
            await admin.close()
        await asyncio.sleep(0.1)
    raise AssertionError("the restarted broker never answered")


async def _check_until_repaired(watch: BrokerWatch):
    """Check until the restarted broker answers and the watch has repaired it."""
    for _ in range(100):
        try:
            restart = await watch.check()
        except Exception:  # noqa: BLE001 (still starting)
            await watch.close_admin()
            continue
        if restart is not None:
            return restart
    raise AssertionError("the restart was never noticed")


def test_a_remembered_topic_that_does_not_exist_is_no_restart(own_broker):
    """The scheduler remembers `dispatch.<worker>` when a worker's first heartbeat arrives, and
    that topic may not exist (yet, or any more): a check must not read that as a restart (which
    dropped the scheduler's pending requests and rewound its consumers over old heartbeats). A
    real restart is still seen (the marker is gone), and its repair creates the remembered topic."""
    asyncio.run(_remembered_missing_topic(own_broker))


async def _remembered_missing_topic(broker: RestartableBroker) -> None:
    topics = Topics("watch-remembered")
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=broker.bootstrap), "watch-remembered")
    await kafka.start([topics.control])
    told: list = []

    async def on_restart(restart):
        told.append(restart)

    watch = BrokerWatch(kafka, topics.prefix, on_restart)
    await watch.start(background=False)  # checked by hand here
    try:
        never_started = topics.dispatch("never-started")
        kafka.remember(never_started)
        assert never_started.name not in await watch.partition_counts()
        assert await watch.check() is None and told == []
        broker.restart()
        restart = await _check_until_repaired(watch)
        assert any("marker" in r for r in restart.reasons), restart.reasons
        assert (await watch.partition_counts())[never_started.name] == never_started.partitions
        assert await watch.check() is None and len(told) == 1
    finally:
        await watch.stop()
        await kafka.stop()
