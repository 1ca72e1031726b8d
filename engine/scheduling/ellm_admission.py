"""eLLM's admission commitment and step-chunk pricing (docs/ellm.md, "Seventh session" and
"Eighth session"), the array helpers `engine.scheduling.ellm.choose` runs per ratio of
`RATIO_GRID`: which candidates may be admitted at a non-resident ratio r > 0 so that none is
preempted for its growth while r holds (`hysteresis`, over each candidate's projected end,
`final_length`), where admitting past that bound pays because a later ratio holds the set
through its future for less than the recompute the bound protects against (`HoldPrice`,
`peak_need`), and what the prefill chunks FCFS adds to a step cost (`chunk_seconds`). Kept
apart from the policy so `ellm.py` holds the search and the policy, this module the rules
they apply."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.cost_model import CostModel
from engine.scheduling.prefix_pricing import PrefixSources, step_seconds
from engine.scheduling.request import Request

RATIO_GRID = tuple(i / 20 for i in range(19))  # 0, 0.05, ..., 0.9
_RATIOS = np.array(RATIO_GRID, dtype=np.float64)


def chunk_seconds(
    cost: CostModel, s: np.ndarray, pending: Sequence[int] | None, budget: int, batch: np.ndarray
) -> np.ndarray:
    """Per ratio, what the prefill chunks of the first `batch[i]` candidates add to the step
    (`engine.scheduling.ellm.choose`'s docstring): a prefill phase of `min(Σ pending, budget)` tokens, its work
    `Σ pending·context` scaled to that share, less the fixed cost the step already pays."""
    out = np.zeros(batch.shape, dtype=np.float64)
    if pending is None or budget <= 0:
        return out
    p = np.asarray(pending[: s.size], dtype=np.int64)
    p = np.where(p > 1, p, 0)
    if not p.any():
        return out
    shared = min(cost.prefill.beta, cost.decode.beta)
    if batch.size == 1:  # `choose` prices the chosen pair only: two sums, not two prefix-sum arrays
        b = int(batch[0])
        tokens, work = int(p[:b].sum()), float(int((p[:b] * s[:b]).sum()))
        chunk = min(tokens, budget)
        if chunk:
            out[0] = cost.prefill.predict_work(float(chunk), work * chunk / tokens) - shared
        return out
    tokens = np.concatenate([[0], np.cumsum(p)])[batch]
    work = np.concatenate([[0], np.cumsum(p * s)])[batch].astype(np.float64)
    chunk = np.minimum(tokens, budget)
    for i in np.flatnonzero(chunk):
        pair_work = work[i] * chunk[i] / tokens[i]
        out[i] = cost.prefill.predict_work(float(chunk[i]), pair_work) - shared
    return out


def final_length(request: Request, now: int | None = None) -> int:
    """A request's projected length when it ends: its prompt plus `max_tokens`, within its
    context limit. The admission rule's projection; an upper bound (a stop or EOS ends it
    sooner), so it errs toward admitting less at `r > 0`, never toward a preemption. It is
    never below the length now (`now`, default the request's; the policy passes 0 to keep
    the fixed part per request and takes the larger of the two each step)."""
    end = request.num_prompt_tokens + request.params.max_tokens
    limit = request.max_model_len
    return max(request.num_tokens if now is None else now, min(end, limit) if limit else end)


def prefix_tokens(contexts: np.ndarray, bs: int) -> np.ndarray:
    """Non-resident tokens per (ratio, candidate): whole computed blocks, as the component."""
    return (np.floor(_RATIOS[:, None] * (contexts - 1)[None, :]).astype(np.int64) // bs) * bs


def hysteresis(
    batch: np.ndarray,
    final_contexts: Sequence[int],
    capacity_tokens: int,
    bs: int,
    sources: PrefixSources,
    running: int,
    pays: Callable[[int, int], bool] | None = None,
) -> tuple[np.ndarray, int]:
    """(admission bound per ratio, floor index) under the commitment rule of `engine.scheduling.ellm.choose`: from
    `r > 0` on, admit only what fits at its projected end (pool, and host space when the
    host may serve the prefixes), never fewer than the running requests; the floor is the
    first ratio whose bound (at today's contexts) holds every running request.

    The bound is priced (`pays(i, b)`, `HoldPrice`): at ratio index
    `i` the whole set the search would admit, the first `batch[i]` candidates, is admitted
    where some ratio from `i` up holds it through its future (`peak_need`) and that hold costs
    less than recomputing what the pool at `i` would not hold. The bound protects against a
    recompute preemption; where raising `r` later keeps the set for less (a fast link whose
    copy hides under the step, a CPU's in-place read), the per-step search does raise it as
    the contexts grow, nothing is preempted, and refusing the candidates would only make them
    queue (docs/ellm.md, "Eighth session").
    """
    f = np.asarray(final_contexts, dtype=np.int64)
    u_end = prefix_tokens(f, bs)
    fits = np.cumsum((-(-f // bs) * bs)[None, :] - u_end, axis=1) <= capacity_tokens  # as `choose`'s need
    if sources.host:  # past the host space a prefix is rebuilt: a commitment must not count on that
        fits &= np.cumsum(u_end, axis=1) <= sources.host_capacity_tokens
    end_bound = fits.sum(axis=1)
    committed = np.minimum(batch, np.maximum(end_bound, running))
    committed[0] = batch[0]  # r = 0: FCFS's own admission
    if pays is not None:
        for i in np.flatnonzero(committed[1:] < batch[1:]) + 1:
            if pays(int(i), int(batch[i])):
                committed[i] = batch[i]
    holds = np.flatnonzero(batch >= running)
    floor = int(holds[0]) if holds.size else len(RATIO_GRID) - 1
    return committed, floor


def peak_need(contexts: np.ndarray, finals: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The set's future as it decodes (one token per step each, leaving at its projected end),
    at the step before each request ends (where the live contexts peak between departures):
    per such point, (live rows, live context tokens), and per ratio of `RATIO_GRID` the point
    of the largest resident need `(1 - r)·tokens + 2·bs·rows` (an upper bound on the component's
    whole-block need, which rounds the prefix down and the rest up to a block).
    Unlike "every request at its end at once" this counts that the long requests outlive
    the short ones."""
    rows, tokens = PrefixFutures(contexts, finals).of(len(contexts))
    return rows, tokens, peak_points(rows, tokens, bs)


def peak_points(rows: np.ndarray, tokens: np.ndarray, bs: int) -> np.ndarray:
    """Per ratio of `RATIO_GRID`, the point of the largest resident need (`peak_need`)."""
    need = (1 - _RATIOS[:, None]) * tokens[None, :] + 2 * bs * rows[None, :]
    return need.argmax(axis=1)


class PrefixFutures:
    """`peak_need`'s points for every FCFS prefix of the candidates at once (the sets the
    search admits are the first `b` candidates, a different `b` per ratio): one pass over the
    departure points of all of them, cumulative along the candidates. For the first `b` the
    points of the others are extra; they never move the peak, because between two of the set's
    own departures its need rises strictly (every live row grows by a token a step, and
    `1 − r > 0`) and after its last departure it is 0, so the largest need lies on one of its
    own points, and the first such in time is the first either way (the points are sorted).
    So `peak_need` of the first `b` and this one's `of(b)` pick the same (rows, tokens) per
    ratio (a test checks it); the search pays one matrix instead of one per distinct `b`."""

    def __init__(self, contexts: np.ndarray, finals: np.ndarray) -> None:
        self._contexts = contexts
        self._rem = np.maximum(finals - contexts, 1)
        self._t = np.unique(self._rem) - 1

    def of(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(live rows, live context tokens) per point for the first `b` candidates: at point
        `t` the rows still running are those with more than `t` steps left, and their tokens
        are their contexts now plus `t` each. Counted from the `b` sorted by steps left (one
        search per point, integers, so the same numbers as a `points x b` mask summed; a
        search rather than the mask since the eleventh session: the mask was the largest
        single cost of the slow decisions)."""
        rem, c = self._rem[:b], self._contexts[:b]
        order = np.argsort(rem, kind="stable")
        gone = np.searchsorted(rem[order], self._t, side="right")  # rows with at most t steps left
        live_c = np.concatenate([np.cumsum(c[order][::-1])[::-1], [0]])  # Σ contexts from k on
        rows = b - gone
        return rows, live_c[gone] + self._t * rows


@dataclass(frozen=True)
class HoldPrice:
    """Whether admitting a set at a ratio `r > 0` past the end-of-life bound pays
    (`hysteresis`'s `pays`), from the cost model. The set's future (`peak_need`: the step
    before each request ends) needs at its peak some ratio `r' >= r` that fits the pool and
    the host space; the *hold* is what keeping those prefixes out of the pool adds to that
    peak step (the step at `r'` less the same rows fully resident: a copy not hidden under
    the step, or a rebuild), paid at every step for the set's mean remaining output; the
    *preemption* it protects against is a prefill of the contexts the pool at `r` would not
    hold at that peak (the victims' prompts and outputs so far, computed again). Admit when
    the hold costs no more than the preemption.

    The held rows' own decode time counts too (ninth session): admitting past the bound is a
    commitment the per-step search cannot undo (its `b` bounds admission; running requests are
    not preempted to reach it), so the set is admitted only where its peak step, every live
    row decoding over its whole context plus the prefixes at the holding ratio, meets the TPOT
    target (`tpot_s`). Without it, at a 50 ms SLO where a full pool's step is already at the
    target, sets whose hold was free made the later steps miss it (docs/ellm.md, "Ninth
    session")."""

    cost: CostModel
    sources: PrefixSources
    contexts: np.ndarray  # the candidates' tokens now
    finals: np.ndarray  # ... and at their projected end
    capacity_tokens: int
    block_size: int
    tpot_s: float = math.inf  # the TPOT target the held set's peak step must meet
    _plans: dict = field(default_factory=dict)  # b -> _SetPlan of the first b (ratios share their b)
    _futures: list = field(default_factory=list)  # [PrefixFutures of every candidate], made on first use

    def pays(self, i: int, b: int) -> bool:
        plan = self._plans.get(b)
        if plan is None:
            plan = self._plans[b] = _SetPlan.of(self, b)
        j = plan.holds_from[i]  # the least ratio index >= i that holds the set at its peak
        if j < 0:
            return False  # no ratio holds it: a preemption will come
        step, exec_s = plan.step(self, j)
        if step > self.tpot_s:
            return False  # the held rows' steps would miss the target for the set's future
        if j == i:
            return True  # r itself holds it: the end-of-life bound was only conservative
        hold = (step - exec_s) * plan.mean_remaining
        return hold <= plan.recompute(self, i)


@dataclass
class _SetPlan:
    """What `HoldPrice.pays` needs about one admitted set (the first `b` candidates), computed
    once per set and shared by every ratio that admits it: the set's future peaks per ratio
    (`peak_need`), for each ratio index the least index from it up whose ratio holds the set
    at its peak (pool and host space; -1 if none), and the peak steps priced so far. The
    per-ratio answers are the same arithmetic as one call per ratio did before (ninth
    session: the decision-time tail), done as one vector op per set."""

    rows: np.ndarray
    tokens: np.ndarray
    peak: np.ndarray
    holds_from: list[int]
    mean_remaining: float
    _steps: dict = field(default_factory=dict)  # ratio index -> (peak step, same rows fully resident)

    @classmethod
    def of(cls, price: HoldPrice, b: int) -> _SetPlan:
        s, f = price.contexts[:b], price.finals[:b]
        if not price._futures:
            price._futures.append(PrefixFutures(price.contexts, price.finals))
        rows, tokens = price._futures[0].of(b)
        peak = peak_points(rows, tokens, price.block_size)
        t, n = tokens[peak], rows[peak]
        fits = (1 - _RATIOS) * t + 2 * price.block_size * n <= price.capacity_tokens
        if price.sources.host:
            fits &= _RATIOS * t <= price.sources.host_capacity_tokens
        holds_from, nxt = [-1] * len(RATIO_GRID), -1
        for k in range(len(RATIO_GRID) - 1, -1, -1):
            nxt = k if fits[k] else nxt
            holds_from[k] = nxt
        return cls(rows, tokens, peak, holds_from, float((f - s).mean()))

    def step(self, price: HoldPrice, j: int) -> tuple[float, float]:
        """(the peak step at ratio index `j` with its prefixes from the cheaper source, the
        same rows fully resident)."""
        if j not in self._steps:
            r, k = _RATIOS[j], self.peak[j]
            n, work = int(self.rows[k]), int(self.tokens[k])
            prefix = int(r * work) // price.block_size * price.block_size
            per_row = prefix // max(n, 1)
            step = step_seconds(price.cost, price.sources, n, work, n if prefix else 0, prefix, per_row * prefix)
            self._steps[j] = (step, price.cost.estimate_sums(0, 0, n, work))
        return self._steps[j]

    def recompute(self, price: HoldPrice, i: int) -> float:
        """A prefill of the contexts the pool at ratio index `i` would not hold at its peak."""
        r_i, k = RATIO_GRID[i], int(self.peak[i])
        tokens, rows = self.tokens[k], self.rows[k]
        over = max(0.0, (1 - r_i) * tokens + 2 * price.block_size * rows - price.capacity_tokens) / (1 - r_i)
        return price.cost.prefill.predict(over, tokens / max(rows, 1) / 2) if over else 0.0
