"""Runs a long-lived service under uvloop until SIGINT/SIGTERM, then stops it cleanly.

Once the service's own `stop()` has run, the process leaves without the interpreter's teardown
(`os._exit`, after flushing the logs). Everything the service owns is closed by then (Kafka
clients, files, the engine and its session writes); what is left is the interpreter's final
garbage collection, which in a worker that ran its engine took 10-25 s of CPU (faulthandler
showed the main thread in "Garbage-collecting" throughout). Every stop waited for it: a
deploy, `tandem up` on Ctrl-C, each test stack's teardown. A service whose `start()` or `stop()`
raises exits the ordinary way, traceback included.

SIGHUP stops a service like SIGTERM (its terminal or its supervisor went away). A service started
by `tandem up` or a benchmark stops when that parent dies (`services.lifeline`).

A stop that hangs names itself: `STOP_DUMP_S` into a stop (and on SIGUSR1, at any time) the
process writes every asyncio task's stack and every thread's (faulthandler) to its log. A
scheduler once hung at stop in the test suite with a log that ended at "scheduler stopping" and
nothing to say where; test stacks wait 40 s for a stop (`tests/services/conftest.py`), so the dump
comes before they give up. The thread dump is written by faulthandler's own thread, so it comes
even when the event loop itself is stuck.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import os
import signal
import sys
from typing import NoReturn, Protocol

from services import lifeline
from shared.logs import configure_logging
from shared.settings import ServiceSettings

log = logging.getLogger(__name__)

STOP_DUMP_S = 30.0  # a stop still running this long is dumped (module docstring)


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def run_service(name: str, settings: ServiceSettings, service: Service) -> NoReturn:
    configure_logging(name, settings.log_level, settings.log_json)
    lifeline.adopt_parent()  # its death arrives as SIGTERM, handled below
    import uvloop

    code = uvloop.run(_main(name, service))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _main(name: str, service: Service) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks, "SIGUSR1")
    # A stop during start (a worker loading its model, a client waiting for a broker that died
    # with the same parent) cancels the start: waiting for it could take forever.
    starting = asyncio.create_task(service.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    started = starting.done()
    if started:
        starting.result()  # a failed start raises here, traceback included
        log.info("%s ready", name)
        await stopping
    else:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
    log.info("%s stopping%s", name, "" if started else " before it was ready")
    faulthandler.dump_traceback_later(STOP_DUMP_S, file=sys.stderr)  # threads, even if the loop is stuck
    overrun = loop.call_later(STOP_DUMP_S, dump_tasks, f"{name} still stopping after {STOP_DUMP_S:.0f}s")
    try:
        await service.stop()
    except Exception:
        if started:
            raise
        log.warning("%s: stop after an interrupted start failed", name, exc_info=True)
    finally:
        overrun.cancel()
        faulthandler.cancel_dump_traceback_later()
    return 0


def dump_tasks(reason: str) -> None:
    """Every asyncio task of the running loop with its stack, to the log (a stop that overran,
    or SIGUSR1)."""
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    out.write(f"{reason}: {len(tasks)} asyncio tasks\n")
    for task in tasks:
        task.print_stack(file=out)
    log.warning("%s", out.getvalue())
