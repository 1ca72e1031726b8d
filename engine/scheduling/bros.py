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
   request's own deadline still holds when deferred one step.

Minimum BE share (our addition, `min_be_share`; the paper has none and its BE throughput
falls to almost nothing under RT overload): the policy keeps a moving average of BE's share
of the scheduled tokens, counted only over steps that left some BE request out (a step that
ran every BE request held nothing back, however few tokens that was). While that share
is below `min_be_share`, `min_be_share x token budget` tokens and one seat are held back
from RT, and after RT's phase BE gets them ignoring the time budget (BE order, prefill chunks
allowed). Memory: while BE is owed, new RT requests are not admitted into the blocks the first
BE request needs, and owed BE may push RT requests not in the batch to host, as RT growth
does to BE. So overload can slow batch work to that share but never starve it, and at loads where BE
already gets more the setting changes nothing. Default 0.1: a tenth of the tokens is what a
demanding batch user would call "still progressing" while it costs RT at most a tenth of a
step's budget; 0 turns it off (the paper's behaviour).

Memory (the KV manager's `TwoEndedBlocks` component, which this policy attaches): RT
requests take free blocks or steal BE blocks' empty ends (lazy checkpointing);
when even that fails, whole requests not in the batch are swapped to host (BE first, then
RT by most slack), or recompute-preempted when host space is full. Every tentative
allocation runs under the KV undo log and is rolled back when its request is rejected. A
replaced RT request keeps its reservation (it runs next step and needs exactly those slots).

Construct with a cost model: `make_policy("bros", cost_model=CostModel.load(path),
default_slo=SLO(ttft_s=0.4, tpot_s=0.2))`; the engine injects its profiled model.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import partial

from engine.cost_model import CostModel
from engine.kv.block_pool import Block
from engine.kv.two_ended import TwoEndedBlocks
from engine.scheduling.adaptive_cap import AdaptiveCap
from engine.scheduling.packing import Packing
from engine.scheduling.policy import (
    ScheduledBatch,
    SchedulerState,
    SchedulingPolicy,
)
from engine.scheduling.request import SLO, Request, RequestClass, RequestStatus
from engine.scheduling.slack import TokenGroups, deadline, merge_by_deadline, target


@dataclass
class Decision:
    """What the last step decided (tests check Algorithm 1's invariants against it)."""

    rt_order: list[Request] = field(default_factory=list)  # saveable by slack, then demoted
    num_saveable: int = 0
    rt_scheduled: list[Request] = field(default_factory=list)
    replaced: list[Request] = field(default_factory=list)  # dropped from the back for BE
    skipped: list[Request] = field(default_factory=list)  # passed over: no memory, or held by admission control
    be_scheduled: list[Request] = field(default_factory=list)
    budget_s: float = math.inf
    estimate_s: float = 0.0
    cap: int = 0
    early_exit: bool = False  # the RT cost check failed (cap resets)
    forced: bool = False  # the head RT request ran past the budget (late fallback)
    be_owed: list[Request] = field(default_factory=list)  # BE packed first for the minimum share
    be_waiting: bool = False  # some BE request was left out (the share counts only such steps)
    # why BE requests were left out (the "memory or time?" question of docs/bros.md): no KV
    # for them (even with what they may evict), or no time (budget, cap, or the scan stopped)
    be_no_memory: list[Request] = field(default_factory=list)
    be_no_time: list[Request] = field(default_factory=list)


# The order BE requests are packed in (and, reversed, evicted in). The paper's is
# "checkpointed": fewest blocks on host first, which spends the fewest restore copies per
# step. Under a standing backlog it starves every BE request RT once took a block end from:
# a newer one always has fewer blocks on host, so the checkpointed ones wait on host, fill the
# swap space, and from then on every eviction drops KV for recompute; and a batch job is
# done only when its last request is. Measured in the fair simulator (docs/bros.md, "Why BE
# loses throughput") that is most of BROS's BE shortfall, so the default is "arrival"
# (oldest first, what a vLLM user expects of a queue), which restores them in turn.
BE_ORDERS = frozenset({"arrival", "checkpointed"})


class _Outcome(enum.Enum):
    OK = "ok"
    MEMORY = "memory"
    COST = "cost"


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
        step = _Step(self, state, self.cap.value)
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


class _Step:
    """One run of Algorithm 1 over the current queues."""

    def __init__(self, policy: BROSPolicy, state: SchedulerState, cap: int) -> None:
        self.policy = policy
        self.state = state
        self.kv = state.kv
        self.ends = state.kv.component(TwoEndedBlocks)
        self.slo = policy.default_slo
        self.pack = Packing(policy.cost_model, state.limits.max_num_batched_tokens)
        self.batch = ScheduledBatch()
        self.decision = Decision(cap=cap)
        self.cached: dict[Request, int] = {}  # waiting requests given KV this step -> prefix-cache hit
        self.slack: dict[Request, float] = {}
        self.saveable: set[Request] = set()
        self.be_candidates: list[Request] = []
        self.owed_blocks = 0  # device blocks new RT admissions leave to owed BE this step

    def run(self) -> ScheduledBatch:
        self._order_rt()
        self.be_candidates = self._be_order()
        owed = self.policy.be_owed_tokens(self.pack.token_budget) if self.be_candidates else 0
        self.owed_blocks = self._owed_blocks(owed)
        reserve, seat = min(owed, self.pack.token_budget - 1), int(owed > 0 and self.decision.cap > 1)
        self.pack.token_budget -= reserve  # RT packs around the tokens (and a seat) BE is owed
        self.decision.cap -= seat
        self._pack_rt()
        self.pack.token_budget += reserve
        self.decision.cap += seat
        self._pack_owed_be(owed)
        self._pack_be()
        return self._finish()

    # -- the minimum BE share ------------------------------------------------------------

    def _owed_blocks(self, owed: int) -> int:
        """Device blocks the first BE request needs to take its owed tokens (0 when none are
        owed): new RT requests are not admitted into those (`_pack_rt`)."""
        if owed <= 0:
            return 0
        b = self.be_candidates[0]
        on_host = self.kv.num_host_blocks(b) if self.kv.holds(b) else 0
        return on_host + -(-owed // self.kv.block_size) + 1

    def _pack_owed_be(self, owed: int) -> None:
        """Pack BE past the time budget while its token share is below the minimum. After RT
        (which packed around the reserved tokens), so no RT request in the batch takes the
        free end of an owed BE request's block and checkpoints it out of residency."""
        for b in self.be_candidates:
            if owed <= 0 or len(self.pack) >= self.decision.cap:
                break
            left = min(owed, self.pack.tokens_left)
            if self._try(b, be=True, force=True, limit=left, evict_rt=True) is _Outcome.OK:
                self.decision.be_owed.append(b)
                self.decision.be_scheduled.append(b)
                owed -= self.pack.items[b][0]

    # -- phase 1 ------------------------------------------------------------------------

    def _order_rt(self) -> None:
        now = self.state.now
        is_rt = lambda r: r.req_class is RequestClass.RT  # noqa: E731
        groups, t_avg = self.policy.groups, self.policy.t_avg
        slack = lambda r: groups.slack(r, self.slo, now, t_avg)  # noqa: E731
        order = merge_by_deadline(
            filter(is_rt, self.state.waiting), filter(is_rt, self.state.running), self.slo, key=slack
        )
        self.slack = {r: slack(r) for r in order}
        saveable = [r for r in order if self.slack[r] >= self._alone_cost(r)]
        self.saveable = set(saveable)
        late = [r for r in order if r not in self.saveable]
        d = self.decision
        d.rt_order, d.num_saveable = saveable + late, len(saveable)
        d.budget_s = min([self.slack[r] for r in saveable[:1]] + [target(r, self.slo) for r in late], default=math.inf)

    def _alone_cost(self, r: Request) -> float:
        n = min(r.num_tokens - r.num_computed_tokens, self.pack.token_budget)
        return self.pack.cost_with(n, r.num_computed_tokens + n, 0)

    def _pack_rt(self) -> None:
        d = self.decision
        parked = self._parked_rt()
        for r in d.rt_order:
            if len(self.pack) >= d.cap or self.pack.tokens_left <= 0:
                break
            if parked and not self.kv.holds(r):
                d.skipped.append(r)  # admission control: admitted RT requests on host are restored first
                continue
            if self.owed_blocks and not self.kv.holds(r) and self.kv.pool.num_free < self.owed_blocks + 1:
                d.skipped.append(r)  # admission control: the blocks left are owed to BE
                continue
            # the first RT request always joins (BE packed for the minimum share does not count)
            outcome = self._try(r, be=False, force=not d.rt_scheduled, evict_rt=self._is_growing(r))
            if outcome is _Outcome.COST:
                d.early_exit = True
                break
            if outcome is _Outcome.OK:
                d.rt_scheduled.append(r)
            else:
                d.skipped.append(r)  # first-fit: a resident request behind it may still run
        if not d.rt_scheduled and d.rt_order:  # nothing fit: the head runs, evicting whatever it must
            if self._try(d.rt_order[0], be=False, force=True, evict_rt=True) is _Outcome.OK:
                d.rt_scheduled.append(d.rt_order[0])
                if d.rt_order[0] in d.skipped:
                    d.skipped.remove(d.rt_order[0])

    def _is_growing(self, r: Request) -> bool:
        """A resident admitted request: only its growth may push other RT requests to host."""
        return self.kv.holds(r) and self.kv.is_resident(r)

    def _parked_rt(self) -> bool:
        """Whether some admitted RT request has KV on host. New RT requests then wait: taking
        memory for a prefill while decoding requests sit swapped out starves them (they turn
        late, get demoted behind every new arrival) and thrashes under memory overload."""
        return any(r.req_class is RequestClass.RT and not self.kv.is_resident(r) for r in self.state.running)

    # -- phase 2 ------------------------------------------------------------------------

    def _pack_be(self) -> None:
        d = self.decision
        order = [b for b in self._be_order() if b not in self.pack.items]  # owed ones are packed
        for i, b in enumerate(order):
            if self.pack.tokens_left <= 0:
                d.be_no_time.extend(order[i:])
                break
            full = len(self.pack) >= d.cap
            outcome = _Outcome.COST if full else self._try(b, be=True, force=not self.pack.items)
            if outcome is _Outcome.COST and d.rt_scheduled:
                outcome = self._replace_least_urgent(b)
            if outcome is _Outcome.OK:
                d.be_scheduled.append(b)
                continue
            (d.be_no_memory if outcome is _Outcome.MEMORY else d.be_no_time).append(b)
            if outcome is _Outcome.COST and (full or self._no_decode_fits()):
                d.be_no_time.extend(order[i + 1 :])
                break  # nothing behind it can fit either (first-fit otherwise: a decode may)

    def _no_decode_fits(self) -> bool:
        return self.pack.cost_with(1, 1, self.kv.pending_swap_bytes) > self.decision.budget_s

    def _be_order(self) -> list[Request]:
        is_be = lambda r: r.req_class is RequestClass.BE  # noqa: E731
        candidates = [*filter(is_be, self.state.running), *filter(is_be, self.state.waiting)]
        return sorted(candidates, key=self._be_key)

    def _be_key(self, r: Request) -> tuple[int, float, str]:
        """A total order (no ties): BE_ORDERS says why each exists."""
        checkpointed = self.kv.num_host_blocks(r) if self.policy.be_order == "checkpointed" else 0
        return checkpointed, r.arrival_time, r.request_id

    def _replace_least_urgent(self, b: Request) -> _Outcome:
        """Swap the last scheduled RT request for `b` if its own deadline survives the deferral."""
        r = self.decision.rt_scheduled[-1]
        if r not in self.saveable:
            return _Outcome.COST
        n, context = self.pack.items[r]
        self.pack.remove(r)
        t_avg = self.policy.t_avg
        outcome = self._try(
            b, be=True, force=False, deferred=lambda cost: self.slack[r] >= (cost if t_avg is None else t_avg) + cost
        )
        if outcome is _Outcome.OK:
            self.decision.rt_scheduled.pop()
            self.decision.replaced.append(r)
        else:
            self.pack.add(r, n, context)
        return outcome

    # -- one candidate ------------------------------------------------------------------

    def _try(
        self, r: Request, *, be: bool, force: bool, deferred=None, evict_rt: bool = False, limit: int | None = None
    ) -> _Outcome:
        """Reserve KV for `r`, check the step time, keep or roll back. `limit`: at most that
        many tokens, and a forced chunk of up to that many (the minimum BE share)."""
        prefix, base = self._prefix(r)
        n_full = r.num_tokens - base
        if limit is not None:
            n_full = min(n_full, limit) if self._may_chunk(n_full) else n_full
        if not self.state.limits.enable_chunked_prefill and n_full > self.pack.tokens_left and self.pack.items:
            return _Outcome.COST
        n_full = min(n_full, max(self.pack.tokens_left, 1))
        mark = self._make_room(r, n_full, prefix, be, force, evict_rt)
        if mark is None:
            return _Outcome.MEMORY
        n = self._fit(r, base, n_full, deferred)
        if n == 0 and force:
            chunk = limit if limit is not None else self.policy.min_chunk
            n = min(n_full, chunk) if self._may_chunk(n_full) else n_full
            self.decision.forced = limit is None
        if n == 0:
            self.kv.undo.rollback(mark)
            return _Outcome.COST
        if n < n_full:  # a chunk fits: reserve just that
            self.kv.undo.rollback(mark)
            if self._make_room(r, n, prefix, be, force=False) is None:
                return _Outcome.MEMORY
        self._accept(r, n, base)
        return _Outcome.OK

    def _prefix(self, r: Request) -> tuple[list[Block], int]:
        if self.kv.holds(r):
            return [], r.num_computed_tokens
        return self.kv.match_prefix(r)

    def _may_chunk(self, n_full: int) -> bool:
        return n_full > 1 and self.state.limits.enable_chunked_prefill

    def _fit(self, r: Request, base: int, n_full: int, deferred) -> int:
        """Tokens of `r` that fit the budget (all, the largest chunk of at least min_chunk, or 0)."""
        ok = lambda n: self._fits(self.pack.cost_with(n, base + n, self.kv.pending_swap_bytes), deferred)  # noqa: E731
        if ok(n_full):
            return n_full
        lo, hi = self.policy.min_chunk, n_full - 1
        if not self._may_chunk(n_full) or lo > hi or not ok(lo):
            return 0
        while lo < hi:  # largest n in [lo, hi] that fits; cost grows with n
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        return lo

    def _fits(self, cost: float, deferred) -> bool:
        return cost <= self.decision.budget_s and (deferred is None or deferred(cost))

    def _accept(self, r: Request, n: int, base: int) -> None:
        self.pack.add(r, n, base + n)
        if r.status is RequestStatus.WAITING:
            self.cached[r] = base

    # -- memory ---------------------------------------------------------------------------

    def _make_room(
        self, r: Request, n: int, prefix: list[Block], be: bool, force: bool, evict_rt: bool = False
    ) -> int | None:
        """Restore and reserve under a fresh undo mark, evicting victims between attempts.
        Returns the mark (the caller may roll back to it) or None when nothing is left to evict."""
        victims = None
        if self._hopeless_fit(r, n, be, force, evict_rt):
            return None
        while True:
            mark = self.kv.undo.mark()
            if (self.kv.is_resident(r) or self.kv.restore(r)) and self.kv.allocate(r, n, prefix):
                return mark
            self.kv.undo.rollback(mark)
            if victims is None:
                victims = iter(self._victims(r, be, force, evict_rt))
            victim = next(victims, None)
            if victim is None:
                return None
            self._evict(victim)

    def _hopeless_fit(self, r: Request, n: int, be: bool, force: bool, evict_rt: bool) -> bool:
        """Cheap check that a reservation cannot succeed, so no tentative restore is built and
        rolled back for nothing (under memory pressure most candidates fail)."""
        if evict_rt or (be and force):
            return False
        available = self.kv.pool.num_free
        if be and self.ends.lend_rt_ends:
            available += 1  # the last new entry may go into an RT block's free end
        if not be:
            available += self.ends.num_stealable + self._be_device_blocks()
        base = r.num_computed_tokens if self.kv.holds(r) else 0
        return self.kv.blocks_needed(r, base + n) > available

    def _be_device_blocks(self) -> int:
        """Device blocks held by BE requests (an upper bound on what evicting BE frees)."""
        return sum(self.kv.device_blocks(x) for x in self.state.running if x.req_class is RequestClass.BE)

    def _victims(self, r: Request, be: bool, force: bool, evict_rt: bool) -> list[Request]:
        """BE requests first (most checkpointed, latest arrival), then RT by most slack; never
        a request in the batch. A BE candidate evicts only to guarantee progress (empty
        batch), and only BE requests behind it in BE order. Only the growth of a resident RT
        request (or the head when nothing else could run) evicts other RT requests: a prefill
        or a restore that pushed decoding requests out would be pushed out in turn next step
        (the evicted ones become the most urgent), and memory-bound load turns into swap
        thrash instead of finishing requests."""
        keep = set(self.pack.items) | set(self.decision.replaced) | {r}
        held = [x for x in self.state.running if x not in keep and self.kv.device_blocks(x)]
        be_victims = sorted((x for x in held if x.req_class is RequestClass.BE), key=self._be_key, reverse=True)
        rt_victims = [x for x in held if x.req_class is RequestClass.RT] if evict_rt else []
        rt_victims.sort(key=lambda x: deadline(x, self.slo), reverse=True)
        if be:  # BE owed its minimum share may also push RT to host (`evict_rt`), or it could never run
            return ([x for x in be_victims if self._be_key(x) > self._be_key(r)] if force else []) + rt_victims
        return be_victims + rt_victims

    def _evict(self, victim: Request) -> None:
        mark = self.kv.undo.mark()
        if self.kv.swap_out(victim):
            self.batch.swapped_out.append(victim)
            return
        self.kv.undo.rollback(mark)  # host space is full: drop the KV and recompute later
        self.state.preempt(victim)
        self.batch.preempted.append(victim)

    # -- result ---------------------------------------------------------------------------

    def _finish(self) -> ScheduledBatch:
        for r, num_cached in self.cached.items():  # replaced ones too: they keep their KV
            self.state.admit(r, num_cached)
        for r, (n, _) in self.pack.items.items():
            self.batch.add(r, n)
        self.decision.estimate_s = self.pack.cost(self.kv.pending_swap_bytes)
        self.decision.be_waiting = any(b not in self.pack.items for b in self.be_candidates)
        self.batch.copies = self.kv.take_copies()
        return self.batch


def _is_be(request: Request) -> bool:
    """Which two-ended rules a request follows: BE lends its blocks' free ends, RT takes them."""
    return request.req_class is RequestClass.BE
