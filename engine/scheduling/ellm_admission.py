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
    tokens = np.concatenate([[0], np.cumsum(p)])[batch]
    work = np.concatenate([[0], np.cumsum(p * s)])[batch].astype(np.float64)
    chunk = np.minimum(tokens, budget)
    shared = min(cost.prefill.beta, cost.decode.beta)
    for i in np.flatnonzero(chunk):
        pair_work = work[i] * chunk[i] / tokens[i]
        out[i] = cost.prefill.predict_work(float(chunk[i]), pair_work) - shared
    return out


def final_length(request: Request) -> int:
    """A request's projected length when it ends: its prompt plus `max_tokens`, within its
    context limit. The admission rule's projection; an upper bound (a stop or EOS ends it
    sooner), so it errs toward admitting less at `r > 0`, never toward a preemption."""
    end = request.num_prompt_tokens + request.params.max_tokens
    limit = request.max_model_len
    return max(request.num_tokens, min(end, limit) if limit else end)


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
    fits = np.cumsum(-(-(f[None, :] - u_end) // bs) * bs, axis=1) <= capacity_tokens
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
    rem = np.maximum(finals - contexts, 1)
    t = np.unique(rem) - 1
    live = rem[None, :] > t[:, None]
    rows = live.sum(axis=1)
    tokens = (live * (contexts[None, :] + t[:, None])).sum(axis=1)
    need = (1 - _RATIOS[:, None]) * tokens[None, :] + 2 * bs * rows[None, :]
    return rows, tokens, need.argmax(axis=1)


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
    the hold costs no more than the preemption."""

    cost: CostModel
    sources: PrefixSources
    contexts: np.ndarray  # the candidates' tokens now
    finals: np.ndarray  # ... and at their projected end
    capacity_tokens: int
    block_size: int
    _peaks: dict = field(default_factory=dict)  # b -> peak_need of the first b (ratios share their b)

    def pays(self, i: int, b: int) -> bool:
        s, f = self.contexts[:b], self.finals[:b]
        if b not in self._peaks:
            self._peaks[b] = peak_need(s, f, self.block_size)
        rows, tokens, peak = self._peaks[b]
        ratios = np.array(RATIO_GRID[i:])
        at = peak[i:]
        fits = (1 - ratios) * tokens[at] + 2 * self.block_size * rows[at] <= self.capacity_tokens
        if self.sources.host:
            fits &= ratios * tokens[at] <= self.sources.host_capacity_tokens
        if not fits.any():
            return False  # no ratio holds it: a preemption will come
        j = int(np.flatnonzero(fits)[0])
        if j == 0:
            return True  # r itself holds it: the end-of-life bound was only conservative
        r, n, work = ratios[j], int(rows[at[j]]), int(tokens[at[j]])
        prefix = int(r * work) // self.block_size * self.block_size
        per_row = prefix // max(n, 1)
        step = step_seconds(self.cost, self.sources, n, work, n if prefix else 0, prefix, per_row * prefix)
        hold = (step - self.cost.estimate_sums(0, 0, n, work)) * float((f - s).mean())
        r_i, k = RATIO_GRID[i], int(peak[i])
        over = max(0.0, (1 - r_i) * tokens[k] + 2 * self.block_size * rows[k] - self.capacity_tokens) / (1 - r_i)
        recompute = self.cost.prefill.predict(over, tokens[k] / max(rows[k], 1) / 2) if over else 0.0
        return hold <= recompute
