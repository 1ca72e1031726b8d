"""The test stack itself: the tansu broker's topics under one prefix, and scheduler, workers,
gateways, advisory and queue as separate processes (`python -m services.cli ...`), with the waits
a test needs (every one ends on its event; the bounds are safety nets) and clean stops.

`tests/services/conftest.py` builds these per module (`make_stack`) and re-exports the names
tests import from it; this module holds the class so the conftest stays small.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services import lifeline
from services.broker import free_port
from services.scheduler.registry import LOST_BUT_ALIVE

# Heartbeat timing of test stacks. Heartbeats come at twice the production rate, so that a new
# worker is seen quickly. A worker is declared lost after WORKER_TIMEOUT_S of silence, which must
# exceed the longest silence of a live but CPU-starved worker by a wide margin: a worker declared
# lost loses its running requests and rejoins at a new epoch (docs/services.md, "Testing under load").
# Measured on the 2-core development machine at load 16 (other suites and a `yes` loop beside):
# the longest gap between two heartbeats of a live worker, as the scheduler or a gateway heard
# them, was 1.1 s; the 1.5 s this used to be left no margin. The price of a long
# timeout is paid only by tests that kill a worker and wait for its loss, once each. The
# scheduler's grace for a dispatch its worker does not report yet gets the same margin.
HEARTBEAT_INTERVAL_S = 0.25
WORKER_TIMEOUT_S = 6.0
# The lease of HA pairs in test stacks (shared/lease.py): like the worker timeout, it must exceed
# the longest starvation of a live process. 2 s deposed a healthy active scheduler once at load
# average 19 (its standby read no renewal for 2 s while two workers loaded their models), so the
# tests that run pairs use this, and the handover figures they log come with it.
LEASE_S = 5.0
# Safety net for start-up waits (broker, scheduler, workers, gateway): a worker's start is ~10 s
# of CPU (imports, model load, group join), which took 110 s of wall time at load 16. The waits
# end on the event itself, or at once when a child dies; this bound only turns a hang into a
# failure that shows the children's logs.
START_TIMEOUT_S = 300.0
# How long a child may take to stop cleanly after SIGTERM (Stack.stop). A worker drains running
# requests for up to 10 s (drain_timeout_s), then closes its engine and Kafka clients; the other
# services need well under a second of CPU. The margin over that is for a CPU-starved machine:
# only a stop that hangs (a task that never ends, a client never closed) should exceed it.
STOP_TIMEOUT_S = 40.0
# The line each child logs once it serves: every service's "<role> ready" (services/runtime.py),
# uvicorn's for the gateway. A start that misses its deadline names the children without it.
READY_LINES = {"gateway": "Application startup complete"}


class Stack:
    def __init__(self, bootstrap: str, model_dir: Path, log_dir: Path, prefix: str, **env) -> None:
        self.bootstrap, self.model_dir, self.log_dir, self.prefix = bootstrap, model_dir, log_dir, prefix
        self.procs: dict[str, subprocess.Popen] = {}
        self.roles: dict[str, str] = {}  # child name -> its subcommand (worker, scheduler, gateway, ...)
        self.spawned_at: dict[str, float] = {}  # child name -> time.monotonic() of its (latest) spawn
        self.log_start: dict[str, int] = {}  # child name -> its log's size at its (latest) spawn
        self.rebinds: dict[str, Callable[[], object]] = {}  # child name -> spawns it again on a fresh port
        self.rebound: dict[str, int] = {}  # child name -> times it was spawned again for a lost port
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP": bootstrap,
            "TANDEM_TOPIC_PREFIX": prefix,
            "TANDEM_LOG_LEVEL": os.environ.get("TANDEM_STACK_LOG_LEVEL", "INFO"),
            "TANDEM_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
            "TANDEM_WORKER_TIMEOUT_S": str(WORKER_TIMEOUT_S),
            "TANDEM_UNKNOWN_REQUEST_GRACE_S": str(WORKER_TIMEOUT_S),
            "TANDEM_DATA_DIR": str(log_dir / "data"),
            **{k: str(v) for k, v in env.items()},
        }
        self.gateway_urls: dict[str, str] = {}
        self.scheduler_url: str | None = None  # the running scheduler's metrics endpoint
        self.stopped: set[str] = set()  # children the test stopped on purpose
        self.paused: set[str] = set()  # workers the test paused (SIGSTOP) past the timeout on purpose

    def spawn(self, name: str, *argv: str, **env) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        self.log_start[name] = log.tell()
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            # tied to the test process: a killed test session leaves no stack running (lifeline.py)
            env=lifeline.tied_env({**self.env, **{k: str(v) for k, v in env.items()}}),
        )
        self.procs[name] = proc
        self.roles[name] = argv[0]
        self.spawned_at[name] = time.monotonic()
        self.stopped.discard(name)  # a child started again under the same name (a restart)
        return proc

    def scheduler(self, name: str = "scheduler", **env) -> str:
        """A scheduler, with its metrics endpoint on: `wait_workers` reads its view of the workers
        (of the one started last, unless a test points `scheduler_url` at another: the active of
        a pair). Returns its metrics URL."""
        port = free_port()
        self.rebinds[name] = lambda: self.scheduler(name, **env)
        self.spawn(name, "scheduler", TANDEM_METRICS_PORT=port, TANDEM_SCHEDULER_ID=name, **env)
        self.scheduler_url = f"http://127.0.0.1:{port}"
        return self.scheduler_url

    def worker(self, worker_id: str, **env) -> None:
        self.spawn(
            worker_id,
            "worker",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            "tiny",
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "0.05",
            "--num-threads",
            "1",
            "--worker-id",
            worker_id,
            **env,
        )

    def gateway(self, name: str = "gateway", **env) -> str:
        port = free_port()
        self.rebinds[name] = lambda: self.gateway(name, **env)
        self.spawn(name, "gateway", "--port", str(port), "--gateway-id", f"{self.prefix}-{name}", **env)
        self.gateway_urls[name] = f"http://127.0.0.1:{port}"
        return self.gateway_urls[name]

    def advisory(self, name: str = "advisory", **env) -> None:
        """The advisory service (typing hints -> session placements and prefetches)."""
        self.spawn(name, "advisory", **env)

    def queue(self, name: str = "queue", **env) -> None:
        """The batch queue service; it shares the stack's data dir (or TANDEM_DATABASE_URL) with the gateway."""
        self.spawn(name, "queue", "--queue-id", f"{self.prefix}-queue", **env)

    def start(self, workers: tuple[str, ...] = ("w0",), *, queue: bool = False) -> Stack:
        """The usual test stack: scheduler, tiny-model workers, gateway (and the batch queue),
        returned once the gateway and the scheduler see every worker. A start that does not
        finish (a timeout, a KeyboardInterrupt during the minute a loaded start can take) stops
        what it started before it raises: the fixture's teardown never runs for a set-up that
        failed, the error already holds the children's logs, and a half-started stack left running
        would take the CPU the next tests' stacks need."""
        try:
            self.scheduler()
            for worker_id in workers:
                self.worker(worker_id)
            self.gateway()
            if queue:
                self.queue()
            self.wait_workers(len(workers))
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        return self.gateway_urls["gateway"]

    # -- waiting for events ------------------------------------------------------------------

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
        """Poll `ready` until it holds. Fails at once when a child died; `timeout` is only a
        safety net against a hang (the failure shows every child's log)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f}s\n{self.start_report()}\n{self.logs()}")
            time.sleep(0.1)

    def start_report(self) -> str:
        """Where each running child's start stands: ready or not (its ready line logged), seconds
        since its spawn, the CPU seconds it has used, and its last log line. A start that missed
        its deadline names the child that did not come up, and whether it was starved (few CPU
        seconds in a long wall time: a busy host) or busy (a warm-up, a hang in a loop)."""
        lines = []
        for name, proc in self.procs.items():
            if name in self.stopped or proc.poll() is not None:
                continue
            role = self.roles[name]
            log = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
            ready = any(READY_LINES.get(role, f"{role} ready") in ln for ln in log)
            age = time.monotonic() - self.spawned_at[name]
            last = log[-1][:160] if log else "(nothing logged yet)"
            lines.append(
                f"{'ready' if ready else 'NOT READY'}: {name} ({role}), spawned {age:.0f}s ago, "
                f"{_cpu_seconds(proc.pid)} CPU-s; last: {last}"
            )
        return "start-up of each child:\n" + "\n".join(lines)

    def running_workers(self) -> set[str]:
        """Ids of the worker processes this stack runs (started and not stopped by the test)."""
        return {n for n, role in self.roles.items() if role == "worker" and n not in self.stopped}

    def wait_workers(self, n: int | None = None, gateway: str = "gateway") -> None:
        """Until the stack serves on its workers: the gateway counts at least `n` live workers
        (default: all the stack runs), so it admits requests for their model, and the scheduler
        (when the stack has one) places on every worker the stack runs. Heartbeats reach the
        two separately: the gateway alone seeing a worker does not mean the scheduler does."""
        expected = self.running_workers()
        n = len(expected) if n is None else n

        def ready() -> bool:
            if self.gateway_workers(gateway) < n:
                return False
            return self.scheduler_url is None or expected <= self.scheduler_workers()

        self.wait_until(f"{n} workers ready at {gateway} and {sorted(expected)} at the scheduler", ready)

    def gateway_workers(self, gateway: str = "gateway") -> int:
        """Live workers as the gateway counts them (-1 while it does not answer yet)."""
        try:
            return httpx.get(f"{self.gateway_urls[gateway]}/health", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError):
            return -1

    def scheduler_workers(self) -> set[str]:
        """Workers the running scheduler places on, from its `tandem_scheduler_worker_up` gauge
        (empty while it is starting: it serves metrics once it has joined its consumer group)."""
        try:
            text = httpx.get(f"{self.scheduler_url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return set()
        return {
            s.labels["worker_id"]
            for family in text_string_to_metric_families(text)
            if family.name == "tandem_scheduler_worker_up"
            for s in family.samples
            if s.value == 1
        }

    def wait_gateway(self, name: str = "gateway") -> str:
        """Until the gateway answers HTTP (its /health may still say 503: no workers)."""
        self.wait_until(f"gateway {name} answering", lambda: self.gateway_workers(name) >= 0)
        return self.gateway_urls[name]

    def wait_log(self, name: str, text: str) -> None:
        """Until a child's log holds `text` (a service's `<name> ready` line, say)."""
        path = self.log_dir / f"{name}.log"
        self.wait_until(f"{name}: {text!r}", lambda: text in path.read_text(errors="replace"))

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and n not in self.stopped}
        for name in [n for n in dead if self._lost_its_port(n)]:
            self.rebinds[name]()  # spawned again under the same name, on another port
            del dead[name]
        if dead:
            raise RuntimeError(f"children died: {dead}\n{self.logs()}")

    def _lost_its_port(self, name: str) -> bool:
        """Whether a dead child died because its port was taken between `free_port`'s probe and
        its own bind (another process's listener: free_port keeps out of the kernel's range for
        outgoing connections, so only a listener can). That is the machine, not the code under
        test: the child is started again on another port, at most twice."""
        if name not in self.rebinds or self.rebound.get(name, 0) >= 2:
            return False
        with open(self.log_dir / f"{name}.log", "rb") as f:
            f.seek(self.log_start[name])
            lost = b"address already in use" in f.read()
        if lost:
            self.rebound[name] = self.rebound.get(name, 0) + 1
        return lost

    def spurious_losses(self) -> list[str]:
        """The schedulers' warnings that they declared a live worker lost (its heartbeats came
        back after a silence longer than the worker timeout): the stack's margins failed."""
        out = []
        for name, role in self.roles.items():
            if role == "scheduler":
                text = (self.log_dir / f"{name}.log").read_text(errors="replace")
                out += [
                    f"{name}: {ln}"
                    for ln in text.splitlines()
                    if LOST_BUT_ALIVE in ln and not any(f"worker {w} " in ln for w in self.paused)
                ]
        return out

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.stopped.add(name)
        self.procs[name].send_signal(sig)
        self.procs[name].wait(timeout=30)

    def logs(self, tail: int = 40) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> list[str]:
        """SIGTERM every running child and wait for its clean stop. Returns what went wrong, one
        entry per child with its last log lines: a stop that hung past STOP_TIMEOUT_S (the child
        is then SIGKILLed so nothing outlives the test) or a non-zero exit. The caller fails the
        test on it: a service that cannot stop cleanly is a bug (a deploy or `tandem up` would
        wait for it, then kill it mid-write), which the silent kill this used to do hid."""
        return self.stop_together(*(n for n, p in self.procs.items() if p.poll() is None))

    def stop_together(self, *names: str) -> list[str]:
        """SIGTERM these children at once and wait for their clean stops: what went wrong (as `stop`)."""
        for name in names:
            self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        problems = [self._stopped_cleanly(name, deadline) for name in names]
        return [problem for problem in problems if problem is not None]

    def _stopped_cleanly(self, name: str, deadline: float) -> str | None:
        """Wait for a signalled child's exit until `deadline`: None when it stopped cleanly, else
        the problem with its last log lines (a hung one's, longer: services dump every task's
        stack into their log 30 s into a stop, services/runtime.py). A hung child is killed."""
        p = self.procs[name]
        self.stopped.add(name)
        try:
            rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return f"{name}: no clean stop within {STOP_TIMEOUT_S:.0f}s of SIGTERM (killed)\n{self.log_tail(name, 200)}"
        if rc not in (0, 128 + signal.SIGTERM):  # uvicorn (the gateway) exits 143 once stopped
            return f"{name}: exit {rc} after SIGTERM\n{self.log_tail(name)}"
        return None

    def log_tail(self, name: str, tail: int = 30) -> str:
        lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-tail:]
        return f"--- {name}.log\n" + "\n".join(lines)


def _cpu_seconds(pid: int) -> str:
    """User + system CPU seconds a process has used (Linux /proc; "?" elsewhere or once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return f"{(int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK'):.1f}"
    except (OSError, IndexError, ValueError):
        return "?"
