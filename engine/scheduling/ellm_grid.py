"""The `ellm` optimiser's search over the ratios of `RATIO_GRID` (`engine.scheduling.ellm.choose`)
and its answer (`Choice`): each ratio's admitted count, with the priced admission bound
(`HoldPrice.pays`) decided only where it can change the answer, and each (ratio, count)'s step
and `b / T`. Split from `ellm.py` in the tenth session (docs/ellm.md, "Tenth session")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.scheduling.ellm_admission import RATIO_GRID
from engine.scheduling.prefix_pricing import cheaper_source, rebuild_step_seconds


@dataclass(frozen=True)
class Choice:
    batch: int  # b: the admission bound
    ratio: float  # r
    step_s: float  # the cost model's step time at (b, r)
    decision_s: float = 0.0  # wall time of the decision (published): candidates, host space, search
    decision_cpu_s: float = 0.0  # the same in this thread's CPU time (wall minus waiting for a core)
    rebuild_s: float = 0.0  # the part of step_s that the non-resident prefixes add (rebuilt or read)
    source: str = "rebuild"  # where the prefixes come from at this choice
    host_layers: int = 0  # with source "host": layers read from host (the rest rebuilt; all without a split)


class Grid:
    """`choose`'s search over the ratios, pricing the admission bound lazily (tenth session).

    Per ratio index `i` the search admits `lo[i]` candidates (FCFS's count at `r = 0`, the
    end-of-life bound at `r > 0`) or, where the priced admission pays (`pays(i, batch[i])`,
    `HoldPrice`), all `batch[i]` that fit the pool now. Deciding `pays` for every such ratio was
    ~half of the slow calls' time (docs/ellm.md, "Tenth session"), and only the ratios that can
    change the answer need it: each undecided ratio has two candidate values, at `lo[i]` and at `batch[i]`, and the
    answer is the first ratio of the largest `b / T` among the feasible ones. So `best` takes
    the first ratio of the largest *optimistic* value (an undecided ratio counts its better
    candidate); if that ratio is undecided it is decided and the argmax taken again; once the
    argmax is decided, every other ratio's true value is at most its optimistic one, below it
    (earlier ratios: strictly, being the first argmax) or equal at a later ratio, so it is the
    answer the full search gives. The search's range ends at the first ratio whose admitted
    count is every candidate (`full`), which deciding a ratio can move: a ratio whose place in
    the range hangs on an undecided earlier one counts optimistically too, and when it is the
    argmax the first such earlier ratio is decided. Same decisions as deciding every ratio
    (`tests/engine/scheduling/test_ellm_trace.py`)."""

    def __init__(self, s, u, batch, lo, pays, cost, sources, tpot_s) -> None:
        self.s, self.batch, self.lo, self.pays = s, batch, lo, pays
        self.cost, self.sources, self.tpot_s = cost, sources, tpot_s
        zero = np.zeros((u.shape[0], 1), dtype=np.int64)
        self._d = np.concatenate([[0], np.cumsum(s)])
        self._ln = np.concatenate([zero, np.cumsum(u, axis=1)], axis=1)
        self._pairs = np.concatenate([zero, np.cumsum(u * u, axis=1)], axis=1)
        self._rows = np.concatenate([zero, np.cumsum(u > 0, axis=1)], axis=1)
        self._decided: dict[int, int] = {}  # ratio index -> admitted count, where `pays` was asked
        self._values: dict[tuple[int, int], tuple[float, Choice | None]] = {}

    def undecided(self, i: int) -> bool:
        return self.pays is not None and i > 0 and self.lo[i] < self.batch[i] and i not in self._decided

    def admitted(self, i: int) -> int:
        """The admitted count at ratio index `i` (deciding `pays` there if it is open)."""
        if self.pays is None or i == 0 or self.lo[i] >= self.batch[i]:
            return int(self.lo[i])
        if i not in self._decided:
            self._decided[i] = int(self.batch[i]) if self.pays(i, int(self.batch[i])) else int(self.lo[i])
        return self._decided[i]

    def d_work(self, b: int) -> int:
        return int(self._d[b])

    def sums(self, i: int, b: int) -> tuple[int, int, int]:
        """(rows with a non-resident prefix, their prefix tokens, query-key pairs) of the first `b`."""
        return int(self._rows[i, b]), int(self._ln[i, b]), int(self._pairs[i, b])

    def rebuild_step(self, i: int, b: int) -> float:
        rows, p_ln, p_work = self.sums(i, b)
        return rebuild_step_seconds(self.cost, self.sources, b, self.d_work(b), rows, p_ln, p_work)

    def value(self, i: int, b: int) -> tuple[float, Choice | None]:
        """(b / T, the choice) of admitting `b` at ratio index `i`; (-inf, None) where it misses
        the TPOT target or admits nobody."""
        key = (i, b)
        if key not in self._values:
            out: tuple[float, Choice | None] = (-math.inf, None)
            if b:
                step = self.rebuild_step(i, b)
                if step <= self.tpot_s or self.sources.host:
                    exec_s = self.cost.estimate_sums(0, 0, b, self.d_work(b))
                    rows, p_ln, _ = self.sums(i, b)
                    step, source, layers = cheaper_source(exec_s, step, p_ln, rows, self.sources)
                    if step <= self.tpot_s:
                        choice = Choice(
                            b, RATIO_GRID[i], step, rebuild_s=step - exec_s, source=source, host_layers=layers
                        )
                        out = (b / step, choice)
            self._values[key] = out
        return self._values[key]

    def best(self, first: int) -> Choice | None:
        """The first ratio index from `first` up to the range's end (`choose`: the first ratio
        admitting every candidate, or `first` if that comes earlier) of the largest `b / T`
        (class docstring)."""
        n, end = self.s.size, len(RATIO_GRID) - 1
        full = [int(i) for i in np.flatnonzero(self.batch == n)]  # where admitting everyone is possible
        while True:
            # the range: up to the first ratio known to admit everyone; past the first one that may
            # (undecided), a ratio is in it only if every such earlier one turns out not to
            sure = next((i for i in full if not self.undecided(i) and self.admitted(i) == n), end)
            maybe = next((i for i in full if self.undecided(i)), end)
            top, arg = -math.inf, -1
            for i in range(first, max(min(sure, end), first) + 1):
                if self.undecided(i):
                    v = max(self.value(i, int(self.lo[i]))[0], self.value(i, int(self.batch[i]))[0])
                else:
                    v = self.value(i, self.admitted(i))[0]
                if v > top:
                    top, arg = v, i
            if arg < 0:
                return None
            if self.undecided(arg):
                self.admitted(arg)  # decide it and look again
            elif arg > max(maybe, first):
                self.admitted(maybe)  # whether it is in the range hangs on an earlier ratio
            else:
                return self.value(arg, self.admitted(arg))[1]
