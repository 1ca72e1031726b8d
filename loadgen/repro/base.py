"""What one paper's reproduction is: cells to run, the paper's own numbers, and what is missing.

A `Cell` is one `tandem sim` (or `tandem loadgen compare --target inproc`, or a `tandem bench`
command such as `ellm-sim`) comparison given as its command line, so every cell can be re-run
by hand exactly as the repro ran it; the repro
writes each cell's compact result (config, summaries, ratios, seed spread, provenance; not the
per-request records) to `<out>/<cell>.json` and a README.md with the paper's figure beside
ours. `Repro` is the one interface every paper implements (`bros.py`, `symphony.py`,
`aptserve.py`, `ellm.py`); a paper whose setup is not built yet is a `Pending` repro, which
says so and runs nothing (`registry.py`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cell:
    name: str  # file stem under the output folder
    argv: tuple[str, ...]  # `tandem sim` / `tandem loadgen compare` options (no --out)
    policies: tuple[str, ...]  # the first is the baseline of the ratios
    engine: bool = False  # the CPU engine (inproc) rather than the simulator
    bench: str | None = None  # a `tandem bench` command that writes its own document (run.BENCHES)


@dataclass(frozen=True)
class PaperRow:
    """One number the paper states, and how to read ours for it."""

    label: str  # e.g. "ShareGPT: RT normalised latency vs vLLM"
    paper: str  # as the paper states it, e.g. "-74.20%"
    cell_prefix: str  # our cells whose ratios answer it (name prefix)
    policy: str
    baseline: str
    cls: str  # rt | be
    metric: str  # a `loadgen.spread.METRICS` key
    as_change: bool = True  # print ours as a % change (else as a factor)


@dataclass
class Outcome:
    """What a repro run produced: the cells' documents and the lines of its README."""

    docs: dict[str, dict] = field(default_factory=dict)
    readme: list[str] = field(default_factory=list)


class Repro(abc.ABC):
    name: str
    title: str

    @abc.abstractmethod
    def cells(self, *, quick: bool, engine: bool) -> list[Cell]:
        """The cells to run; `quick`: a minutes-long smoke version; `engine`: add CPU-engine cells."""

    @abc.abstractmethod
    def paper_rows(self) -> list[PaperRow]:
        """The paper's figure, as rows our cells answer."""

    def figure(self, docs: dict[str, dict]) -> list[str]:
        """README lines for a figure `paper_rows` cannot express (one metric's per-seed ratio
        in one cell): a table across cells, say (Symphony's users per latency bound). Default:
        none."""
        return []

    def not_implemented(self) -> list[str]:
        """Parts of the paper's comparison we cannot run yet, each a sentence."""
        return []

    def setup_notes(self) -> list[str]:
        """How our setup differs from the paper's (hardware, baselines), each a sentence."""
        return []


class Pending(Repro):
    """A paper whose simulator setup is being built elsewhere: says so, runs nothing."""

    def __init__(self, name: str, title: str, owner: str) -> None:
        self.name, self.title, self.owner = name, title, owner

    def cells(self, *, quick: bool, engine: bool) -> list[Cell]:
        return []

    def paper_rows(self) -> list[PaperRow]:
        return []

    def not_implemented(self) -> list[str]:
        return [
            f"pending: the {self.title} setup in the simulator is being built ({self.owner}); "
            f"it plugs in as a `Repro` in loadgen/repro/registry.py"
        ]
