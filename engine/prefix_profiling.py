"""Measure what a host-read prefix step really costs (eLLM's partial residency), for the cost model.

A step in which some rows read their oldest tokens' K/V from host swap space
(`engine/rebuilt_prefix.py`) may pay more than the copy. Read through a per-layer scratch
(`prefix_read` "copy", a GPU's way) it leaves the compiled decode layers
(`engine/models/decode_graph.py`) and the C++ decode kernel, and each such row's prefix goes
through the reference partial attention and merge, one span at a time, op by op: on this CPU
that made a step 2.6-3x the plain one where the copy alone was priced at ~1% of it, so the
`ellm` optimiser chose ratios that lost (docs/ellm.md). Read in place (`prefix_read`
"in_place", a CPU's default: the swap space is the pool tensor's tail) the step is the fully
resident one with other block ids, and what is left to measure is where the prefix's bytes
live. This module measures the whole extra, whichever way the engine reads; the fit records
the way (`meta.prefix_read`), so a cached fit of the other way is measured again.

Method, as the hybrid cache's ρ is measured (`engine/profiling.py`): the same decode batch is
timed twice, fully resident and with a prefix of `u` tokens of every row kept on host, on a
small grid of batch sizes, contexts and prefix lengths; the difference is fitted as
`extra = overhead + per_row · rows + per_token · prefix tokens` with non-negative terms
(`CostModel.prefix_step`). A difference of two timings of the same batch keeps what both
forms share (weights, sampling, attention over the context) out of the term. Each point is
the fastest of a few runs spread over passes (the profiler's reason: on a shared machine other
processes only ever add time).

A *rebuilt* prefix step is measured the same way (`measure_rebuild_step`, `CostModel.
rebuild_step`): the same decode batch fully resident and with each row's first `u` tokens
out of the pool and rebuilt by the step (the table's entries emptied, `transient` set: what
`PartialResidency` leaves with the rebuild source), fitted as `overhead + per_row · rows +
per_token · Σu + per_pair · Σu²` (the last term the prefixes' own causal attention). Its
grid is smaller than the host one: a rebuilt token costs a prefill token on this CPU, so the
points stay at a few hundred rebuilt tokens. Both fits state their error (`error_s`, the
largest absolute residual over their points). The clock is the bench's (`clock`), so a test
can drive the measurement with timings it controls.

The host-kept prefix is built with the KV ledger's own primitives (a host block per entry,
the device block released, the entry emptied, `transient` set), exactly the state
`PartialResidency` leaves with the host source; its host blocks hold whatever they hold
(timing only, no copy is run). The profiler runs before any policy attaches its components,
so no component is involved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cost_model import CostModel, PrefixStepFit, nonneg_lstsq
from engine.sampling import SamplingParams
from engine.scheduling.policy import ScheduledItem
from engine.scheduling.request import Request

if TYPE_CHECKING:  # profiling imports this module
    from engine.profiling import ProfileTarget

log = logging.getLogger(__name__)
_PASSES = 3
_BATCHES = (1, 4, 16)
_SHAPES = ((64, 32), (128, 96), (512, 256))  # (context, host-kept prefix) tokens; whole blocks at bs <= 32
# (batch, context, rebuilt prefix): at most 384 rebuilt tokens a point (a prefill's worth of work);
# rows and prefix lengths vary apart so the four terms are identifiable
_REBUILD_GRID = ((1, 64, 32), (1, 160, 128), (1, 320, 256), (2, 160, 64), (4, 64, 32), (4, 160, 96), (2, 320, 192))


@dataclass(frozen=True)
class PrefixPoint:
    rows: int  # rows carrying a prefix
    tokens: int  # prefix tokens read, all rows
    extra_s: float  # seconds over the same batch fully resident
    pairs: int = 0  # Σu²: the rebuilt prefixes' own query-key pairs


def prefix_grid(target: ProfileTarget) -> list[tuple[int, int, int]]:
    """(batch, context, prefix) points whose resident form fits the pool and whose prefixes fit
    the host space; at most 8k context tokens a point (the fit is linear)."""
    bs = target.config.block_size
    capacity = target.kv.capacity_tokens() - bs * 8
    host_tokens = target.kv.host.num_free * bs
    out = []
    for b in _BATCHES:
        for c, u in _SHAPES:
            u = u // bs * bs
            if b > target.config.max_num_seqs or c >= target.max_model_len or not u:
                continue
            if b * (c + bs) <= capacity and b * u <= host_tokens and b * c <= 8192:
                out.append((b, c, u))
    return out


def rebuild_grid(target: ProfileTarget) -> list[tuple[int, int, int]]:
    """(batch, context, rebuilt prefix) points whose resident form fits the pool."""
    bs = target.config.block_size
    capacity = target.kv.capacity_tokens() - bs * 8
    out = []
    for b, c, u in _REBUILD_GRID:
        u = u // bs * bs
        if b <= target.config.max_num_seqs and c < target.max_model_len and u and b * (c + bs) <= capacity:
            out.append((b, c, u))
    return out


def measure_prefix_step(
    target: ProfileTarget, clock: Callable[[], float] = time.perf_counter
) -> tuple[PrefixStepFit, tuple[PrefixPoint, ...]]:
    """Time the grid in both forms and fit the extra (module docstring)."""
    grid = prefix_grid(target)
    if len(grid) < 3:
        raise RuntimeError("the KV pool or host space is too small to measure a host-read prefix step")
    points = _time_pairs(_PrefixBench(target, clock), grid, host=True)
    return _fit(points, with_pairs=False), points


def measure_rebuild_step(
    target: ProfileTarget, clock: Callable[[], float] = time.perf_counter
) -> tuple[PrefixStepFit, tuple[PrefixPoint, ...]]:
    """Time the rebuild grid fully resident and with rebuilt prefixes, and fit the extra."""
    grid = rebuild_grid(target)
    if len(grid) < 5:
        raise RuntimeError("the KV pool is too small to measure a rebuilt prefix step")
    points = _time_pairs(_PrefixBench(target, clock), grid, host=False)
    return _fit(points, with_pairs=True), points


def _time_pairs(bench: _PrefixBench, grid: list[tuple[int, int, int]], host: bool) -> tuple[PrefixPoint, ...]:
    """Each point's fastest time with its prefix out of the pool minus fully resident."""
    runs = [(b, c, u if out else 0) for b, c, u in grid for out in (True, False)]
    for run in runs:
        bench.time_once(*run, host=host)  # warm-up
    best = [float("inf")] * len(runs)
    for _ in range(_PASSES):
        for i, run in enumerate(runs):
            best[i] = min(best[i], bench.time_once(*run, host=host))
    return tuple(PrefixPoint(b, b * u, best[2 * i] - best[2 * i + 1], b * u * u) for i, (b, _, u) in enumerate(grid))


