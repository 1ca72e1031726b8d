"""A gateway whose parent dies with the broker exits on its bounded clean path (issue 22, "nothing
outlives its parent"). Before session 8 a gateway outlived its parent by seconds to minutes after
`timeout` stopped a test run while the other services exited: every stream its stop closed sent a
cancel to the dead broker and the stop waited for each send, then for the producer's flush.

The parent is a real process that starts a real broker and gateway (both tied to it), heartbeats
as a scripted worker that never answers, and holds requests open; the test SIGKILLs it and waits
for the gateway's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(600)  # the parent's start, then up to 240 s for the stop
OPEN_REQUESTS = 5

PARENT = textwrap.dedent(
    """
    import asyncio, os, subprocess, sys, time
    import httpx
    from services import lifeline
    from services.broker import free_port, start_broker
    from shared.kafka import KafkaClient
    from shared.schemas.telemetry import Heartbeat
    from shared.settings import ServiceSettings
    from shared.topics import Topics

    log_path, n_open = sys.argv[1], int(sys.argv[2])
    broker, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = "gwstop"
    env = lifeline.tied_env({**os.environ, "KAFKA_BOOTSTRAP": bootstrap, "TANDEM_TOPIC_PREFIX": prefix})

    def spawn_gateway():
        port = free_port()
        with open(log_path, "ab") as log:
            argv = [sys.executable, "-m", "services.cli", "gateway", "--port", str(port)]
            return port, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    port, gateway = spawn_gateway()
    respawns = 0

    async def main():
        topics = Topics(prefix)
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix), "scripted-w0")
        await kafka.start(topics.static())

        async def beat():  # a live worker for the gateway, one that never answers
            while True:
                hb = Heartbeat(worker_id="w0", model="tiny", max_model_len=256,
                               dispatch_topic=f"{prefix}.dispatch.w0", started_at=1.0, sent_at=time.time())
                await kafka.send(topics.heartbeats.name, hb, key="w0")
                await asyncio.sleep(0.5)

        global port, gateway, respawns
        beating = asyncio.create_task(beat())
        async with httpx.AsyncClient(timeout=600) as client:
            while True:
                # a gateway that died exits this parent (the test prints the log); one that lost its
                # port to another listener between free_port's probe and its bind goes again
                if gateway.poll() is not None:
                    with open(log_path, errors="replace") as f:
                        lost = "address already in use" in f.read().lower()
                    if not lost or respawns == 2:
                        sys.exit(3)
                    respawns += 1
                    port, gateway = spawn_gateway()
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).json()["workers"] >= 1:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.3)
            url = f"http://127.0.0.1:{port}"
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
            held = [asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=body)) for _ in range(n_open)]
            while True:  # until the gateway holds every request open
                text = (await client.get(f"{url}/metrics")).text
                line = [ln for ln in text.splitlines() if ln.startswith("tandem_gateway_inflight ")]
                if line and float(line[0].split()[1]) >= n_open:
                    break
                await asyncio.sleep(0.3)
            print(gateway.pid, flush=True)
            await asyncio.gather(beating, *held)

    asyncio.run(main())
    """
)


def test_a_gateway_whose_parent_died_with_the_broker_stops_on_its_bounded_path(tmp_path: Path):
    log = tmp_path / "gateway.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(log), str(OPEN_REQUESTS)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "TANDEM_DATA_DIR": str(tmp_path / "data")},
    )
    gateway = None
    try:
        line = parent.stdout.readline()  # the gateway's pid, once it holds every request open
        assert line.strip(), f"the parent exited early ({parent.wait()}):\n{log.read_text(errors='replace')[-3000:]}"
        gateway = psutil.Process(int(line))
        parent.send_signal(signal.SIGKILL)  # the broker goes with it (tied), as in a stopped test run
        parent.wait()
        gateway.wait(timeout=240)
        text = log.read_text(errors="replace")
        assert "Finished server process" in text, text[-3000:]  # the clean stop, not lifeline's hard exit
        assert "clean stop hung" not in text, text[-3000:]
        # the cancels of the held requests, which the dead broker would never acknowledge, were
        # given their grace and dropped (the old stop waited for each send)
        assert f"dropped {OPEN_REQUESTS} cancels" in text, text[-3000:]
    finally:
        for p in [parent, gateway]:
            try:
                if p is not None:
                    p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
