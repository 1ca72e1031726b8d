"""`tandem up`: the whole stack on one machine, one command.

Starts the embedded broker (unless KAFKA_BOOTSTRAP points at one), the scheduler, the advisory
service (typing hints -> session placement), the workers, the batch queue service and the
gateway as child processes, prefixes each child's log lines with its name, waits until
the gateway reports ready and prints the URL. Ctrl-C (or SIGTERM, SIGHUP) stops the children in
reverse order, each with SIGTERM first. Nothing outlives `up`: each child is tied to it
(`services.lifeline`), so even a SIGKILLed `up` takes its stack with it, and an `up` started by a
benchmark stops with that benchmark. Nothing is restarted silently: if a child exits, `up` says which
one and with what code, stops the rest and exits non-zero.

`--ha` runs the scheduler, the advisory and the queue service doubled (`<name>-a`, `<name>-b`:
one active, one standby, services/standby.py). A child of a pair that dies is reported (a log
line here; `tandem status` shows it silent) and the stack keeps serving on its partner; only
when both of a pair are gone does `up` stop everything. A child that exits as deposed (code 75:
its partner took the lease while it was paused) is restarted as the standby, and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass

from services import lifeline
from services.broker import broker_command, free_port, wait_listening
from services.standby import DEPOSED_EXIT

# The services that may run doubled, and the flag or variable that names each instance.
_PAIRED = {"scheduler": "TANDEM_SCHEDULER_ID", "advisory": "TANDEM_ADVISORY_ID", "queue": "TANDEM_QUEUE_ID"}


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    stopping: bool = False
    env: dict[str, str] | None = None  # on top of `up`'s environment (an HA instance's id)
    pair: str | None = None  # with --ha: the role this child is one instance of


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="start broker, scheduler, advisory, workers and gateway on this machine",
        description="Start the whole stack on one machine and serve the API.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    # Worker options default to None: unset, each worker takes its TANDEM_* environment variable
    # (TANDEM_DTYPE, TANDEM_MODEL, ...) or the worker's own default, so the environment is honoured.
    p.add_argument("--model", default=None, help="model for every worker (default: TANDEM_MODEL or the bundled one)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: TANDEM_DEVICE or cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="default: TANDEM_DTYPE or auto (bfloat16 where the CPU has native bf16, else float32)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: TANDEM_KV_CACHE_GIB or 1.0")
    p.add_argument("--policy", default=None, help="default: TANDEM_POLICY or fcfs")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the gateway")
    p.add_argument(
        "--ha",
        action="store_true",
        help="run the scheduler, advisory and queue services doubled (active + standby); keep serving when one dies",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    lifeline.adopt_parent()  # a benchmark's `up`: its death arrives as SIGTERM; before _Up copies the env
    return uvloop.run(_Up(args).main())


# Workers share the cores with the broker, gateway and scheduler here: spinning OpenMP threads
# (the engine's default) starve them. Passive waiting measured ~30% better on both batch
# throughput and RT TTFT with the whole stack on 2 cores. A user setting wins.
OMP_WAIT_POLICY = "passive"


def worker_threads(workers: int) -> int:
    """Torch threads per CPU worker: the machine's cores split between the workers."""
    return max(1, (os.cpu_count() or 1) // workers)


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *argv]


