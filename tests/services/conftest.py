"""A real Tandem stack for service tests: the tansu broker, and scheduler, workers and gateways
as separate processes (`python -m services.cli ...`), on a tiny random-weight Llama model.

Each stack uses its own topic prefix, so stacks sharing the session's broker never see each
other's messages. Child logs go to files under the test's tmp dir (printed on failure).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.broker import free_port
from shared.kafka import KafkaClient
from shared.schemas.telemetry import Heartbeat
from shared.settings import ServiceSettings
from shared.topics import Topics


class Stack:
    def __init__(self, bootstrap: str, model_dir: Path, log_dir: Path, prefix: str, **env) -> None:
        self.bootstrap, self.model_dir, self.log_dir, self.prefix = bootstrap, model_dir, log_dir, prefix
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP": bootstrap,
            "TANDEM_TOPIC_PREFIX": prefix,
            "TANDEM_LOG_LEVEL": "INFO",
            "TANDEM_HEARTBEAT_INTERVAL_S": "0.25",
            "TANDEM_WORKER_TIMEOUT_S": "1.5",
            "TANDEM_DATA_DIR": str(log_dir / "data"),
            **{k: str(v) for k, v in env.items()},
        }
        self.gateway_urls: dict[str, str] = {}
        self.stopped: set[str] = set()  # children the test stopped on purpose

    def spawn(self, name: str, *argv: str, **env) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **{k: str(v) for k, v in env.items()}},
        )
        self.procs[name] = proc
        return proc

    def scheduler(self, name: str = "scheduler") -> None:
        self.spawn(name, "scheduler")

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
        returned once the gateway sees every worker."""
        self.scheduler()
        for worker_id in workers:
            self.worker(worker_id)
        self.gateway()
        if queue:
            self.queue()
        self.wait_workers(len(workers))
        return self

    @property
    def url(self) -> str:
        return self.gateway_urls["gateway"]

    def wait_workers(self, n: int, gateway: str = "gateway", timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                r = httpx.get(f"{self.gateway_urls[gateway]}/health", timeout=2)
                if r.status_code == 200 and r.json()["workers"] >= n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{n} workers not ready within {timeout}s\n{self.logs()}")

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None and n not in self.stopped}
        if dead:
            raise RuntimeError(f"children died: {dead}\n{self.logs()}")

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

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def make_stack(kafka_bootstrap, tiny_model_dir, tmp_path_factory, request):
    """Factory for stacks torn down at the end of the module."""
    stacks: list[Stack] = []

    def make(**env) -> Stack:
        prefix = f"t{len(stacks)}-{request.module.__name__.rsplit('.', 1)[-1].replace('_', '-')}"
        stack = Stack(kafka_bootstrap, tiny_model_dir("llama"), tmp_path_factory.mktemp(prefix), prefix, **env)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.stop()


def chat_body(content: str, max_tokens: int = 16, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def openai_client(stack: Stack):
    import openai

    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def worker_heartbeat(stack, worker_id: str) -> Heartbeat:
    """The next heartbeat of a worker, read straight from the broker."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-probe")
    consumer = await kafka.consumer(group=None)
    try:
        await kafka.assign_all(consumer, Topics(stack.prefix).heartbeats.name, from_end=True)
        while True:
            hb = Heartbeat.decode((await consumer.getone()).value)
            if hb.worker_id == worker_id:
                return hb
    finally:
        await kafka.stop()
