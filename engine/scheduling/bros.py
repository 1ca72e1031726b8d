"""BROS priority-based packing (the paper's Algorithm 1) on the two-ended KV cache.

Per step:
1. RT requests in slack order (merge-polling, `slack.py`). Requests that cannot make their
   next deadline even alone are *demoted* behind the saveable ones and do not set the time
   budget, so one late request never stalls the rest; the budget is the smallest slack of a
   saveable request, or the plain target of a late one (a late request should at least get
   a normal-sized step), or +inf with no RT request.
2. RT requests join while the estimated step time stays within the budget; the first one
   always joins (the late fallback, flagged in `Decision.forced`). A prefill that does not fit
   whole gets the largest chunk that does. The first cost failure ends the phase and resets
   the adaptive cap.
3. BE requests in arrival order (`be_order`; the paper's fewest-checkpointed-first is an
   option, `BE_ORDERS` says why it is not the default): each is packed if it (or a chunk
   of its prefill) fits, else it may replace the least urgent scheduled RT request if that
   request's own deadline still holds when deferred one step. An admitted BE request that
   needs memory (its KV partly on host after RT took its block's end, or its next block) may
   swap out BE requests behind it in BE order; without that, parked BE requests held ~12% of
   the pool idle in the fair simulator at ShareGPT 2 req/s (docs/bros.md). While an admitted
   BE request has KV on host no new BE request is admitted (`BROSStep._held_back`): newcomers
   took the memory the parked one needed, were pushed to host in turn and filled host space,
   and then every eviction dropped work (docs/bros.md, "Sixth pass").

Minimum BE share (our addition, `min_be_share`; the paper has none and its BE throughput
falls to almost nothing under RT overload): the policy keeps a moving average of BE's share
of the scheduled tokens, counted only over steps that left some BE request out (a step that
ran every BE request held nothing back, however few tokens that was). While that share
is below `min_be_share`, `min_be_share x token budget` tokens and one seat are held back
from RT, and after RT's phase BE gets them ignoring the time budget (BE order, prefill chunks
allowed). Memory (`bros_floor.BEFloor`): the same share of the device blocks is BE's floor;
the BE requests at the front of the BE order that cover it (rounded up to whole requests) may
not be evicted by RT, and new RT requests are admitted only while they leave free what those
requests still need, a start for one not yet admitted (and what this step's owed tokens
need). A share of tokens alone did not survive memory-bound overload: RT growth pushed the
owed BE request out again and its KV was dropped (ShareGPT 3 req/s in the fair simulator,
docs/bros.md "Rate 3"); owed BE no longer pushes RT to host either, which only
turned that into RT recomputes. So overload can slow batch work to that share but never starve
it, and at loads where BE already gets more the setting changes nothing. Default 0.1: a tenth of the tokens is what a
demanding batch user would call "still progressing" while it costs RT at most a tenth of a
step's budget; 0 turns it off (the paper's behaviour).

Memory (the KV manager's `TwoEndedBlocks` component, which this policy attaches): RT
requests take free blocks or steal BE blocks' empty ends (lazy checkpointing);
when even that fails, whole requests not in the batch are swapped to host (BE first, then
RT by most slack), or recompute-preempted when host space is full. Every tentative
allocation runs under the KV undo log and is rolled back when its request is rejected. A
replaced RT request keeps its reservation (it runs next step and needs exactly those slots).

Where it lives: this module is the policy (settings and what outlives a step: `T_avg`, the
adaptive cap, BE's share); `bros_step.py` is one step of Algorithm 1 and `bros_memory.py` its
KV reservations and evictions.

Construct with a cost model: `make_policy("bros", cost_model=CostModel.load(path),
default_slo=SLO(ttft_s=0.4, tpot_s=0.2))`; the engine injects its profiled model.
"""

from __future__ import annotations

import math
from functools import partial

from engine.cost_model import CostModel
from engine.kv.two_ended import TwoEndedBlocks
from engine.scheduling.adaptive_cap import AdaptiveCap
from engine.scheduling.bros_decision import BE_ORDERS, Decision
from engine.scheduling.bros_step import BROSStep
from engine.scheduling.policy import ScheduledBatch, SchedulerState, SchedulingPolicy
from engine.scheduling.request import SLO, Request, RequestClass
from engine.scheduling.slack import TokenGroups

__all__ = ["BE_ORDERS", "BROSPolicy", "Decision"]


