"""Nothing outlives its parent (issue 22 part B): a benchmark that starts a stack and is stopped
by SIGTERM (`timeout`) or killed outright leaves no process behind, and the portable parent-pid
watch works without the kernel's parent-death signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.timeout(400)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """Command lines of the processes still running (not zombies) once all exited or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(p.cmdline()))
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _gateway_url(bench: subprocess.Popen, timeout_s: float = 300.0) -> str:
    """The URL of the bench's stack once its gateway answers /health (the stack is complete)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert bench.poll() is None, f"the benchmark exited early with {bench.returncode}"
        for p in _descendants(bench.pid):
            try:
                argv = p.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "gateway" in argv and "--port" in argv:
                url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
        time.sleep(0.3)
    raise AssertionError("the benchmark's stack did not become ready")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_benchmark_leaves_no_stack_behind(tiny_model_dir, tmp_path, sig):
    """`tandem bench gateway` runs its sustained phase against a `tandem up` stack; SIGTERM (what
    `timeout` sends) unwinds it like Ctrl-C, SIGKILL leaves it to `up` to notice its dead parent.
    Either way broker, scheduler, advisory, worker, queue and gateway all exit."""
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path)}
    env.pop("KAFKA_BOOTSTRAP", None)
    bench = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "bench", "gateway", "--model", str(tiny_model_dir("llama"))]
        + ["--requests", "1", "--max-tokens", "2", "--concurrency", "1", "--rate-seconds", "3600"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _gateway_url(bench)
        stack = _descendants(bench.pid)
        assert len(stack) >= 7, stack  # `up`, broker, scheduler, advisory, worker, queue, gateway
        bench.send_signal(sig)
        rc = bench.wait(timeout=120)
        left = _wait_gone(stack, 120)
        assert not left, left
        if sig == signal.SIGTERM:  # unwound (the stack stopped by the bench itself), not killed
            assert rc == 128 + signal.SIGTERM, bench.stderr.read()[-3000:]
    finally:
        for p in [bench, *_descendants(bench.pid)]:
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass


def test_the_parent_pid_watch_notices_a_dead_parent_without_the_kernel_signal(tmp_path):
    """Hosts without `PR_SET_PDEATHSIG` rely on `watch_parent`: a grandchild that only watches
    (no kernel signal armed) exits once its parent is SIGKILLed."""
    grandchild = textwrap.dedent(
        """
        import os
        from services.lifeline import watch_parent
        parent = os.getppid()  # read before the pid is printed: the test kills the parent after that
        print(os.getpid(), flush=True)
        watch_parent(parent, lambda: print("lost", flush=True))
        """
    )
    parent = textwrap.dedent(
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {grandchild!r}])
        time.sleep(3600)
        """
    )
    middle = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    child_pid = int(middle.stdout.readline())
    child = psutil.Process(child_pid)
    assert child.ppid() == middle.pid
    middle.kill()
    middle.wait(timeout=10)
    assert middle.stdout.readline().strip() == "lost"  # the grandchild's own report, then its exit
    assert not _wait_gone([child], 120)
