"""eLLM's request-level optimiser as a policy: each step choose the batch bound `b` and the
uncached ratio `r` that maximise tokens/s under the TPOT SLO and the KV memory, then run FCFS
with that bound (chunked prefill, recompute preemption) and that ratio.

The optimiser (`choose`) searches a grid of ratios (0, 0.05, ..., 0.9) rather than running
the paper's SLSQP over a relaxed problem: for each `r` it takes the largest feasible `b`, the
longest FCFS prefix of the candidates (running first, then waiting) whose resident blocks fit
the pool, so the 2-D problem is one scan per ratio with no solver tolerance, start point or
failure mode. Taking the largest `b` is optimal for that `r` whenever `b/T` grows with `b`,
i.e. while one more row costs less than the step's average (the per-step constant of the
profile makes that so on this engine); it is not checked per step. Step time comes from the
worker's profiled cost model (`engine/cost_model.py`): the `b` decode rows over their whole
contexts plus the rebuild, priced as a prefill of `Σ u_i` tokens with `Σ u_i²` query-key
pairs. Unlike the paper's FLOPs-only Eq. 5 the profile has a per-step constant, so `b/T` rises
with `b` and trading `r` for `b` pays exactly when memory binds (notes §5.2.3). When no pair
meets the SLO, it falls back to `r = 0` and the memory-bound `b` (plain FCFS). The search stops
early once every candidate fits (a larger `r` only adds cost), and its time is published as
`last.decision_s`, with running totals of the choices in `stats` (`DecisionStats`).

`b` bounds admission only: running requests are not preempted to reach it (memory pressure
still preempts, as in FCFS).

Where the profile measured what a prefix step really costs (`CostModel.prefix_step`, in the
way the engine reads host-kept prefixes: through a scratch, op by op, or in place on the
compiled path; `engine/prefix_profiling.py`), every `r > 0` is priced with it, so a ratio
whose step loses to its batch gain is not chosen.

Sources (`source`, `engine/scheduling/prefix_pricing.py`): each `r` is priced with the
cheaper of the sources allowed, rebuilding the prefixes or reading them from host swap space
(the copy from the profile's `swap_bytes_per_s`, added to the step on a CPU and overlapped on
a GPU), and with `layer_split` the best split of layers between the two (priced; the engine
runs only the two ends, so the engine's policy leaves it off). With `source="auto"` the
choice's source becomes the component's source for prefixes that leave the pool from then on
(tables keep the source their prefix started with). The batch carries the priced split
(`ScheduledBatch.host_prefix_layers`) for the simulator.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar

import numpy as np

from engine.cost_model import CostModel
from engine.kv.partial import PartialResidency
from engine.scheduling.ellm_admission import (
    RATIO_GRID,
    HoldPrice,
    chunk_seconds,
    final_length,
    hysteresis,
    prefix_tokens,
)
from engine.scheduling.ellm_grid import Choice, Grid
from engine.scheduling.fcfs import FCFSPolicy
from engine.scheduling.policy import ScheduledBatch, SchedulerState, SchedulingPolicy
from engine.scheduling.prefix_pricing import (
    REBUILD_ONLY,
    SOURCES,
    PrefixSources,
    cheaper_source,
    split_shares,
)
from engine.scheduling.request import SLO, Request

RECENT_DECISIONS = 4096  # decisions kept for DecisionStats' percentiles
PUBLISH_EVERY_S = 1.0  # the snapshot's copy of the stats is refreshed at most this often (percentiles cost ~1 ms)


@dataclass
class DecisionStats:
    """Running totals of the policy's choices, for benchmarks and the docs: how often it
    rebuilds, how much, at what batch size, and how long it takes to decide."""

    steps: int = 0
    rebuilding_steps: int = 0  # steps with r > 0
    host_steps: int = 0  # of those, steps whose prefixes are read from host
    host_layers_sum: int = 0  # layers read from host, summed over host steps
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    batch_sum: int = 0
    step_s_sum: float = 0.0  # predicted step time at the choice
    rebuild_s_sum: float = 0.0  # predicted rebuild time at the choice
    decision_s_sum: float = 0.0
    decision_s_max: float = 0.0
    decision_cpu_s_sum: float = 0.0
    decision_cpu_s_max: float = 0.0
    # the last decisions' (wall, CPU) seconds, for percentiles; bounded for a long-running worker
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_DECISIONS), repr=False)

    def add(self, c: Choice) -> None:
        self.steps += 1
        self.rebuilding_steps += c.ratio > 0
        if c.ratio > 0 and c.source == "host":
            self.host_steps += 1
            self.host_layers_sum += c.host_layers
        self.ratio_sum += c.ratio
        self.ratio_max = max(self.ratio_max, c.ratio)
        self.batch_sum += c.batch
        if math.isfinite(c.step_s):
            self.step_s_sum += c.step_s
            self.rebuild_s_sum += c.rebuild_s
        self.decision_s_sum += c.decision_s
        self.decision_s_max = max(self.decision_s_max, c.decision_s)
        self.decision_cpu_s_sum += c.decision_cpu_s
        self.decision_cpu_s_max = max(self.decision_cpu_s_max, c.decision_cpu_s)
        self.recent.append((c.decision_s, c.decision_cpu_s))

    def as_dict(self) -> dict:
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "rebuilding_step_share": self.rebuilding_steps / n,
            "host_step_share": self.host_steps / n,
            "mean_host_layers": self.host_layers_sum / self.host_steps if self.host_steps else 0.0,
            "mean_ratio": self.ratio_sum / n,
            "max_ratio": self.ratio_max,
            "mean_batch_bound": self.batch_sum / n,
            "rebuild_share_of_step_time": self.rebuild_s_sum / self.step_s_sum if self.step_s_sum else 0.0,
            "mean_decision_s": self.decision_s_sum / n,
            "max_decision_s": self.decision_s_max,
            "mean_decision_cpu_s": self.decision_cpu_s_sum / n,
            "max_decision_cpu_s": self.decision_cpu_s_max,
            **self._percentiles(),
        }

    def _percentiles(self) -> dict:
        """Median and p99 of the recent decisions' wall and CPU time (0 before any)."""
        if not self.recent:
            return {f"{k}_decision{c}_s": 0.0 for k in ("p50", "p99") for c in ("", "_cpu")}
        wall, cpu = np.array(self.recent).T
        return {
            "p50_decision_s": float(np.median(wall)),
            "p99_decision_s": float(np.percentile(wall, 99)),
            "p50_decision_cpu_s": float(np.median(cpu)),
            "p99_decision_cpu_s": float(np.percentile(cpu, 99)),
        }


