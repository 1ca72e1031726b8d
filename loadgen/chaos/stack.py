"""The stack `tandem chaos` breaks: every service a separate process it can SIGKILL and start again.

`tandem up` cannot be used: it stops everything when one child dies (by design, docs/services.md),
and `tandem up --ha` reports a death without restarting anything. So this harness is its own
supervisor, as systemd, Kubernetes or Compose's `restart: unless-stopped` would be: it starts the
embedded broker on a fixed port, the scheduler, the advisory and queue services, two workers and
two gateway replicas, and after a kill starts the same command again (the broker on the same port,
with its data gone). Child logs go to files in `log_dir`; every child is tied to this process
(`services.lifeline`).

With `ha`, the scheduler, the advisory and the queue service run as pairs (`<role>-a`, `<role>-b`,
one active and one standby by their lease, docs/reliability.md "HA pairs"), as `tandem up --ha` and
Compose run them. A fault of such a kind kills the *active* instance at that moment (the one whose
log names the highest lease term, among those alive); the standby takes over, and the harness
starts the killed one again, which stands by.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services import lifeline
from services.broker import broker_command, free_port, wait_listening
from services.standby import DEPOSED_EXIT

# The fault kinds: which children a kill of that kind hits (the first of each role; with HA, a
# paired role's active instance, chosen at the kill).
FAULT_TARGETS = {
    "gateway": ("gateway-a",),
    "scheduler": ("scheduler",),
    "queue": ("queue",),
    "advisory": ("advisory",),
    "worker": ("worker-0",),
    "broker": ("broker",),
}
PAIRED = ("scheduler", "advisory", "queue")
_ACTIVE = re.compile(r"(scheduler|advisory|queue) active \(term (\d+)\)")


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None


class ChaosStack:
    """Start, kill and restart the children; `gateways` are the replicas' base URLs."""

    def __init__(self, model: str, log_dir: Path, env: dict[str, str] | None = None, *, ha: bool = False) -> None:
        self.log_dir = log_dir
        self.ha = ha
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP": self.bootstrap,
            "TANDEM_DATA_DIR": str(log_dir / "data"),
            "OMP_WAIT_POLICY": "passive",
            **(env or {}),
        }
        self.children: dict[str, Child] = {}
        self.child_env: dict[str, dict[str, str]] = {}  # per child, on top of `env`
        self.deposed: list[str] = []  # HA: instances that exited deposed and were started again
        self.gateways: dict[str, str] = {}
        cli = [sys.executable, "-m", "services.cli"]
        self._add("broker", lifeline.tied_argv(broker_command("127.0.0.1", self.port)))
        for role in PAIRED:
            for name in (f"{role}-a", f"{role}-b") if ha else (role,):
                self._add(name, [*cli, role, *(("--queue-id", f"chaos-{name}") if role == "queue" else ())])
                self.child_env[name] = {f"TANDEM_{role.upper()}_ID": name}
        for i in range(2):
            worker = [*cli, "worker", "--model", model, "--served-model-name", "chaos", "--dtype", "float32"]
            self._add(f"worker-{i}", [*worker, "--kv-cache-gib", "0.1", "--num-threads", "1", "--worker-id", f"w{i}"])
        for name in ("gateway-a", "gateway-b"):
            port = free_port()
            self._add(name, [*cli, "gateway", "--port", str(port), "--gateway-id", f"chaos-{name}"])
            self.gateways[name] = f"http://127.0.0.1:{port}"

    def _add(self, name: str, argv: list[str]) -> None:
        self.children[name] = Child(name, argv)

    def start(self, ready_timeout_s: float) -> None:
        """Every child, then wait until both gateways count both workers."""
        for name in self.children:
            self.spawn(name)
        self.wait_ready(ready_timeout_s)

    def spawn(self, name: str) -> None:
        child = self.children[name]
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        env = lifeline.tied_env({**self.env, **self.child_env.get(name, {})})
        child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if name == "broker":
            wait_listening("127.0.0.1", self.port)

    def targets(self, kind: str) -> list[str]:
        """The children a fault of `kind` kills now."""
        if self.ha and kind in PAIRED:
            return [self.active(kind)]
        return list(FAULT_TARGETS[kind])

    def active(self, role: str) -> str:
        """The active instance of a pair: among those alive, the one whose log names the highest
        lease term it took (a killed and restarted instance stands by: its old line is lower)."""
        best, best_term = f"{role}-a", -1
        for name in (f"{role}-a", f"{role}-b"):
            proc = self.children[name].proc
            if proc is None or proc.poll() is not None:
                continue
            log = (self.log_dir / f"{name}.log").read_text(errors="replace")
            terms = [int(m.group(2)) for m in _ACTIVE.finditer(log) if m.group(1) == role]
            if terms and max(terms) > best_term:
                best, best_term = name, max(terms)
        return best

    def kill(self, name: str) -> None:
        """SIGKILL, and wait until it is gone."""
        proc = self.children[name].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def dead(self) -> list[str]:
        """Children that exited without being killed by the harness (a crash: reported). With HA,
        an instance of a pair that exited deposed (75: it missed its renewals and the standby took
        over, a pause rather than a death) is started again as the standby first, as `up --ha` and
        Compose do, and counted in `deposed`."""
        if self.ha:
            for name, child in self.children.items():
                if child.proc is not None and child.proc.poll() == DEPOSED_EXIT:
                    self.deposed.append(name)
                    self.spawn(name)
        return [n for n, c in self.children.items() if c.proc is not None and c.proc.poll() is not None]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(_workers(url) >= 2 for url in self.gateways.values()):
                return
            if self.dead():
                raise RuntimeError(f"children exited during start: {self.dead()} (logs in {self.log_dir})")
            time.sleep(0.5)
        raise RuntimeError(f"the stack was not ready within {timeout_s:.0f}s (logs in {self.log_dir})")

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children.values():
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def _workers(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1
