"""`tandem up`: one command starts broker, scheduler, worker and gateway; Ctrl-C stops them; a
crashed child is reported, not silently restarted; a killed `up`, or a dead process that started
it, leaves nothing running. The HA pairs (`up --ha`) are tests/services/test_up_ha.py; starting
and stopping `up` is tests/services/up_stack.py."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import psutil

from services.broker import free_port
from tests.services.stack import START_TIMEOUT_S
from tests.services.up_stack import (  # noqa: F401 (stop_started_stacks: the autouse fixture)
    DEFAULT_FLAGS,
    HTTP_TIMEOUT_S,
    UP_STOP_TIMEOUT_S,
    batch_completes,
    gone,
    lost_its_port,
    served_model,
    start_up,
    stop_started_stacks,
    up_env,
)

# No module-wide timeout: pytest's 600 s default holds a start (its own 300 s safety net) and
# the test.


def test_up_serves_and_stops_cleanly(tiny_model_dir):
    up = start_up(tiny_model_dir("llama"))
    children = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(children) >= 6  # broker, scheduler, advisory, worker, queue, gateway
    name = served_model(up.url)  # the model directory's name
    r = httpx.post(
        f"{up.url}/v1/completions",
        timeout=HTTP_TIMEOUT_S,
        json={"model": name, "prompt": "hi", "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    prefixes = {ln.split("|")[0].strip() for ln in list(up.lines) if "|" in ln}
    assert {"broker", "scheduler", "advisory", "worker-0", "queue", "gateway", "up"} <= prefixes
    batch_completes(f"{up.url}/v1", r.json()["model"])
    assert up.stop() == 0
    assert not gone(children, 60)  # every child had exited when `up` did: this only reads them


def test_up_reports_a_crashed_child_and_exits_nonzero(tiny_model_dir):
    up = start_up(tiny_model_dir("llama"))
    worker = next(c for c in psutil.Process(up.proc.pid).children() if "worker" in " ".join(c.cmdline()))
    worker.kill()
    assert up.wait_exit() == 1
    assert "worker-0 exited unexpectedly with code -9" in up.output()


def test_up_without_flags_decides_the_dtype_for_this_cpu(tiny_model_dir):
    """No --dtype: the worker decides (bfloat16 with native bf16, float32 elsewhere; on an AVX2
    host, real or emulated, bf16 once crashed the worker at start) and says so in /v1/models."""
    from kernels.cpu_caps import resolve_dtype

    up = start_up(tiny_model_dir("llama"), (), env={"TANDEM_KV_CACHE_GIB": "0.05"})
    model = httpx.get(f"{up.url}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]
    assert model["dtype"] == resolve_dtype("auto", "cpu")[0] and model["device"] == "cpu", up.output()
    r = httpx.post(
        f"{up.url}/v1/completions",
        timeout=HTTP_TIMEOUT_S,
        json={"model": model["id"], "prompt": "hi", "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text


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


def test_a_killed_up_takes_its_whole_stack_with_it(tiny_model_dir):
    """SIGKILL gives `up` no chance to stop anything: each child notices its parent died (the
    kernel's parent-death signal, or the parent-pid watch) and stops itself, the broker too."""
    up = start_up(tiny_model_dir("llama"))
    children = psutil.Process(up.proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert "tansu" in names and "worker" in names and "gateway" in names, names
    up.proc.kill()
    up.proc.wait(timeout=60)
    # The children's clean stops (a worker saving its sessions) take seconds; the bound only
    # turns a child that never notices into a failure.
    left = gone(children, UP_STOP_TIMEOUT_S)
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
    for attempt in range(3):  # a start that lost its port goes again on another (up_stack.py)
        log_path = tmp_path / f"up-{attempt}.log"
        argv = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model_dir("llama"))]
        argv += [*DEFAULT_FLAGS, "--port", str(free_port())]
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT, str(log_path), *argv], stdout=subprocess.PIPE, text=True, env=up_env()
        )
        try:
            up = psutil.Process(int(parent.stdout.readline()))
            deadline = time.monotonic() + START_TIMEOUT_S
            while "ready: http://" not in log_path.read_text():
                if not up.is_running() and lost_its_port(log_path.read_text()) and attempt < 2:
                    break
                assert time.monotonic() < deadline and up.is_running(), log_path.read_text()[-3000:]
                time.sleep(0.2)
            else:
                stack = [up, *up.children(recursive=True)]
                names = " ".join(" ".join(p.cmdline()) for p in stack)
                assert "tansu" in names and "worker" in names and "gateway" in names, names
                parent.kill()
                parent.wait(timeout=60)
                left = gone(stack, UP_STOP_TIMEOUT_S)  # a safety net: the clean stops take seconds
                assert not left, [" ".join(p.cmdline()) for p in left]
                assert "shutting down" in log_path.read_text()  # up's own clean stop, not its children's lifelines
                return
        finally:
            parent.kill()
            parent.wait()
