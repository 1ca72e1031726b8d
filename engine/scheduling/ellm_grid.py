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

# `_bounds`' relative margin: a step's scalar price rounds a handful of times (~1e-16 each)
BOUND_MARGIN = 1e-12
_BOTH = np.arange(2 * len(RATIO_GRID)) % len(RATIO_GRID)  # `_bounds`' ratio index per entry
SHORT_RANGE = 3  # ratios: a range this short is priced whole (the bounds' arrays would cost more)


def non_negative(cost, sources) -> bool:
    """Whether every term a step's price adds is non-negative (`Grid._bounds` holds only then):
    both phase fits, the measured rebuild and prefix-step penalties, the copy price."""
    fits = [cost.prefill, cost.decode]
    terms = [f.alpha0 for f in fits] + [f.alpha1 for f in fits] + [f.beta for f in fits]
    for step in (cost.rebuild_step, sources.step):
        if step is not None:
            terms += [step.overhead_s, step.per_row_s, step.per_token_s, step.per_pair_s]
    return min(terms) >= 0 and sources.copy_s_per_token >= 0


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
    prune_default = True  # the bounded argmax (off: price every ratio, as before; tests and A/B)

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
        u = u[:, : int(batch.max())]  # no count the search asks about is larger
        self._d = np.concatenate([[0], np.cumsum(s[: u.shape[1]])])
        # prefix sums of (prefix tokens, their query-key pairs, rows with one), one array
        sums = np.zeros((3, u.shape[0], u.shape[1] + 1), dtype=np.int64)
        np.cumsum(np.stack([u, u * u, u > 0]), axis=2, out=sums[:, :, 1:])
        self._ln, self._pairs, self._rows = sums
        self._decided: dict[int, int] = {}  # ratio index -> admitted count, where `pays` was asked
        self._batch = batch.tolist()
        # where the admitted count hangs on `pays` (decided or not): r > 0 and the bound below the pool
        pairs = enumerate(zip(lo.tolist(), self._batch))
        self._open = [pays is not None and i > 0 and lo_i < b_i for i, (lo_i, b_i) in pairs]
        self._ub: tuple | None = None  # `_bounds`, made on first use
        self.prune = self.prune_default and non_negative(cost, sources)
        self.priced = 0  # ratios `_argmax` priced (tests: the bounds do skip some)
        self._values: dict[tuple[int, int], tuple[float, Choice | None]] = {}

    def undecided(self, i: int) -> bool:
        return self._open[i] and i not in self._decided

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

    def _optimistic(self, i: int) -> float:
        """Ratio index `i`'s value: at its admitted count, or the better of its two while undecided."""
        if self.undecided(i):
            return max(self.value(i, int(self.lo[i]))[0], self.value(i, int(self.batch[i]))[0])
        return self.value(i, self.admitted(i))[0]

    def _argmax(self, first: int, last: int) -> tuple[float, int]:
        """(the largest `_optimistic` value over ratio indices `first..last`, the first index
        holding it; -1 if none is feasible). Ratios are priced in the order of their upper
        bounds (`_bounds`), largest first, and the scan stops where no bound left can beat
        or tie-and-precede the best priced so far: the same answer as pricing every ratio."""
        if not self.prune or last - first < SHORT_RANGE:
            top, arg = -math.inf, -1
            for i in range(first, last + 1):
                v = self._optimistic(i)
                if v > top:
                    top, arg = v, i
            return top, arg
        lo_ub, hi_ub = self._bounds()
        decided, batch = self._decided, self._batch
        order = []  # (-bound, index): the largest bound first, then the first index
        for i in range(first, last + 1):
            if self._open[i] and i not in decided:
                order.append((-max(lo_ub[i], hi_ub[i]), i))
            else:
                order.append((-(hi_ub[i] if decided.get(i) == batch[i] else lo_ub[i]), i))
        order.sort()
        top, arg = -math.inf, -1
        for neg, i in order:
            if -neg < top or (-neg == top and i > arg):
                break  # every ratio left is bounded below the best, or ties it at a later index
            v = self._optimistic(i)
            self.priced += 1
            if v > top or (v == top and i < arg):
                top, arg = v, i
        return top, arg

    def _bounds(self) -> tuple[list[float], list[float]]:
        """Per ratio index, an upper bound on `b / T` at its two possible admitted counts
        (`lo`, `batch`). A step the search prices is never below the `b` decode rows' step
        without prefixes (every source adds non-negative terms: a copy, a rebuild, a
        measured penalty), nor, where the prefixes cannot come from host (no host source or
        more prefix tokens than the host space, which `cheaper_source` prices as a rebuild),
        below that step plus the rebuild's own terms. The bound is `b` over that lower step
        less a relative margin far above the few roundings of the scalar prices; -inf where
        the lower step already misses the TPOT target. With a negative coefficient in the
        profile no bound holds and every ratio is priced (`prune` off)."""
        if self._ub is None:
            both = self._bound_at(np.concatenate([self.lo, self.batch]))
            self._ub = both[: self.lo.size], both[self.lo.size :]
        return self._ub

    def _bound_at(self, counts: np.ndarray) -> list[float]:
        """`_bounds` at `counts`: ratio index `k % len(RATIO_GRID)` admitting `counts[k]`."""
        cost, src, d = self.cost, self.sources, self.cost.decode
        idx = _BOTH if counts.size == _BOTH.size else np.arange(counts.size) % len(RATIO_GRID)
        tokens = self._ln[idx, counts]
        # the step without prefixes, as `value` prices it (`estimate_sums(0, 0, b, work)`: the
        # same IEEE operations in the same order, so the same double)
        step = d.alpha0 * counts + d.alpha1 * self._d[counts] + d.beta
        host = tokens <= src.host_capacity_tokens if src.host else np.zeros(counts.size, dtype=bool)
        rebuilt = (tokens > 0) & ~host  # `cheaper_source` prices these as a rebuild
        # exact: the priced step is this double plus non-negative terms, added (never below it
        # in floating point either), so equal bounds tie exactly; a rebuild priced as prefill
        # rows (`P + D - shared`) or a layer split's arrays may round below it by an ulp
        if not src.layer_split and (cost.rebuild_step is not None or not src.rebuild):
            lower = step  # host reads and prefix-free steps are exact; rebuilt ones are set below
        else:
            lower = np.where(tokens == 0, step, step * (1 - BOUND_MARGIN))
        if rebuilt.any():
            pairs = self._pairs[idx, counts].astype(np.float64)
            if cost.rebuild_step is not None:
                f = cost.rebuild_step
                extra = f.overhead_s + f.per_row_s * self._rows[idx, counts] + f.per_token_s * tokens
                extra = extra + f.per_pair_s * pairs
            else:
                p = cost.prefill
                extra = p.alpha0 * tokens + p.alpha1 * pairs + (p.beta - min(p.beta, d.beta))
            lower = np.where(rebuilt, (step + extra) * (1 - BOUND_MARGIN), lower)
        ub = np.full(counts.size, -math.inf)
        np.divide(counts, lower, out=ub, where=(lower <= self.tpot_s) & (counts > 0))
        return ub.tolist()

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
            top, arg = self._argmax(first, max(min(sure, end), first))
            if arg < 0:
                return None
            if self.undecided(arg):
                self.admitted(arg)  # decide it and look again
            elif arg > max(maybe, first):
                # whether it is in the range hangs on earlier ratios: decide them in order until
                # one admits everyone. One at a time with a search after each, as before, gives
                # the same calls: a ratio before the argmax stays below it once decided, so the
                # argmax stays `arg` until the range's end moves
                for i in full:
                    if i >= arg or (self.undecided(i) and self.admitted(i) == n):
                        break
            else:
                return self.value(arg, self.admitted(arg))[1]