def _fit(points: tuple[PrefixPoint, ...], with_pairs: bool) -> PrefixStepFit:
    """Non-negative least squares of the extra on (1, rows, tokens[, pairs]), with its error."""
    x = np.array([[1.0, p.rows, p.tokens, p.pairs if with_pairs else 0.0] for p in points])
    y = np.array([p.extra_s for p in points])
    coef = nonneg_lstsq(x if with_pairs else x[:, :3], y, np.ones_like(y)) + ([] if with_pairs else [0.0])
    error = float(np.max(np.abs(x @ np.array(coef) - y)))
    return PrefixStepFit(*coef, error_s=error)


def prefix_step_current(target: ProfileTarget, model: CostModel) -> bool:
    """Whether `model` has a prefix-step fit of the way `target` reads host-kept prefixes
    (`meta.prefix_read`; a fit from before the in-place read has none and counts as "copy"):
    the two cost very different amounts, so a cached fit of the other way is measured again."""
    return model.prefix_step is not None and model.meta.get("prefix_read", "copy") == target.prefix_read


def rebuild_step_missing(target: ProfileTarget, model: CostModel) -> bool:
    """Whether `model` lacks a rebuild fit that `target`'s pool can measure (a profile cached
    before the fit existed gets it added once)."""
    return model.rebuild_step is None and len(rebuild_grid(target)) >= 5


