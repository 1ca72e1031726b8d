"""Starts `tandem up` as a child process for benchmarks that need the whole stack.

The stack is tied to the benchmark (`services.lifeline`): SIGTERM/SIGHUP unwind the benchmark
like Ctrl-C (the `finally` below stops the stack), and a benchmark that dies outright (SIGKILL)
takes the stack with it, because `up` watches its parent."""

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
