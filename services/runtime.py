"""Runs a long-lived service under uvloop until SIGINT/SIGTERM, then stops it cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

from shared.logs import configure_logging
from shared.settings import ServiceSettings

log = logging.getLogger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def run_service(name: str, settings: ServiceSettings, service: Service) -> int:
    configure_logging(name, settings.log_level, settings.log_json)
    import uvloop

    return uvloop.run(_main(name, service))


async def _main(name: str, service: Service) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    log.info("%s ready", name)
    await stop.wait()
    log.info("%s stopping", name)
    await service.stop()
    return 0