def choose(
    contexts: Sequence[int],
    capacity_tokens: int,
    block_size: int,
    cost: CostModel,
    tpot_s: float,
    max_batch: int,
    sources: PrefixSources = REBUILD_ONLY,
    final_contexts: Sequence[int] | None = None,
    running: int = 0,
    hold_running: bool = True,
    pending: Sequence[int] | None = None,
    token_budget: int = 0,
) -> Choice:
    """The (b, r) maximising b / T(b, r) subject to T <= tpot_s and the resident blocks of the
    first b candidates (`contexts`: their tokens after this step, FCFS order) fitting
    `capacity_tokens`, each r priced with the cheapest of `sources`. Falls back to r = 0 when
    no pair meets the SLO.

    Vectorised over the whole grid (one `ratios x candidates` array, prefix sums along the
    candidates) so its time grows with the array, not with Python loop iterations: about
    0.08 ms at 512 candidates on this machine, where the scalar scan took 0.8 ms (1.6 ms at 1,024)
    (docs/ellm.md, "Decision time"). The largest feasible `b` per ratio is the first index
    where the cumulative resident need passes the capacity (needs are positive, so the
    cumulative sums are increasing).

    Admission hysteresis (`final_contexts`, the candidates' projected lengths when they end,
    and `running`, how many of the candidates are already admitted; docs/ellm.md, "Seventh
    session"). Admitting at `r > 0` is a commitment the per-step search does not see: when a
    later step's `r`, the host space or the admitted contexts' growth no longer cover the
    admitted set, FCFS's memory path preempts by recompute and the prefill is paid again.
    So with `final_contexts` given:
    - with `hold_running` (the policy sets it while a request it admitted at `r > 0` runs),
      a ratio below the *floor*, the least ratio at which the running requests still fit
      the pool now, is not chosen (it would preempt them); when no ratio from the floor up
      meets the SLO, the floor is kept and nothing new is admitted;
    - at `r > 0` a waiting candidate is admitted only while the admitted set fits the pool
      at its projected end at that `r` (and, where the host may serve the prefixes, they fit
      the host space at their end: past it the component rebuilds them, which no step could
      afford on a CPU and which the floor would then hold), so a request admitted at `r` is
      never preempted for its growth while `r` holds. At `r = 0` admission is FCFS's (the baseline's rule), unchanged;
    - that bound is priced (eighth session, `HoldPrice`): the whole set the search would admit
      at `r` is admitted where a ratio from `r` up holds it through its future (requests
      leaving at their ends) and that later hold costs less than the recompute preemption the
      bound protects against. Where the copy hides under the step (a fast link, a CPU's
      in-place read) the hold is free and admission is the per-step search's, so the bound no
      longer costs queueing (TTFT) where it protects nothing.
    Without `final_contexts` the search is the plain per-step one.

    The step's prefill chunks (`pending`: each candidate's prompt tokens still to compute, 0
    or 1 for a decode row; `token_budget`: the step's token budget). FCFS fills the budget
    with the chunks of the first `b` candidates and that work is in the step, so the chosen
    pair's published `step_s` includes it: a prefill phase of `min(Σ pending, budget)`
    tokens sharing the step's fixed cost, priced as the simulator charges it. The choice
    itself (the TPOT target and the `b/T` ranking) is made on the step without the chunks:
    the token budget (vLLM's `max_num_batched_tokens`) is the knob that bounds what
    admissions add to a step, and with a queue waiting every ratio carries about the same
    chunk, so checking the target on it would send every step of a backlog to the
    fallback (tried: ranking with it lowered the x1000-link run's throughput by 3%). Left
    out (`pending` None), as before, the published price missed the chunks, which is how
    the x10-link run's prefill-carrying steps cost 3x their published price (docs/ellm.md)."""
    s = np.asarray(contexts[:max_batch], dtype=np.int64)
    if s.size == 0:
        return Choice(1, 0.0, math.inf)
    bs = block_size
    u = prefix_tokens(s, bs)
    # resident blocks per (ratio, candidate): u is whole blocks, so ceil((s - u) / bs) = ceil(s / bs) - u / bs
    need = (-(-s // bs) * bs)[None, :] - u
    batch = (np.cumsum(need, axis=1) <= capacity_tokens).sum(axis=1)  # b per ratio
    floor, lo, pays = 0, batch, None
    if final_contexts is not None:
        finals = np.asarray(final_contexts[:max_batch], dtype=np.int64)
        top = int(batch.max())  # no ratio admits more: the price never looks past the first `top`
        pays = HoldPrice(cost, sources, s[:top], finals[:top], capacity_tokens, bs, tpot_s).pays
        # the bound, unpriced; over the first `top` only: a count past them is cut to `batch` anyway
        lo, floor = hysteresis(batch, finals[:top], capacity_tokens, bs, sources, running)
        floor = floor if hold_running else 0
    grid = Grid(s, u, batch, lo, pays, cost, sources, tpot_s)
    # a larger r only adds rebuild cost once every candidate fits: the search stops at the first such r
    chosen = grid.best(floor)
    if chosen is None:  # r = 0 without hysteresis; with it, the least ratio that keeps the running set
        b = grid.admitted(floor)
        step = grid.rebuild_step(floor, b) if b else math.inf
        chosen = Choice(max(1, min(b, running)) if floor else b, RATIO_GRID[floor], step) if b else None
    chosen = chosen or Choice(1, 0.0, math.inf)
    i = RATIO_GRID.index(chosen.ratio)
    b = chosen.batch
    chunk_s = chunk_seconds(cost, s, pending, token_budget, np.array([b]))[0]  # the chosen pair's only
    if chunk_s and math.isfinite(chosen.step_s) and b == grid.admitted(i):
        exec_s = cost.estimate_sums(0, 0, b, grid.d_work(b))
        rest = chosen.step_s - chosen.rebuild_s  # the step without its prefixes (layer split included)
        rows, p_ln = grid.sums(i, b)[:2]
        with_chunk, _, _ = cheaper_source(
            exec_s + chunk_s, chosen.step_s - rest + exec_s + chunk_s, p_ln, rows, sources
        )
        chosen = replace(chosen, step_s=max(with_chunk, chosen.step_s))
    return chosen


class ELLMPolicy(SchedulingPolicy):
    name: ClassVar[str] = "ellm"

    def __init__(
        self,
        cost_model: CostModel | None = None,
        default_slo: SLO = SLO(0.4, 0.2),
        excluded: Callable[[Request], bool] | None = None,
        source: str = "rebuild",
        layer_split: bool = False,
        num_layers: int = 1,
        admission_hysteresis: bool = True,
    ) -> None:
        """`default_slo.tpot_s` is the TPOT target; `excluded(request)`: requests kept fully
        resident (session turns; see `PartialResidency`); `source`: where non-resident
        prefixes come from, `rebuild`, `host` or `auto` (the cheaper per step);
        `layer_split`: price eLLM's split of `num_layers` layers between host and rebuild
        (the simulator; the engine runs no split); `admission_hysteresis`: admit at `r > 0`
        only what the pool holds to its projected end and never drop `r` below what the
        running set needs (`choose`; off: the per-step search of the sixth session, for the
        ablation)."""
        if source not in SOURCES:
            raise ValueError(f"ellm's source must be one of {', '.join(SOURCES)}, got {source!r}")
        if default_slo.tpot_s is None:
            raise ValueError("ellm needs a TPOT target")
        self.cost_model = cost_model
        self.tpot_s = default_slo.tpot_s
        self.excluded = excluded
        self.source = source
        self.layer_split = layer_split
        self.num_layers = num_layers
        self.admission_hysteresis = admission_hysteresis
        # running requests admitted at r > 0: while any runs, r stays at or above what the
        # running set needs (`choose`'s floor); requests FCFS admitted at r = 0 that outgrow
        # the pool are preempted as FCFS would, not rescued at a ratio that costs more
        self._committed: set[str] = set()
        self.fcfs = FCFSPolicy()
        self.last = Choice(0, 0.0, 0.0)
        self.stats = DecisionStats()
        self._published: tuple[float, int, dict] | None = None  # (monotonic time, steps, as_dict)
        self._ends: dict[Request, int] = {}  # request -> its projected end (`final_length` without its length now)

    def published_stats(self) -> dict[str, float]:
        """`stats.as_dict()` for the engine's snapshot (the worker's telemetry), recomputed at
        most every `PUBLISH_EVERY_S` while decisions come (its percentiles sort the recent
        decisions: ~1 ms at 4,096, too much for every step); the same dict between refreshes."""
        now = time.monotonic()
        last = self._published
        if last is None or (last[1] != self.stats.steps and now - last[0] >= PUBLISH_EVERY_S):
            last = self._published = (now, self.stats.steps, self.stats.as_dict())
        return last[2]

    def kv_components(self):
        first = "host" if self.source == "host" else "rebuild"
        return (partial(PartialResidency, ratio=0.0, excluded=self.excluded, source=first),)

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        if self.cost_model is None:
            raise ValueError("the ellm policy needs a cost model (profile the model or pass cost_model=...)")
        start, start_cpu = time.perf_counter(), time.thread_time()
        # only the first max_num_seqs candidates can be in the batch: a long queue costs nothing
        candidates = itertools.islice(itertools.chain(state.running, state.waiting), state.limits.max_num_seqs)
        tokens, finals, pending = [], [], []
        ends = self._ends
        if len(ends) > 4 * state.limits.max_num_seqs:  # forget requests that left
            ends = self._ends = {}
        for r in candidates:  # one pass: each is read once per step
            n = len(r.token_ids)  # `num_tokens`, without the property's call
            tokens.append(n)
            pending.append(n - r.num_computed_tokens)
            end = ends.get(r)  # `final_length` less today's length: fixed per request, kept
            if end is None:
                end = ends[r] = final_length(r, 0)
            finals.append(n if n > end else end)
        before = {r.request_id for r in state.running}
        self._committed &= before  # finished or preempted requests hold nothing any more
        choice = choose(
            tokens,
            state.kv.capacity_tokens(),
            state.kv.block_size,
            self.cost_model,
            self.tpot_s,
            state.limits.max_num_seqs,
            self._sources(state),
            finals if self.admission_hysteresis else None,
            len(state.running),
            bool(self._committed),  # the floor guards only commitments
            pending,
            state.limits.max_num_batched_tokens,
        )
        wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        self.last = replace(choice, decision_s=wall, decision_cpu_s=cpu)
        self.stats.add(self.last)
        component = state.kv.component(PartialResidency)
        component.set_ratio(choice.ratio)
        if self.source == "auto" and choice.ratio:
            component.set_source(choice.source)
        bounded = replace(state.limits, max_num_seqs=max(1, min(choice.batch, state.limits.max_num_seqs)))
        batch = self.fcfs.schedule(replace(state, limits=bounded))
        if choice.ratio > 0 and self.admission_hysteresis:
            self._committed.update(r.request_id for r in state.running if r.request_id not in before)
        if choice.source == "host" and choice.host_layers < self.num_layers:
            batch.host_prefix_split = split_shares(choice.host_layers, self.num_layers)
        return batch

    def _sources(self, state: SchedulerState) -> PrefixSources:
        """The sources this step may price, from the profile and the host space left (free
        host blocks plus those the host-kept prefixes hold)."""
        step = self.cost_model.prefix_step
        if self.source == "rebuild":
            return REBUILD_ONLY if step is None else replace(REBUILD_ONLY, step=step)
        kv = state.kv
        held = sum(len(t.host_prefix) for t in kv.ledger.tables.values())
        return PrefixSources.of(
            self.source,
            kv_bytes_per_token=kv.bytes_per_token,
            swap_bytes_per_s=self.cost_model.swap_bytes_per_s,
            overlap=self.cost_model.swap_overlaps,
            host_capacity_tokens=(kv.host.num_free + held) * kv.block_size,
            num_layers=self.num_layers,
            layer_split=self.layer_split,
            step=step,
        )