def with_prefix_step(target: ProfileTarget, model: CostModel) -> CostModel:
    """`model` with `prefix_step` measured, the points in its meta; `model` as it is, with a
    warning, where the pool or the host space is too small for the grid (the engine still
    starts; `ellm` then prices only the copy, as before the term existed)."""
    if len(prefix_grid(target)) < 3:
        log.warning(
            "KV pool or host swap space too small to measure a host-read prefix step; "
            "ellm prices host reads by the copy alone"
        )
        return model
    start = time.perf_counter()
    fit, points = measure_prefix_step(target)
    meta = dict(model.meta)
    meta.update(
        prefix_read=target.prefix_read,
        prefix_points=[{"rows": p.rows, "tokens": p.tokens, "extra_s": p.extra_s} for p in points],
        prefix_profile_seconds=time.perf_counter() - start,
    )
    log.info(
        "host-read prefix step (%s): +%.3g s per step, +%.3g s per row, +%.3g s per prefix token (error %.3g s)",
        target.prefix_read,
        fit.overhead_s,
        fit.per_row_s,
        fit.per_token_s,
        fit.error_s,
    )
    return replace(model, meta=meta, prefix_step=fit)


def with_rebuild_step(target: ProfileTarget, model: CostModel) -> CostModel:
    """`model` with `rebuild_step` measured, the points in its meta; as it is, with a warning,
    where the pool is too small for the grid (rebuilt rows are then priced as prefill rows)."""
    if len(rebuild_grid(target)) < 5:
        log.warning("KV pool too small to measure a rebuilt prefix step; ellm prices rebuilt rows as prefill rows")
        return model
    start = time.perf_counter()
    fit, points = measure_rebuild_step(target)
    meta = dict(model.meta)
    meta.update(
        rebuild_points=[{"rows": p.rows, "tokens": p.tokens, "pairs": p.pairs, "extra_s": p.extra_s} for p in points],
        rebuild_profile_seconds=time.perf_counter() - start,
    )
    log.info(
        "rebuilt prefix step: +%.3g s per step, +%.3g s per row, +%.3g s per token, +%.3g s per pair (error %.3g s)",
        fit.overhead_s,
        fit.per_row_s,
        fit.per_token_s,
        fit.per_pair_s,
        fit.error_s,
    )
    return replace(model, meta=meta, rebuild_step=fit)


class _PrefixBench:
    """Times one decode batch through the engine's runner, optionally with host-kept prefixes."""

    def __init__(self, target: ProfileTarget, clock: Callable[[], float] = time.perf_counter) -> None:
        self.target = target
        self.clock = clock
        self._ids = 0

    def time_once(self, batch: int, context: int, prefix: int, host: bool = True) -> float:
        kv = self.target.kv
        requests = [self._request(context + 1) for _ in range(batch)]
        try:
            for r in requests:
                if not kv.allocate(r, context + 1):
                    raise RuntimeError("the prefix profiling grid does not fit the KV pool")
                r.num_computed_tokens = context
                if prefix:
                    (self._keep_on_host if host else self._rebuild)(kv.table(r), prefix)
            items = [ScheduledItem(r, 1) for r in requests]
            t0 = self.clock()
            self.target.execute(items)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return self.clock() - t0
        finally:
            for r in requests:
                kv.free(r)

    def _keep_on_host(self, table, prefix: int) -> None:
        """The table's first `prefix` tokens leave the pool for host blocks (no copy run)."""
        ledger = self.target.kv.ledger
        for e in range(prefix // ledger.block_size):
            host_block = ledger.take_host()
            assert host_block is not None, "prefix_grid checked the host space"
            ledger.push_host_prefix(table, host_block)
            ledger.release(table.blocks[e])
            ledger.set_entry(table, e, None)
        ledger.set_transient(table, prefix)

    def _rebuild(self, table, prefix: int) -> None:
        """The table's first `prefix` tokens leave the pool; the step rebuilds them."""
        ledger = self.target.kv.ledger
        for e in range(prefix // ledger.block_size):
            ledger.release(table.blocks[e])
            ledger.set_entry(table, e, None)
        ledger.set_transient(table, prefix)

    def _request(self, length: int) -> Request:
        self._ids += 1
        tokens = torch.randint(0, self.target.vocab_size, (length,)).tolist()
        return Request(f"profile-prefix-{self._ids}", tokens, SamplingParams(max_tokens=1))
