"""`tandem repro PAPER`: regenerate a paper's comparison (simulator at paper scale, the CPU
engine at small scale with `--engine`) into docs/results/<paper>/, beside the paper's figure."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from loadgen.repro.registry import REPROS

    p = sub.add_parser(
        "repro",
        help="regenerate one paper's comparison into docs/results/<paper>/",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("paper", choices=sorted(REPROS))
    p.add_argument("--out", default=None, metavar="DIR", help="default: docs/results/<paper>")
    p.add_argument("--quick", action="store_true", help="short cells, one seed: a smoke test of the pipeline")
    p.add_argument("--engine", action="store_true", help="also run the CPU-engine cells (minutes each)")
    p.add_argument(
        "--only", action="append", default=[], metavar="GLOB", help="run only cells whose name matches (repeatable)"
    )
    p.add_argument("--seeds", type=int, default=None, help="replace every cell's seed count")
    p.add_argument(
        "--keep",
        action="store_true",
        help="read cells whose JSON is already in the output folder instead of re-running",
    )
    p.set_defaults(func=cmd_repro)


def cmd_repro(args: argparse.Namespace) -> int:
    from loadgen.repro.registry import REPROS
    from loadgen.repro.run import run_repro

    repro = REPROS[args.paper]
    out = Path(args.out or f"docs/results/{args.paper}")
    outcome = run_repro(
        repro, out, quick=args.quick, engine=args.engine, only=tuple(args.only), seeds=args.seeds, keep=args.keep
    )
    print("\n".join(outcome.readme))
    print(f"wrote {out}/README.md and {len(outcome.docs)} cell files", file=sys.stderr)
    return 0
