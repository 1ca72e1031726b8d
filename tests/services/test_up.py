"""`tandem up`: one command starts broker, scheduler, worker and gateway; Ctrl-C stops them; a
crashed child is reported, not silently restarted."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from services import lifeline
from services.broker import free_port
from shared.kafka import KafkaClient
from shared.schemas.lease import LeaseRecord
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import LEASE_S

pytestmark = pytest.mark.timeout(300)

# Every `up` this module started: stopped after each test whatever ended it, a KeyboardInterrupt
# included (pytest tears fixtures down on the way out), and tied to the test process
# (`lifeline.tied_env`), so even a test process that dies outright leaves no stack running
# (an interrupted run once left one re-parented to PID 1 for over a minute, session 8).
_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_started_stacks():
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # up's clean stop, children in reverse order
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start(
    model_dir,
    port: int,
    flags: tuple[str, ...] = ("--dtype", "float32", "--kv-cache-gib", "0.05"),
    env: dict | None = None,
) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), *flags, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=lifeline.tied_env({**_env(), **(env or {})}),
    )
    _STARTED.append(proc)
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "ready: http://" in line:
            return proc, lines
    proc.kill()
    raise AssertionError("tandem up did not become ready:\n" + "".join(lines[-40:]))


def _env() -> dict:
    import os
    import tempfile

    env = dict(os.environ)
    env.pop("KAFKA_BOOTSTRAP", None)  # `up` must start its own broker
    env["TANDEM_DATA_DIR"] = tempfile.mkdtemp(prefix="tandem-up-")  # the batch store, not the user's
    return env


def _submit_batch(url: str, model: str, n: int = 1, max_tokens: int = 2) -> str:
    """A batch job of `n` completions through the gateway; returns its id."""
    import json

    lines = [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": f"item {i}", "max_tokens": max_tokens},
        }
        for i in range(n)
    ]
    body = "\n".join(json.dumps(ln) for ln in lines)
    f = httpx.post(f"{url}/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", body)}).json()
    batch = httpx.post(
        f"{url}/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    ).json()
    return batch["id"]


def _wait_batch(url: str, batch_id: str, done: int | None = None, timeout_s: float = 60) -> dict:
    """The batch once `done` items completed (None: once final); `timeout_s` is a safety net."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = httpx.get(f"{url}/batches/{batch_id}", timeout=30).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        if done is not None and batch["request_counts"]["completed"] >= done:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)


def _batch_completes(url: str, model: str) -> None:
    """`up` runs the queue service: a small batch job goes through."""
    batch = _wait_batch(url, _submit_batch(url, model))
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1, batch


def test_up_serves_and_stops_cleanly(tiny_model_dir):
    port = free_port()
    proc, lines = _start(tiny_model_dir("llama"), port)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 6  # broker, scheduler, advisory, worker, queue, gateway
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=60,
        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3, "temperature": 0},
    )
    if r.status_code == 404:  # the served name is the model directory's name
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": name, "prompt": "hi", "max_tokens": 3, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    prefixes = {ln.split("|")[0].strip() for ln in lines if "|" in ln}
    assert {"broker", "scheduler", "advisory", "worker-0", "queue", "gateway", "up"} <= prefixes
    _batch_completes(f"http://127.0.0.1:{port}/v1", r.json()["model"])
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_up_reports_a_crashed_child_and_exits_nonzero(tiny_model_dir):
    port = free_port()
    proc, _ = _start(tiny_model_dir("llama"), port)
    worker = next(c for c in psutil.Process(proc.pid).children() if "worker" in " ".join(c.cmdline()))
    worker.kill()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "worker-0 exited unexpectedly with code -9" in out


def test_up_without_flags_decides_the_dtype_for_this_cpu(tiny_model_dir):
    """No --dtype: the worker decides (bfloat16 with native bf16, float32 elsewhere; on an AVX2
    host, real or emulated, bf16 once crashed the worker at start) and says so in /v1/models."""
    from kernels.cpu_caps import resolve_dtype

    port = free_port()
    proc, lines = _start(tiny_model_dir("llama"), port, (), env={"TANDEM_KV_CACHE_GIB": "0.05"})
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        assert model["dtype"] == resolve_dtype("auto", "cpu")[0] and model["device"] == "cpu", "".join(lines)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": model["id"], "prompt": "hi", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def test_up_passes_only_given_worker_flags_so_the_environment_counts(monkeypatch):
    """`tandem up` used to pass its own defaults (--dtype bfloat16, ...) to every worker, which
    overrode TANDEM_DTYPE and friends. Now a worker flag appears only when given."""
    import argparse

    from services import up

    monkeypatch.setenv("TANDEM_NUM_THREADS", "1")
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    plan = up._Up(parser.parse_args(["up", "--workers", "2"]))
    plan._plan()
    workers = [c.argv for c in plan.children if c.name.startswith("worker-")]
    assert len(workers) == 2
    for argv in workers:
        assert not {"--dtype", "--model", "--device", "--kv-cache-gib", "--policy", "--num-threads"} & set(argv)
    plan = up._Up(parser.parse_args(["up", "--dtype", "float32", "--policy", "bros"]))
    plan._plan()
    argv = next(c.argv for c in plan.children if c.name == "worker-0")
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--policy") + 1] == "bros"


