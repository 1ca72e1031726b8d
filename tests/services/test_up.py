"""`tandem up`: one command starts broker, scheduler, worker and gateway; Ctrl-C stops them; a
crashed child is reported, not silently restarted."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from services.broker import free_port

pytestmark = pytest.mark.timeout(300)


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
        env={**_env(), **(env or {})},
    )
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


def _batch_completes(url: str, model: str) -> None:
    """`up` runs the queue service: a small batch job goes through."""
    import json

    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": model, "prompt": "hi", "max_tokens": 2},
    }
    f = httpx.post(f"{url}/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", json.dumps(line))}).json()
    batch = httpx.post(
        f"{url}/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    ).json()
    deadline = time.monotonic() + 60
    while batch["status"] != "completed" and time.monotonic() < deadline:
        time.sleep(0.3)
        batch = httpx.get(f"{url}/batches/{batch['id']}").json()
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
