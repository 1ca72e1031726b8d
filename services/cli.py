"""`tandem` command-line entry point.

Each subcommand lives in its own module and registers itself through a small ``add_parser``
function; heavy imports (torch, the engine) happen inside the subcommand, so ``tandem --help``
is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

# OpenMP runtime defaults for CPU inference, read once when torch loads (so set before any
# subcommand imports it; an explicit environment setting wins). Pinning threads to cores and
# letting idle workers spin cuts the fork/join latency of the many small ops in a decode step.
_CPU_RUNTIME_DEFAULTS = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "OMP_WAIT_POLICY": "active"}

# (module, attribute) pairs: each is a function(subparsers) that adds one subcommand.
_SUBCOMMANDS: list[tuple[str, str]] = [
    ("services.worker.cli_generate", "add_parser"),
    ("services.worker.cli_chat", "add_parser"),
    ("services.worker.cli_profile", "add_parser"),
    ("loadgen.bench.cli", "add_parser"),
    ("loadgen.chaos.cli", "add_parser"),
    ("loadgen.cli", "add_parser"),
    ("loadgen.repro.cli", "add_parser"),
    ("services.gateway.cli", "add_parser"),
    ("services.scheduler.cli", "add_parser"),
    ("services.advisory.cli", "add_parser"),
    ("services.worker.cli_worker", "add_parser"),
    ("services.broker", "add_parser"),
    ("services.up", "add_parser"),
    ("services.cli_topics", "add_parser"),
    ("services.cli_keys", "add_parser"),
    ("services.cli_status", "add_parser"),
    ("services.cli_drain", "add_parser"),
    ("services.queue.cli", "add_parser"),
    ("services.queue.cli_batch", "add_parser"),
]

# The long-running services, by subcommand: the module (of _SUBCOMMANDS) that registers each.
# Starting one builds only its own parser: building all of them imports every benchmark's and
# tool's module (numpy, psutil, httpx, aiokafka's admin...), ~0.6 CPU-s in each service process
# of a stack, and a test stack's start on a busy host is CPU-starved (docs/testing.md).
_SERVICE_COMMANDS: dict[str, str] = {
    "gateway": "services.gateway.cli",
    "scheduler": "services.scheduler.cli",
    "advisory": "services.advisory.cli",
    "worker": "services.worker.cli_worker",
    "queue": "services.queue.cli",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `tandem` parser; for `argv` that starts a service (`tandem worker ...`), that service's
    subcommand only (a wrong argument is still a parse error naming it)."""
    import importlib

    ap = argparse.ArgumentParser(prog="tandem", description="Tandem: an LLM serving system")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    service = _SERVICE_COMMANDS.get(argv[0]) if argv else None
    for module, attr in _SUBCOMMANDS:
        if service is not None and module != service:
            continue
        register: Callable[[argparse._SubParsersAction], None] = getattr(importlib.import_module(module), attr)
        register(sub)
    return ap


def _leave_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, as a service does (services/runtime.py). By the
    time a SIGTERM has unwound a one-shot command its `finally` blocks have run (a benchmark's
    stack is stopped, its files closed); what is left is the final garbage collection, which
    after an engine ran kept `tandem bench engine` "Garbage-collecting" for over 12 s on a busy
    machine, past the few seconds a supervisor (`timeout -k`, systemd) waits before SIGKILL."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    from services.lifeline import Terminated, interrupt_on_termination

    words = sys.argv[1:] if argv is None else argv
    args = build_parser(words).parse_args(words)  # no subcommand imports torch while parsing
    # SIGTERM/SIGHUP unwind a one-shot command (a benchmark stopping its stack) like Ctrl-C;
    # services and `up` install their own handlers over this.
    interrupt_on_termination()
    if args.command != "up":  # `up` chooses its children's settings itself (see services/up.py)
        for key, value in _CPU_RUNTIME_DEFAULTS.items():
            os.environ.setdefault(key, value)
    try:
        rc = args.func(args)
    except Terminated as exc:
        if argv is None:  # the `tandem` program itself, not a caller in this process
            _leave_now(128 + exc.signum)
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad input or an unusable model: a clear message, no traceback
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `tandem generate ... | head`
        return 0
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
