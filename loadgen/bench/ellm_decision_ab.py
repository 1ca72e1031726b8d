"""`tandem bench ellm-decision-ab`: the `ellm` policy's decision time inside a simulator run,
two checkouts alternated in one run (a same-moment comparison on a shared machine).

Each round runs the decision-time cell of docs/ellm.md (`bench ellm-sim --policies ellm`:
the paper's 13B/A100 profile with a x1000 host link, TPOT 50 ms, 64 GiB of host space, the host
source, rate 2, 120 s of arrivals, seed 1) once per checkout, the order swapped every round, each
in its own process with that checkout's code (`PYTHONPATH`), so the two share the machine's
load. `--cell rate16` runs the long-queue cell instead (the 16 req/s run at the paper's 40 GB
host with FLOPs-priced attention: 256 candidates a step; twelfth session). The simulator's
clock is virtual, so two checkouts that decide the same give the same throughput and TTFT:
the document says whether they did. It records, per run, the policy's
published decision time (`DecisionStats`: CPU time of the whole decision, candidates included;
p50/p99 over the last 4,096 decisions, mean and max over all), the run's wall time and the load
average before and after, and each run's own provenance stamp (its checkout's commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CELL = [
    "bench", "ellm-sim", "--policies", "ellm", "--rates", "2", "--seeds", "1", "--seed", "1",
    "--prefix-source", "host", "--slo-tpot", "0.05", "--swap-space-gib", "64",
    "--cost-model", "docs/results/ellm/paper-13b-a100-link-x1000-profile.json",
]  # fmt: skip
# the long-queue cell (twelfth session): the eleventh session's 16 req/s run at the paper's 40 GB
# host with decode attention priced by FLOPs, where the candidate list is full (256) every step
LONG_QUEUE = [
    "bench", "ellm-sim", "--policies", "ellm", "--rates", "16", "--seeds", "1", "--seed", "1",
    "--prefix-source", "host", "--slo-tpot", "0.05", "--swap-space-gib", "37.25",
    "--cost-model", "docs/results/ellm/paper-13b-a100-link-x1000-flops-attention-profile.json",
]  # fmt: skip
CELLS = {"rate2": CELL, "rate16": LONG_QUEUE}
SAME = ("output_tokens_per_s", "completed", "ttft_mean_s", "tpot_attainment")  # equal if the decisions are
TIMES = ("p50_decision_cpu_s", "p99_decision_cpu_s", "mean_decision_cpu_s", "max_decision_cpu_s", "p99_decision_s")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ellm-decision-ab",
        help="ellm's in-run decision time, two checkouts alternated in one run",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--old", required=True, help="the other checkout (a git worktree at the old commit)")
    p.add_argument("--new", default=".", help="this checkout (default: the current directory)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run (the cell: 120)")
    p.add_argument(
        "--cell", choices=sorted(CELLS), default="rate2",
        help="rate2: the decision-time cell (default); rate16: the long-queue cell (256 candidates)",
    )  # fmt: skip
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE")
    p.set_defaults(func=run)


def one_run(tree: Path, duration: float, cell: list[str] = CELL) -> dict:
    """The cell once with `tree`'s code: its `ellm` decisions, the metrics, its stamp."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        env = dict(os.environ, PYTHONPATH=str(tree))
        load_before = os.getloadavg()
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "services.cli", *cell, "--duration", str(duration), "--json", str(out)],
            cwd=tree,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.monotonic() - start
        doc = json.loads(out.read_text())
    (rate,) = doc["rates"].values()  # the cell runs one rate
    run = rate["per_seed"]["ellm"][0]
    return {
        "decisions": run["decisions"],
        "metrics": {k: run[k] for k in SAME},
        "wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "provenance": doc["provenance"],
    }


def run(args: argparse.Namespace) -> int:
    from loadgen.bench.common import write_json
    from loadgen.provenance import stamp

    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    prov = stamp(extra={"bench": "ellm-decision-ab"}).as_dict()
    rounds = []
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        rounds.append({name: one_run(trees[name], args.duration, CELLS[args.cell]) for name in order})
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{n} p50/p99 CPU {rounds[-1][n]['decisions']['p50_decision_cpu_s'] * 1e3:.3f}/"
                f"{rounds[-1][n]['decisions']['p99_decision_cpu_s'] * 1e3:.3f} ms"
                for n in order
            ),
            flush=True,
        )
    summary = {name: {k: statistics.median(rd[name]["decisions"][k] for rd in rounds) for k in TIMES} for name in trees}
    doc = {
        "bench": "ellm-decision-ab",
        "cell": [*CELLS[args.cell], "--duration", str(args.duration)],
        "cell_name": args.cell,
        "trees": {n: str(t) for n, t in trees.items()},
        "commits": {n: rounds[0][n]["provenance"]["git"] for n in trees},
        "same_outcome": all(rd["old"]["metrics"] == rd["new"]["metrics"] for rd in rounds),
        "median_over_rounds": summary,
        "rounds": rounds,
        "provenance": prov,
    }
    write_json(doc, args.json_path)
    return 0
