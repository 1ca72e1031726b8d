"""`tandem bench sessions` stops on the first SIGTERM, with its stack (a real process tree).

Session 9 stopped a grid with SIGTERM while the bench waited for the next stack's gateway: the
signal was swallowed and a second one was needed. Here a real bench process (tiny model, one
short cell) gets one SIGTERM while it waits for its stack's gateway; it must exit 143 and leave
no `tandem up` behind. The in-process test of the mechanism (a callback that catches everything)
is in test_bench_sessions.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(c) for c in task.read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc")
def test_one_sigterm_while_waiting_for_the_gateway_stops_the_bench_and_its_stack(tmp_path):
    argv = [sys.executable, "-m", "services.cli", "bench", "sessions", "--model", "tiny", "--modes", "recompute"]
    argv += ["--users", "2", "--duration", "5", "--log-dir", str(tmp_path), "--json", str(tmp_path / "out.json")]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the stack's log is opened just before `tandem up` starts: then the bench waits for it
        deadline = time.monotonic() + 180
        stack: list[int] = []
        while not stack and time.monotonic() < deadline and bench.poll() is None:
            if list(tmp_path.glob("sessions-*.log")):
                stack = _children(bench.pid)
            time.sleep(0.05)
        assert stack, "the bench never started its stack"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 60  # the stack's own shutdown may finish just after
        while any(_alive(p) for p in stack) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in stack)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
