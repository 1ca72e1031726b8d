"""`tandem` command-line entry point.

Each subcommand lives in its own module and registers itself through a small ``add_parser``
function; heavy imports (torch, the engine) happen inside the subcommand, so ``tandem --help``
is instant.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# (module, attribute) pairs: each is a function(subparsers) that adds one subcommand.
_SUBCOMMANDS: list[tuple[str, str]] = [
    ("services.worker.cli_generate", "add_parser"),
    ("services.worker.cli_chat", "add_parser"),
    ("loadgen.bench.cli", "add_parser"),
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    ap = argparse.ArgumentParser(prog="tandem", description="Tandem: an LLM serving system")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module, attr in _SUBCOMMANDS:
        register: Callable[[argparse._SubParsersAction], None] = getattr(importlib.import_module(module), attr)
        register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `tandem generate ... | head`
        return 0
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
