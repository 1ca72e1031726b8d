"""The broker watch's failure lines name the error (issue 22): a replacement scheduler at load 38
logged "broker watch start failed ()" for minutes, because the error was an `asyncio` timeout
(`TimeoutError()`, whose `str` is empty). A real tansu stopped with SIGSTOP answers nothing, as a
starved one does: the watch's start times out and says so by type."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time

from services.broker import start_broker
from shared.broker_watch import BrokerWatch
from shared.kafka import KafkaClient
from shared.settings import ServiceSettings


def test_a_watch_start_that_times_out_names_the_error(caplog):
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    caplog.set_level(logging.WARNING, logger="shared.kafka")

    async def run() -> None:
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "watch-err")

        async def on_restart(_restart) -> None:
            return None

        watch = BrokerWatch(kafka, "watch-err", on_restart)
        os.kill(proc.pid, signal.SIGSTOP)
        starting = asyncio.create_task(watch.start(background=False))
        try:
            deadline = time.monotonic() + 120
            while not any("broker watch start failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the watch's start never failed against a stopped broker"
                assert not starting.done(), starting
                await asyncio.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await asyncio.wait_for(starting, 120)  # the broker answers again: the start completes
        await watch.stop()

    try:
        asyncio.run(run())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    line = next(r.getMessage() for r in caplog.records if "broker watch start failed" in r.getMessage())
    assert "broker watch start failed (TimeoutError())" in line, line
