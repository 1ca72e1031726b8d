"""`tandem up` as the `test_up*` modules start it: a subprocess whose output a thread collects,
returned once `up` says it is ready, stopped after each test whatever ended it.

Load-proof by the rules of tests/services/conftest.py: every wait ends on its event (the ready
line, a batch's status, processes gone) and fails at once when `up` exited; the bounds are safety
nets sized for a starved host. A start that lost its port (the gateway's `--port`, or the broker's
port `up` itself chose, taken by another listener between the probe and the bind: the machine, not
the code under test) is started again on a fresh port, at most twice, as `Stack` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from services import lifeline
from services.broker import free_port
from tests.services.stack import START_TIMEOUT_S

# A clean stop of a whole `up` stack: children stopped one after the other in reverse order, a
# worker draining for up to 10 s, each child killed by `up` after 15 s; the rest is margin for a
# starved host.
UP_STOP_TIMEOUT_S = 180.0
# Requests and batch polls against `up`'s gateway: one answer may wait behind a starved worker.
HTTP_TIMEOUT_S = 60.0
DEFAULT_FLAGS = ("--dtype", "float32", "--kv-cache-gib", "0.05")
LOST_PORT = "address already in use"  # uvicorn's and tansu's words for a bind that failed, lowercased

# Every `up` started: stopped after each test whatever ended it, a KeyboardInterrupt included
# (pytest tears fixtures down on the way out), and tied to the test process (`lifeline.tied_env`),
# so even a test process that dies outright leaves no stack running (an interrupted run once left
# one re-parented to PID 1 for over a minute, session 8).
_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def stop_started_stacks():
    """Imported by each `test_up*` module (autouse there): SIGINT, `up`'s clean stop, to every
    `up` the test started and left running; a kill after UP_STOP_TIMEOUT_S."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # up's clean stop, children in reverse order
            try:
                proc.wait(timeout=UP_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class UpRun:
    """A running `up`: its process, the gateway's port, and every line it printed so far (a
    thread appends them for the process's whole life)."""

    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self, tail: int | None = None) -> str:
        lines = list(self.lines)
        return "".join(lines if tail is None else lines[-tail:])

    def wait_exit(self, timeout_s: float = UP_STOP_TIMEOUT_S) -> int:
        """`up`'s exit code once it exited and its last lines were read."""
        rc = self.proc.wait(timeout=timeout_s)
        if self.reader is not None:
            self.reader.join(timeout=60)
        return rc

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.wait_exit()


def up_env() -> dict:
    env = dict(os.environ)
    env.pop("KAFKA_BOOTSTRAP", None)  # `up` must start its own broker
    env["TANDEM_DATA_DIR"] = tempfile.mkdtemp(prefix="tandem-up-")  # the batch store, not the user's
    return env


def lost_its_port(output: str) -> bool:
    return LOST_PORT in output.lower()


def start_up(model_dir: Path, flags: tuple[str, ...] = DEFAULT_FLAGS, env: dict | None = None) -> UpRun:
    """`tandem up --model model_dir *flags` on a free port, once it printed its ready line."""
    for attempt in range(3):
        run = _spawn(model_dir, free_port(), flags, env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any("ready: http://" in ln for ln in list(run.lines)):
                return run
            if run.proc.poll() is not None:
                break
            time.sleep(0.2)
        else:
            run.proc.kill()
            raise AssertionError(f"tandem up not ready within {START_TIMEOUT_S:.0f}s:\n{run.output(tail=60)}")
        run.wait_exit(60)
        if not (lost_its_port(run.output()) and attempt < 2):
            raise AssertionError(f"tandem up exited with {run.proc.returncode} before ready:\n{run.output(tail=60)}")
    raise AssertionError("unreachable")


def _spawn(model_dir: Path, port: int, flags: tuple[str, ...], env: dict | None) -> UpRun:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), *flags, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=lifeline.tied_env({**up_env(), **(env or {})}),
    )
    _STARTED.append(proc)
    run = UpRun(proc, port)
    run.reader = threading.Thread(target=lambda: run.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    run.reader.start()
    return run


def submit_batch(url: str, model: str, n: int = 1, max_tokens: int = 2) -> str:
    """A batch job of `n` completions through the gateway; returns its id."""
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
    f = httpx.post(
        f"{url}/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", body)}, timeout=HTTP_TIMEOUT_S
    ).json()
    batch = httpx.post(
        f"{url}/batches",
        json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
        timeout=HTTP_TIMEOUT_S,
    ).json()
    return batch["id"]


def wait_batch(url: str, batch_id: str, done: int | None = None, timeout_s: float = 300) -> dict:
    """The batch once `done` items completed (None: once final); `timeout_s` is a safety net."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = httpx.get(f"{url}/batches/{batch_id}", timeout=HTTP_TIMEOUT_S).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        if done is not None and batch["request_counts"]["completed"] >= done:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)


def batch_completes(url: str, model: str) -> None:
    """`up` runs the queue service: a small batch job goes through."""
    batch = wait_batch(url, submit_batch(url, model))
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1, batch


def served_model(url: str) -> str:
    """The id `up`'s gateway serves its model under (the model directory's name)."""
    return httpx.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"]


def gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
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
