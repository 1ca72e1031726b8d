"""One small deterministic simulator cell pinned against its committed JSON.

The cell: BROS vs the papers' vLLM on the OPT-13B/A100 profile, RT + BE at 2 req/s for 40 s,
one seed, with the fair simulator's defaults (fitted planning model, 5% step noise, 4 GiB
host swap). It runs in about ten seconds. Any change to the scheduler, the KV manager, the
simulator, the noise or the metrics that moves a number shows up as a diff against
`tests/loadgen/golden/bros-cell.json`; when the change is meant, regenerate with
`python -m loadgen.repro.golden` and commit the new file with the change, saying why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loadgen.repro.base import Cell

CELL = Cell(
    "golden-bros",
    ("--workload", "rt-be", "--rate", "2", "--duration", "40", "--be-batch", "16", "--cost-model", "opt-13b-a100-40gb"),
    ("fcfs-prefill-first", "bros"),
)
PATH = Path(__file__).resolve().parents[2] / "tests" / "loadgen" / "golden" / "bros-cell.json"


def golden_doc() -> dict:
    """The cell's numbers: summaries and ratios (no provenance, timestamps or host facts)."""
    from loadgen.repro.run import run_cell

    doc = run_cell(CELL)
    steps = {name: {k: t[k] for k in ("steps", "busy_s")} for name, t in doc["targets"].items()}
    return json.loads(json.dumps({"summary": doc["summary"], "ratios": doc["ratios"], "steps": steps}))


def main() -> int:
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(json.dumps(golden_doc(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
