"""eLLM's admission commitment and step-chunk pricing (docs/ellm.md, "Seventh session"), the
array helpers `engine.scheduling.ellm.choose` runs per ratio of `RATIO_GRID`: which candidates
may be admitted at a non-resident ratio r > 0 so that none is preempted for its growth while r
holds (`hysteresis`, over each candidate's projected end, `final_length`), and what the prefill
chunks FCFS adds to a step cost (`chunk_seconds`). Kept apart from the policy so `ellm.py` holds
the search and the policy, this module the rules they apply."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.cost_model import CostModel
from engine.scheduling.prefix_pricing import PrefixSources
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
) -> tuple[np.ndarray, int]:
    """(admission bound per ratio, floor index) under the commitment rule of `engine.scheduling.ellm.choose`: from
    `r > 0` on, admit only what fits at its projected end (pool, and host space when the
    host may serve the prefixes), never fewer than the running requests; the floor is the
    first ratio whose bound (at today's contexts) holds every running request."""
    f = np.asarray(final_contexts, dtype=np.int64)
    u_end = prefix_tokens(f, bs)
    fits = np.cumsum(-(-(f[None, :] - u_end) // bs) * bs, axis=1) <= capacity_tokens
    if sources.host:  # past the host space a prefix is rebuilt: a commitment must not count on that
        fits &= np.cumsum(u_end, axis=1) <= sources.host_capacity_tokens
    end_bound = fits.sum(axis=1)
    committed = np.minimum(batch, np.maximum(end_bound, running))
    committed[0] = batch[0]  # r = 0: FCFS's own admission
    holds = np.flatnonzero(batch >= running)
    floor = int(holds[0]) if holds.size else len(RATIO_GRID) - 1
    return committed, floor