class BROSPolicy(SchedulingPolicy):
    name = "bros"

    def __init__(
        self,
        cost_model: CostModel | None = None,
        default_slo: SLO = SLO(0.4, 0.2),
        base_cap: int = 128,
        min_chunk: int = 16,
        ema: float = 0.2,
        min_be_share: float = 0.1,
        share_window: int = 50,
        token_group: int = 1,
        be_fills_rt_ends: bool = True,
        be_order: str = "arrival",
    ) -> None:
        """`min_be_share`: BE's guaranteed share of scheduled tokens while it waits (0..1, 0
        = off); `share_window`: steps the share is averaged over (an EMA of that span);
        `token_group`: RT tokens per deadline after the first (`slack.TokenGroups`; 1 = a
        deadline per token, the paper's evaluated setting and the strictest);
        `be_fills_rt_ends`: with no free block, BE may take the free end of an RT request's
        partly filled last block (the paper's FindBlock (i); `TwoEndedBlocks.lend_rt_ends`);
        `be_order`: the order BE requests are packed in, `"arrival"` (oldest first) or the
        paper's `"checkpointed"` (fewest blocks on host first, then arrival); see `BE_ORDERS`."""
        if default_slo.ttft_s is None or default_slo.tpot_s is None:
            raise ValueError("bros needs default TTFT and TPOT targets for RT requests")
        if not 0.0 <= min_be_share < 1.0:
            raise ValueError(f"min_be_share must be in [0, 1), got {min_be_share}")
        if be_order not in BE_ORDERS:
            raise ValueError(f"be_order must be one of {sorted(BE_ORDERS)}, got {be_order!r}")
        if share_window < 1:
            raise ValueError(f"share_window must be >= 1 step, got {share_window}")
        self.cost_model = cost_model
        self.default_slo = default_slo
        self.base_cap = base_cap
        self.min_chunk = min_chunk
        self.ema = ema  # weight of the newest step in T_avg
        self.t_avg: float | None = None
        self.groups = TokenGroups(token_group)
        self.min_be_share = min_be_share
        self.be_fills_rt_ends = be_fills_rt_ends
        self.be_order = be_order
        self.share_alpha = 2.0 / (share_window + 1)
        self.be_share: float | None = None  # EMA of BE's token share over steps where BE waited
        self.cap: AdaptiveCap | None = None
        self.last = Decision()

    def kv_components(self) -> tuple[partial[TwoEndedBlocks], ...]:
        return (partial(TwoEndedBlocks, is_be=_is_be, lend_rt_ends=self.be_fills_rt_ends),)

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        if self.cost_model is None:
            raise ValueError("the bros policy needs a cost model (profile the model or pass cost_model=...)")
        if self.cap is None:
            self.cap = AdaptiveCap(self.base_cap, state.limits.max_num_seqs)
        step = BROSStep(self, state, self.cap.value)
        state.kv.undo.mark()
        try:
            batch = step.run()
        finally:
            state.kv.undo.settle()
        self.cap.update(step.decision.early_exit)
        self.last = step.decision
        return batch

    def on_step_end(self, batch: ScheduledBatch, elapsed_s: float) -> None:
        self.t_avg = elapsed_s if self.t_avg is None else (1 - self.ema) * self.t_avg + self.ema * elapsed_s
        if self.groups.size > 1:
            for it in batch.items:
                if it.request.req_class is RequestClass.RT and it.request.last_token_time is not None:
                    self.groups.observe(it.request)
        if self.last.be_waiting:
            total = sum(it.num_new_tokens for it in batch.items)
            be = sum(it.num_new_tokens for it in batch.items if it.request.req_class is RequestClass.BE)
            share = be / total if total else 0.0
            a = self.share_alpha
            self.be_share = share if self.be_share is None else (1 - a) * self.be_share + a * share

    def be_owed_tokens(self, token_budget: int) -> int:
        """Tokens BE is owed this step: 0 until a step with BE waiting has been measured, and
        while its share is at or above the minimum."""
        if self.min_be_share <= 0 or self.be_share is None or self.be_share >= self.min_be_share:
            return 0
        return max(1, math.ceil(self.min_be_share * token_budget))


def _is_be(request: Request) -> bool:
    """Which two-ended rules a request follows: BE lends its blocks' free ends, RT takes them."""
    return request.req_class is RequestClass.BE
