"""`tandem chaos`: the command line of the chaos harness (loadgen/chaos/run.py)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from loadgen.bench.common import write_json
from loadgen.provenance import stamp


def add_parser(sub: argparse._SubParsersAction) -> None:
    from loadgen.chaos.run import PAIRS, SINGLE

    p = sub.add_parser(
        "chaos",
        help="SIGKILL each service (and pairs) under RT streams and batch jobs; count losses and recovery",
        description="Start a stack (harness-supervised), kill services in turn, report losses and recovery times.",
    )
    p.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'default', or a path")
    p.add_argument(
        "--faults",
        default=",".join(SINGLE + PAIRS),
        help="comma-separated fault kinds (gateway, scheduler, queue, advisory, worker, broker) or pairs a+b",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rt-clients", type=int, default=2)
    p.add_argument("--batch-items", type=int, default=24, help="items of the job submitted before each fault")
    p.add_argument("--restart-delay", type=float, default=1.0, help="seconds between a kill and the restart")
    p.add_argument(
        "--ha",
        action="store_true",
        help="run the scheduler, advisory and queue as active/standby pairs; a fault kills the active one",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="children's logs (default: beside the JSON, <json>.logs/, else ./chaos-logs/<UTC time>/); kept",
    )
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from loadgen.bench.gateway import _tiny_model
    from loadgen.chaos.run import ChaosConfig, run_chaos

    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    cfg = ChaosConfig(
        faults=faults,
        repeats=args.repeats,
        rt_clients=args.rt_clients,
        batch_items=args.batch_items,
        restart_delay_s=args.restart_delay,
        ha=args.ha,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(tmp) if args.model == "tiny" else args.model
        log_dir = _log_dir(args)
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"tandem chaos: children's logs in {log_dir}", file=sys.stderr)
        try:
            result = uvloop.run(run_chaos(cfg, model, log_dir))
        except ValueError as exc:
            print(f"tandem chaos: {exc}", file=sys.stderr)
            return 2
    result["model"] = args.model
    result["provenance"] = stamp(dtype="float32").as_dict()
    print(json.dumps({k: result[k] for k in ("baseline_probe_s", "faults", "rt", "batch", "crashed")}, indent=1))
    result["log_dir"] = str(log_dir)
    write_json(result, args.json)
    return 0


def _log_dir(args: argparse.Namespace) -> Path:
    """Where the children's logs go: kept with the results, never in a temporary directory (the
    `--ha` stall of session 6 could not be diagnosed because its logs were in /tmp and gone)."""
    if args.log_dir:
        return Path(args.log_dir)
    if args.json:
        return Path(args.json).with_suffix(".logs")
    return Path("chaos-logs") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