def _gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Waits until every process in `procs` has exited (a zombie counts: it runs nothing); returns
    the ones still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_a_killed_up_takes_its_whole_stack_with_it(tiny_model_dir):
    """SIGKILL gives `up` no chance to stop anything: each child notices its parent died (the
    kernel's parent-death signal, or the parent-pid watch) and stops itself, the broker too."""
    port = free_port()
    proc, _ = _start(tiny_model_dir("llama"), port)
    children = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert "tansu" in names and "worker" in names and "gateway" in names, names
    proc.kill()
    proc.wait(timeout=10)
    # The children's clean stops (a worker saving its sessions) take seconds; 120 s only turns
    # a child that never notices into a failure.
    left = _gone(children, 120)
    assert not left, [" ".join(p.cmdline()) for p in left]


_PARENT = """
import os, subprocess, sys
from services import lifeline
with open(sys.argv[1], "w") as log:
    up = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT, env=lifeline.tied_env(dict(os.environ)))
    print(up.pid, flush=True)
    up.wait()
"""


def test_up_stops_its_stack_when_the_process_that_started_it_dies(tiny_model_dir, tmp_path):
    """A parent that is not a shell session (a test run, a benchmark) starts `up` tied to itself
    (`TANDEM_PARENT_PID`) and dies without a word (SIGKILL: no Ctrl-C reaches `up`). `up` notices
    (the kernel's parent-death signal, or its re-parenting), takes its clean stop and every child
    of the stack exits; a `make up` stack is not tied and keeps running (docs/reliability.md)."""
    port = free_port()
    log_path = tmp_path / "up.log"
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir("llama"))]
    argv += ["--dtype", "float32", "--kv-cache-gib", "0.05", "--port", str(port)]
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(log_path), *argv], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        up = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 180
        while "ready: http://" not in log_path.read_text():
            assert time.monotonic() < deadline and up.is_running(), log_path.read_text()[-3000:]
            time.sleep(0.2)
        stack = [up, *up.children(recursive=True)]
        names = " ".join(" ".join(p.cmdline()) for p in stack)
        assert "tansu" in names and "worker" in names and "gateway" in names, names
        parent.kill()
        parent.wait(timeout=10)
        left = _gone(stack, 120)  # a safety net: the clean stops take seconds
        assert not left, [" ".join(p.cmdline()) for p in left]
        assert "shutting down" in log_path.read_text()  # up's own clean stop, not its children's lifelines
    finally:
        parent.kill()
        parent.wait()


def _status(lines: list[str], prefix: str = "tandem", broker: str | None = None) -> dict:
    """`tandem status --json` against the broker `up` started (its address is in `up`'s log), or
    against `broker`."""
    import json
    import os

    if broker is None:
        broker = next(ln.split("embedded broker on ")[1].split()[0] for ln in lines if "embedded broker on " in ln)
    env = {**os.environ, "KAFKA_BOOTSTRAP": broker, "TANDEM_TOPIC_PREFIX": prefix, "TANDEM_LEASE_S": str(LEASE_S)}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _instances(status: dict, role: str) -> dict[str, str]:
    """Instance name (the service id, without pid and start time) -> state, for one role."""
    pair = next((p for p in status["pairs"] if p["role"] == role), {"instances": []})
    return {i["instance"].split("/")[0]: i["state"] for i in pair["instances"]}


def _wait_pairs(lines: list[str], broker: str | None = None) -> dict[str, dict[str, str]]:
    """Until `tandem status` shows each of the three pairs with one instance active and the other
    standing by (each standby announces itself within a lease); returns the pairs."""
    pairs = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = _status(lines, broker=broker)
        pairs = {role: _instances(status, role) for role in ("scheduler", "advisory", "queue")}
        if all(sorted(p.values()) == ["active", "standby"] for p in pairs.values()):
            return pairs
        time.sleep(0.5)
    raise AssertionError(f"not one active and one standby per pair: {pairs}")