class _Up:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[Child] = []
        self.env = dict(os.environ)
        self.env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
        self.shutdown = asyncio.Event()

    def _plan(self) -> None:
        a = self.args
        threads = worker_threads(a.workers)
        self._add_paired("scheduler")
        self._add_paired("advisory")  # sessions: hints -> placement + prefetch
        passed = [
            (flag, value)
            for flag, value in (
                ("--model", a.model),
                ("--device", a.device),
                ("--dtype", a.dtype),
                ("--kv-cache-gib", a.kv_cache_gib),
                ("--policy", a.policy),
            )
            if value is not None
        ]
        on_cpu = (a.device or self.env.get("TANDEM_DEVICE", "cpu")) == "cpu"
        if on_cpu and "TANDEM_NUM_THREADS" not in self.env:  # split the cores between the workers
            passed.append(("--num-threads", threads))
        for i in range(a.workers):
            argv = _cli("worker", *(str(x) for pair in passed for x in pair), "--worker-id", f"worker-{i}")
            self.children.append(Child(f"worker-{i}", argv))
        self._add_paired("queue")  # batch jobs; shares the default data dir with the gateway
        self.children.append(Child("gateway", _cli("gateway", "--host", a.host, "--port", str(a.port))))

    def _add_paired(self, role: str) -> None:
        """One child of `role`, or with --ha two (`-a` active first, `-b` its standby)."""
        if not self.args.ha:
            self.children.append(Child(role, _cli(role)))
            return
        for suffix in ("a", "b"):
            name = f"{role}-{suffix}"
            self.children.append(Child(name, _cli(role), env={_PAIRED[role]: name}, pair=role))

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.shutdown.set)
        try:
            await self._start_broker()
            self._plan()
            for child in self.children:
                if child.proc is None:
                    await self._spawn(child)
            return await self._supervise()
        finally:
            await self._stop_all()

    async def _start_broker(self) -> None:
        if self.env.get("KAFKA_BOOTSTRAP"):
            _say(f"using Kafka at {self.env['KAFKA_BOOTSTRAP']}")
            return
        port = free_port()
        child = Child("broker", lifeline.tied_argv(broker_command("127.0.0.1", port)))
        self.children.append(child)
        await self._spawn(child)
        await asyncio.get_running_loop().run_in_executor(None, wait_listening, "127.0.0.1", port)
        self.env["KAFKA_BOOTSTRAP"] = f"127.0.0.1:{port}"
        _say(f"embedded broker on 127.0.0.1:{port}")

    async def _spawn(self, child: Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            *child.argv,
            env=lifeline.tied_env({**self.env, **(child.env or {})}),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only `up`, which stops children in order
        )
        asyncio.create_task(_pump(child))

    async def _supervise(self) -> int:
        ready = asyncio.create_task(self._wait_ready())
        exits = {asyncio.create_task(c.proc.wait()): c for c in self.children}
        stop = asyncio.create_task(self.shutdown.wait())
        while True:
            done, _ = await asyncio.wait({ready, stop, *exits}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                _say("shutting down")
                return 0
            for t in done & set(exits):
                child = exits.pop(t)
                if not await self._survive(child):
                    return 1
                if child.proc.returncode is None:  # restarted: watch the new process
                    exits[asyncio.create_task(child.proc.wait())] = child
            if ready in done:
                if not ready.result():
                    _say(f"the gateway was not ready within {self.args.ready_timeout:.0f}s")
                    return 1
                ready = asyncio.create_task(asyncio.Event().wait())  # never again

    async def _survive(self, child: Child) -> bool:
        """A child exited: False to stop everything, True when its HA partner keeps serving."""
        code = child.proc.returncode
        partner = next((c for c in self.children if c.pair and c.pair == child.pair and c is not child), None)
        if partner is None or partner.proc is None or partner.proc.returncode is not None:
            _say(f"{child.name} exited unexpectedly with code {code}; stopping everything")
            return False
        if code == DEPOSED_EXIT:
            _say(
                f"{child.name} was deposed ({partner.name} holds the {child.pair} lease); restarting it as the standby"
            )
            await self._spawn(child)
            return True
        _say(f"{child.name} died (code {code}); {partner.name} serves as the {child.pair} (HA: not restarted)")
        return True

    async def _wait_ready(self) -> bool:
        import httpx

        url = f"http://{self.args.host}:{self.args.port}"
        deadline = time.monotonic() + self.args.ready_timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        _say(f"ready: {url}/v1  (OpenAI-compatible; model id 'default' unless --model)")
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        return False

    async def _stop_all(self) -> None:
        for child in reversed(self.children):
            await _stop(child)


async def _stop(child: Child, grace_s: float = 15.0) -> None:
    p = child.proc
    if p is None or p.returncode is not None:
        return
    child.stopping = True
    p.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(grace_s):
            await p.wait()
    except TimeoutError:
        _say(f"{child.name} did not stop in {grace_s:.0f}s; killing it")
        p.kill()
        await p.wait()


async def _pump(child: Child) -> None:
    width = 10
    while True:
        line = await child.proc.stdout.readline()
        if not line:
            return
        sys.stdout.write(f"{child.name:<{width}}| {line.decode(errors='replace')}")
        sys.stdout.flush()


def _say(msg: str) -> None:
    sys.stdout.write(f"{'up':<10}| {msg}\n")
    sys.stdout.flush()
