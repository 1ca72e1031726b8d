"""Apt-Serve's adaptive scheduler (paper §5; notes §2.5-2.8; docs/aptserve.md): each step
either a prefill or a decode iteration, whichever queue has waited longer in total, and the
requests of that iteration (and each one's cache form) chosen by the knapsack greedy
(`knapsack.py`) on the values of `apt_values.py`.

- *Prefill iteration*: candidates are the waiting requests, capacity the free blocks;
  the chosen ones are admitted in arrival order within the token budget and sequence cap
  (the last may be a chunk), each in its chosen form.
- *Decode iteration*: candidates are the running requests, capacity the whole pool; the
  unselected are preempted (recompute), selected ones whose form changed are converted
  (free and re-prefill, `SchedulerState.convert`), the rest run (one token, or the next
  chunk of an unfinished prompt).

HIDDEN is offered only when the engine attached `HiddenBlocks` and the model's ratio makes
it save memory (`HiddenLayout.saves_memory`, i.e. MHA); otherwise this is the same scheduler
over KV only. A request of one block is never offered HIDDEN (as the paper's code).

*No HIDDEN the next decode iteration would drop* (not in the paper): a request that does not
hold HIDDEN yet (waiting, or running in KV, which would convert through a re-prefill) is
offered HIDDEN only if its HIDDEN option would survive the next decode iteration's knapsack
(`hidden_kept_next_decode`). There its pending time is that of a request that has just got a
token: 0, because the next decode iteration starts when the step that gave it its token ends
(a lower bound; further prefill iterations first would add to it). With the paper's values
its HIDDEN option is then worth `0 - N·ρ·m̄ < 0` for any ρ > 0 and is dropped: the request is
converted back to KV or preempted, and its HIDDEN prefill was wasted work (on the CPU engine
every HIDDEN row was such a first prefill; docs/aptserve.md). So under the paper's rule HIDDEN
is offered only where the rebuild is free (ρ = 0), or with conversions priced, where the
re-prefill it would cost keeps it (`price_switches`). Requests already holding HIDDEN are
valued as they are (their pending time is known).

ρ (seconds of rebuild per block of HIDDEN context per step) is the `rho` argument when given
(an override), else the cost model's measured `hidden_s_per_token × block_size` (the engine's
profiler, or the simulator's profile; docs/aptserve.md). Offering HIDDEN with neither is an
error, never a guessed number.

*Conversions priced* (`price_switches=True`; off by default; not in the paper): in a decode
iteration a running request's option in the form it holds is worth the re-prefill it avoids,
priced from the cost model's prefill fit (`apt_values.make_candidate`,
`knapsack.option_value`), so it changes form (or is preempted) only when the value gained beats
that re-prefill. Why it was tried: a conversion is a preemption plus a re-prefill, and the
paper's values, which do not price it, admit a request in HIDDEN (its value is its whole wait)
and drop it at the next decode iteration (its value is one step's wait, below its penalty):
on the CPU engine every HIDDEN row was such a first prefill. Why it is off: measured in the
simulator it does worse (docs/aptserve.md, "Conversions priced"): the one-off re-prefill
outweighs one step's penalty, so HIDDEN requests are kept for life and every step pays their
rebuild. Priced only where HIDDEN is offered (where there are conversions).
"""

from __future__ import annotations

from engine.cost_model import CostModel
from engine.kv.hidden import CacheForm, HiddenBlocks
from engine.scheduling.apt_values import iteration_type, make_candidate, pending_time, request_value, slo_violated
from engine.scheduling.knapsack import Candidate, options, solve
from engine.scheduling.policy import ScheduledBatch, SchedulerState, SchedulingPolicy
from engine.scheduling.request import SLO, Request

# the value of a request that got its token at `now`: a floor above 0, so that it still counts
# (a value of 0 would drop it) and is packed last
FRESH_VALUE = 1e-12