def test_up_ha_reports_a_dead_scheduler_and_keeps_serving(tiny_model_dir):
    """`up --ha`: two of scheduler, advisory and queue. SIGKILL the active scheduler: `up` says so
    and keeps running, the standby takes over, requests are served, `tandem status` shows the
    dead instance silent and the other active."""
    import threading

    port = free_port()
    flags = ("--dtype", "float32", "--kv-cache-gib", "0.05", "--ha")
    proc, lines = _start(tiny_model_dir("llama"), port, flags, env={"TANDEM_LEASE_S": str(LEASE_S)})
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        model = httpx.get(f"{url}/models").json()["data"][0]["id"]
        pairs = _wait_pairs(lines)
        active = next(name for name, state in pairs["scheduler"].items() if state == "active")
        other = next(name for name in pairs["scheduler"] if name != active)
        victim = next(
            c for c in psutil.Process(proc.pid).children() if c.environ().get("TANDEM_SCHEDULER_ID") == active
        )
        victim.kill()
        for i in range(3):  # placed by the standby once it holds the lease
            r = httpx.post(
                f"{url}/completions",
                timeout=120,
                json={"model": model, "prompt": f"after {i}", "max_tokens": 3, "temperature": 0},
            )
            assert r.status_code == 200, r.text
        assert proc.poll() is None, "".join(lines[-40:])
        assert any(f"{active} died (code -9); {other} serves as the scheduler" in ln for ln in lines)
        deadline = time.monotonic() + 60  # silent: no record for two leases
        while _instances(_status(lines), "scheduler") != {active: "silent", other: "active"}:
            assert time.monotonic() < deadline, _status(lines)["pairs"]
            time.sleep(0.5)
        _batch_completes(url, model)  # the queue pair still serves batches
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@pytest.mark.timeout(900)
def test_up_ha_pairs_survive_a_broker_restart(tiny_model_dir):
    """`up --ha` on a broker that restarts with its data gone (tansu in memory: `leases` comes
    back empty) while a batch job runs. A standby used to start its broker watch only once
    active, so its lease reader kept its old position, above the new `leases` topic's end: it
    read nothing more, claimed the next term every second without ever reading its claim back,
    and the active read that claim and exited deposed, so no queue was active again (`tandem
    chaos --ha`). Now every instance repairs and rewinds, the batch completes with every item,
    and each pair has one active and one standby again."""
    import threading

    from tests.services.test_broker_restart import RestartableBroker

    broker = RestartableBroker()
    port = free_port()
    flags = ("--dtype", "float32", "--kv-cache-gib", "0.05", "--ha")
    env = {"TANDEM_LEASE_S": str(LEASE_S), "KAFKA_BOOTSTRAP": broker.bootstrap}
    proc, lines = _start(tiny_model_dir("llama"), port, flags, env=env)
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        model = httpx.get(f"{url}/models").json()["data"][0]["id"]
        _wait_pairs(lines, broker.bootstrap)
        asyncio.run(_lease_history(broker.bootstrap, 3000))
        batch_id = _submit_batch(url, model, n=24, max_tokens=16)
        _wait_batch(url, batch_id, done=1, timeout_s=240)
        broker.restart()
        # Needs an active queue and scheduler: a stuck standby deposed the active (safety net only).
        try:
            batch = _wait_batch(url, batch_id, timeout_s=300)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{''.join(lines[-200:])}") from None
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}, batch
        # Every instance, standbys included, saw the restart and repaired (the watch's line).
        for name in ("scheduler-a", "scheduler-b", "queue-a", "queue-b", "advisory-a", "advisory-b"):
            _wait_line(lines, f"{name:<10}| ", "broker restarted (", proc)
        _wait_pairs(lines, broker.bootstrap)
        assert proc.poll() is None, "".join(lines[-40:])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        broker.kill()


async def _lease_history(bootstrap: str, n: int) -> None:
    """`n` records of another role on `leases`, as hours of renewals leave there: a reader whose
    position is kept from the old broker then sits far above the new topic's end (the chaos run
    that found the defect had been up for minutes; this short stack would outgrow its position
    within a minute and hide it)."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "test-lease-history")
    await kafka.start()
    record = LeaseRecord(role="history", holder="test", term=1, state="standby", sent_at=time.time())
    try:
        acks = [await kafka.send_nowait(Topics("tandem").leases.name, record, key="history") for _ in range(n)]
        await asyncio.gather(*acks)
    finally:
        await kafka.stop()


def _wait_line(lines: list[str], prefix: str, text: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until `up` printed a line of one child (`prefix`) holding `text`; fails at once if `up` exited."""
    deadline = time.monotonic() + timeout_s
    while not any(ln.startswith(prefix) and text in ln for ln in list(lines)):
        assert proc.poll() is None and time.monotonic() < deadline, f"{prefix}{text!r}:\n" + "".join(lines[-40:])
        time.sleep(0.1)
