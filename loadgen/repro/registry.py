"""The papers `tandem repro` knows, by name. Apt-Serve's and eLLM's setups are being built in
their engineers' worktrees; each replaces its `Pending` entry with its `Repro` class here."""

from __future__ import annotations

from loadgen.repro.base import Pending, Repro
from loadgen.repro.bros import BROSRepro
from loadgen.repro.symphony import SymphonyRepro

REPROS: dict[str, Repro] = {
    "bros": BROSRepro(),
    "symphony": SymphonyRepro(),
    "aptserve": Pending("aptserve", "Apt-Serve (hybrid KV + hidden cache)", "issue 17, worktree /work/wt/apt"),
    "ellm": Pending("ellm", "eLLM (partial KV residency)", "issue 18, worktree /work/wt/ellm"),
}