class AptServePolicy(SchedulingPolicy):
    name = "aptserve"

    def __init__(
        self,
        rho: float | None = None,
        decay: float = 0.0,
        default_slo: SLO = SLO(1.0, 1.0),
        cost_model: CostModel | None = None,
        price_switches: bool = False,
        withhold_dropped_hidden: bool = True,
        penalty_counts_demoted: bool = True,
    ) -> None:
        """`rho`: ρ override (else `cost_model`'s measured one); `decay`: a demoted request's
        value factor (0: near zero, the paper; 0.4: its "Scheduling*"); `default_slo`: for
        requests without their own (the paper's 1 s / 1 s); `price_switches`: price the
        re-prefill of a conversion or preemption (needs `cost_model`; False: the paper);
        `withhold_dropped_hidden`: offer HIDDEN only where the next decode iteration would keep
        it (False: the paper's rule, offered wherever the knapsack takes it; an ablation);
        `penalty_counts_demoted`: N in the HIDDEN penalty counts the requests past their SLO
        (True: ours; False: the paper's code, `_U -= num_violate`; an ablation, docs/aptserve.md
        "Why HIDDEN is never chosen (ninth session)")."""
        self.withhold_dropped_hidden = withhold_dropped_hidden
        self.penalty_counts_demoted = penalty_counts_demoted
        self._rho_override, self.cost_model = rho, cost_model
        self.decay, self.default_slo, self.price_switches = decay, default_slo, price_switches
        self.rho = 0.0  # the ρ in use (set on the first step that offers HIDDEN)
        self.hidden_chosen = 0  # requests scheduled in HIDDEN form (a published count)
        self.kv_chosen = 0
        self.conversions = 0  # running requests converted (freed to re-prefill in the other form)
        self.hidden_withheld = 0  # HIDDEN options not offered: the next decode iteration would drop them
        # `hidden_kept_next_decode`'s answers within one schedule call, by its inputs (N, ρ and
        # the capacity are the call's: most requests share a few block counts; the hot spot)
        self._kept_memo: dict[tuple, bool] = {}

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._kept_memo.clear()
        hidden = self._hidden(state)
        outstanding = self._penalty_scale(state)
        free = state.kv.pool.num_free
        waiting = [self._candidate(state, r, hidden, outstanding, extra=0) for r in state.waiting]
        # "fits" means an option the knapsack would take fits the free blocks: a HIDDEN form that
        # fits but is worth less than its penalty does not count (else a prefill iteration
        # would admit nothing and the step would idle)
        fits = any(options(c, free) for c in waiting)
        kind = iteration_type(
            (pending_time(r, state.now) for r in state.waiting),
            (pending_time(r, state.now) for r in state.running),
            fits,
        )
        if (kind == "prefill" or not state.running) and fits:
            self._prefill(state, batch, waiting, free)
        if not batch and state.running:  # a prefill iteration that admitted nothing decodes instead
            self._decode(state, batch, hidden, outstanding)
        return batch

    # -- the two iteration types ------------------------------------------------------------

    def _prefill(self, state: SchedulerState, batch: ScheduledBatch, cands: list[Candidate], free: int) -> None:
        choices = solve(cands, free)
        budget, limits = state.limits.max_num_batched_tokens, state.limits
        for request, choice in list(zip(state.waiting, choices)):
            if not choice.scheduled:
                continue
            if budget <= 0 or len(state.running) >= limits.max_num_seqs:
                break
            request.cache_form = CacheForm.HIDDEN if choice.hidden else CacheForm.KV
            prefix, cached = state.kv.match_prefix(request)
            n = request.num_tokens - cached
            if n > budget:
                if not limits.enable_chunked_prefill and batch:
                    break
                n = budget
            if not state.kv.allocate(request, n, prefix):
                continue  # prefix hits or rounding made it larger than priced: leave it waiting
            state.admit(request, cached)
            batch.add(request, n)
            self._count(choice.hidden)
            budget -= n

    def _decode(self, state: SchedulerState, batch: ScheduledBatch, hidden, outstanding: int) -> None:
        running = list(state.running)
        steps = [min(r.num_tokens - r.num_computed_tokens, state.limits.max_num_batched_tokens) for r in running]
        cands = [self._candidate(state, r, hidden, outstanding, extra=n, running=True) for r, n in zip(running, steps)]
        choices = solve(cands, state.kv.pool.capacity)
        keep = []
        for request, n, choice in zip(running, steps, choices):
            form = CacheForm.HIDDEN if choice.hidden else CacheForm.KV
            if not choice.scheduled:
                state.preempt(request)
                batch.preempted.append(request)
            elif form is not request.cache_form:
                state.convert(request, form)  # free and re-prefill in the new form
                batch.preempted.append(request)
                self.conversions += 1
            else:
                keep.append((request, n))
        budget = state.limits.max_num_batched_tokens
        for request, n in keep[: state.limits.max_num_seqs]:
            n = min(n, budget)
            if n <= 0 or not state.kv.allocate(request, n):
                break
            batch.add(request, n)
            self._count(request.cache_form is CacheForm.HIDDEN)
            budget -= n

    # -- helpers ----------------------------------------------------------------------------

    def _penalty_scale(self, state: SchedulerState) -> int:
        """N of the penalty `N·ρ·m̄`: every outstanding request, or (the paper's code) those not
        yet past their SLO."""
        n = len(state.waiting) + len(state.running)
        if self.penalty_counts_demoted:
            return n
        late = sum(1 for r in (*state.waiting, *state.running) if slo_violated(r, state.now, self.default_slo))
        return n - late

    def _hidden(self, state: SchedulerState) -> HiddenBlocks | None:
        """The hybrid cache's component where HIDDEN saves memory; None: KV only."""
        try:
            component = state.kv.component(HiddenBlocks)
        except LookupError:
            return None
        if not component.layout.saves_memory:
            return None
        self.rho = self.rho_for(state.kv.block_size)
        if self.price_switches and self.cost_model is None:
            raise ValueError(
                "aptserve prices conversions from the cost model's prefill fit but has none: give a cost "
                "model (the engine profiles one unless cost_model_path is set), or price_switches=False"
            )
        return component

    def rho_for(self, block_size: int) -> float:
        """ρ: the override, else the cost model's measured rebuild per block."""
        if self._rho_override is not None:
            return self._rho_override
        rho = None if self.cost_model is None else self.cost_model.hidden_rho(block_size)
        if rho is None:
            raise ValueError(
                "aptserve may pick HIDDEN here but has no ρ: give aptserve_rho, or a cost model with "
                "hidden_s_per_token (the profiler measures it on a model whose hidden form saves memory)"
            )
        return rho

    def _candidate(
        self, state: SchedulerState, r: Request, hidden, outstanding: int, extra: int, running: bool = False
    ) -> Candidate:
        """Blocks for the request's known tokens (running: after this step's `extra` new ones);
        a running request holds its form, worth its re-prefill where conversions are priced."""
        tokens = (r.num_computed_tokens + extra) if extra else r.num_tokens
        kv_blocks = max(1, -(-tokens // state.kv.block_size))
        hidden_blocks = hidden.layout.blocks_for(kv_blocks) if hidden is not None and kv_blocks > 1 else None
        holds_hidden = running and r.cache_form is CacheForm.HIDDEN
        if hidden_blocks is not None and self.withhold_dropped_hidden and not holds_hidden:
            if not self.hidden_kept_next_decode(r, kv_blocks, hidden_blocks, outstanding, state.kv.pool.capacity):
                hidden_blocks = None
                self.hidden_withheld += 1
        value = max(request_value(r, state.now, self.decay, self.default_slo), FRESH_VALUE)
        if not (running and hidden is not None and self.price_switches):
            return make_candidate(value, kv_blocks, hidden_blocks, outstanding, self.rho)
        holds = r.cache_form is CacheForm.HIDDEN
        return make_candidate(
            value, kv_blocks, hidden_blocks, outstanding, self.rho, holds, self.reprefill_seconds(r.num_computed_tokens)
        )

    def hidden_kept_next_decode(
        self, r: Request, kv_blocks: int, hidden_blocks: int, outstanding: int, capacity: int
    ) -> bool:
        """Would the next decode iteration keep this request in HIDDEN once it holds it? Its
        candidate there: the value of a request that has just got its token (`FRESH_VALUE`),
        the same blocks and penalty, and, where conversions are priced, the re-prefill that
        keeping HIDDEN avoids; kept iff its HIDDEN option survives `knapsack.options` (not
        worthless, not below the hull) in the whole pool."""
        tokens = r.num_tokens if self.price_switches else None  # the bonus's only input
        key = (kv_blocks, hidden_blocks, outstanding, capacity, self.rho, tokens)
        kept = self._kept_memo.get(key)
        if kept is None:
            bonus = self.reprefill_seconds(tokens) if self.price_switches else 0.0
            holds = True if self.price_switches else None
            after = make_candidate(FRESH_VALUE, kv_blocks, hidden_blocks, outstanding, self.rho, holds, bonus)
            kept = self._kept_memo[key] = any(choice.hidden for _, _, choice in options(after, capacity))
        return kept

    def reprefill_seconds(self, tokens: int) -> float:
        """What re-prefilling `tokens` adds to a step: the prefill fit's price of one more row
        of that many tokens, without the fixed per-pass term (the row rides in a step that
        runs anyway)."""
        if tokens <= 0:
            return 0.0
        fit = self.cost_model.prefill
        return fit.predict_work(tokens, tokens * tokens) - fit.beta

    def _count(self, hidden: bool) -> None:
        if hidden:
            self.hidden_chosen += 1
        else:
            self.kv_chosen += 1
