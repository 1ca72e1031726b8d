"""Starts `tandem up` as a child process for benchmarks that need the whole stack.

The stack is tied to the benchmark (`services.lifeline`): SIGTERM/SIGHUP unwind the benchmark
like Ctrl-C (the `finally` below stops the stack), and a benchmark that dies outright (SIGKILL)
takes the stack with it, because `up` watches its parent. An asyncio benchmark should await its
run through `stop_on_signal`, so the first signal cancels the run from the event loop rather
than raising inside whatever callback runs (an HTTP transport's swallows it)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager

import httpx

from services import lifeline


@asynccontextmanager
async def running_stack(
    model: str,
    dtype: str = "float32",
    kv_cache_gib: float = 0.25,
    log_path: str | None = None,
    workers: int = 1,
    env: dict[str, str] | None = None,
    checkout: str | None = None,
):
    """Yields (gateway url, served model id); stops the stack (Ctrl-C semantics) on exit.

    `env` adds settings for every service (`TANDEM_*`), e.g. a scheduler routing mode.
    `checkout`: run the stack from the code in that folder (its own `services`, `shared`,
    `engine` ... first on the path) instead of this one's, for an A/B of two code states."""
    from services.broker import free_port

    port = free_port()
    env = {**os.environ, **(env or {}), "TANDEM_TOPIC_PREFIX": f"bench{port}"}
    env.pop("KAFKA_BOOTSTRAP", None)
    env.pop("OMP_WAIT_POLICY", None)  # the bench process's own default; let `tandem up` choose
    if checkout is not None:
        env["PYTHONPATH"] = os.path.abspath(checkout)
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--model",
            model,
            "--dtype",
            dtype,
            "--kv-cache-gib",
            str(kv_cache_gib),
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        env=lifeline.tied_env(env),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=checkout,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            name = await _wait_ready(client, url, proc)
        yield url, name
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _wait_ready(client: httpx.AsyncClient, url: str, proc: subprocess.Popen) -> str:
    for _ in range(2400):
        if proc.poll() is not None:
            raise RuntimeError("tandem up exited before the gateway was ready")
        try:
            if (await client.get(f"{url}/health")).status_code == 200:
                return (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError("gateway not ready in 10 minutes")


async def stop_on_signal(run):
    """Await the coroutine `run`; the first SIGTERM or SIGHUP cancels it from the event loop (its
    `finally` blocks stop the stack) and raises `Terminated`, which `tandem` exits 128 + signal
    on. Not the process-wide handler's way (an exception raised wherever Python was running when
    the signal came): inside an HTTP transport's callback the event loop caught it as a "fatal
    error on transport" and the run went on (session 9). A second signal cancels again."""
    from services.lifeline import Terminated

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(run)
    got: list[int] = []

    def on_signal(signum: int) -> None:
        got.append(signum)
        task.cancel()

    sigs = (signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if got:
            raise Terminated(got[0]) from None
        raise
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            signal.signal(sig, before[sig])  # the process's handler again (remove sets the default)
