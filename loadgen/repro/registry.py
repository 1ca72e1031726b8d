"""The papers `tandem repro` knows, by name (a paper whose setup is not built yet would be a
`Pending` entry, which says so and runs nothing)."""

from __future__ import annotations

from loadgen.repro.aptserve import AptServeRepro
from loadgen.repro.base import Repro
from loadgen.repro.bros import BROSRepro
from loadgen.repro.ellm import EllmRepro
from loadgen.repro.symphony import SymphonyRepro

REPROS: dict[str, Repro] = {
    "bros": BROSRepro(),
    "symphony": SymphonyRepro(),
    "aptserve": AptServeRepro(),
    "ellm": EllmRepro(),
}
