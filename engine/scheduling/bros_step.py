"""One step of BROS's Algorithm 1: order RT by slack, pack RT, then BE (`BROSStep`).

The policy (`bros.py`) holds what outlives a step (settings, `T_avg`, the adaptive cap, BE's
share); a `BROSStep` is built for one `schedule` call and thrown away. Its phases:

1. `_order_rt`: RT requests by slack (merge-polling), the late ones demoted, the time budget.
2. `_pack_rt`: RT requests while the step fits the budget, with admission control.
3. `_pack_owed_be`: BE past the budget while its token share is below the minimum.
4. `_pack_be`: BE in `be_order`, packed or replacing the least urgent RT request.

Each candidate goes through `_try` (reserve KV with `StepMemory`, price the step with the
running sums of `Packing`, keep it, keep a chunk, or roll back), so every phase shares one
memory and cost path. `Decision` (`bros_decision.py`) records what the step decided.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.kv.block_pool import Block
from engine.scheduling.bros_decision import Decision, be_key
from engine.scheduling.bros_floor import BEFloor
from engine.scheduling.bros_memory import StepMemory
from engine.scheduling.packing import Packing
from engine.scheduling.policy import ScheduledBatch, SchedulerState
from engine.scheduling.request import Request, RequestClass, RequestStatus
from engine.scheduling.slack import merge_by_deadline, target

if TYPE_CHECKING:
    from engine.scheduling.bros import BROSPolicy


@dataclass(frozen=True)
class _Evict:
    """Whom a candidate may evict besides BE requests (`StepMemory.victims`): `rt`, RT requests
    not in the batch; `behind`, (BE) BE requests behind it in BE order; `last_resort`, (the RT
    head when nothing else could run) the BE requests inside the memory floor too."""

    rt: bool = False
    behind: bool = False
    last_resort: bool = False


class _Outcome(enum.Enum):
    OK = "ok"
    MEMORY = "memory"
    COST = "cost"


class BROSStep:
    """One run of Algorithm 1 over the current queues."""

    def __init__(self, policy: BROSPolicy, state: SchedulerState, cap: int) -> None:
        self.policy = policy
        self.state = state
        self.kv = state.kv
        self.slo = policy.default_slo
        self.pack = Packing(policy.cost_model, state.limits.max_num_batched_tokens)
        self.batch = ScheduledBatch()
        self.memory = StepMemory(state, self.batch, self.slo, self._be_key)
        self.decision = Decision(cap=cap)
        self.cached: dict[Request, int] = {}  # waiting requests given KV this step -> prefix-cache hit
        self.slack: dict[Request, float] = {}
        self.saveable: set[Request] = set()
        self.be_candidates: list[Request] = []
        self.owed_blocks = 0  # device blocks new RT admissions leave to owed BE this step
        self.floor = BEFloor()  # the minimum share on memory (bros_floor.py)
        self.be_parked = False  # some admitted BE request has KV on host (`_held_back`)

    def run(self) -> ScheduledBatch:
        self._order_rt()
        self.be_candidates = self._be_order()
        self.be_parked = any(self.kv.holds(b) and not self.kv.is_resident(b) for b in self.be_candidates)
        # the start the BE request completing the memory floor is reserved: one step's minimum share
        chunk = math.ceil(self.policy.min_be_share * self.pack.token_budget)
        self.floor = BEFloor.of(self.kv, self.be_candidates, self.policy.min_be_share, chunk)
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
            if self._held_back(b):
                continue
            left = min(owed, self.pack.tokens_left)
            if self._try(b, be=True, force=True, limit=left) is _Outcome.OK:  # evicts BE behind it only
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
            if self._held_for_be(r):
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
            if self._try(d.rt_order[0], be=False, force=True, evict_rt=True, last_resort=True) is _Outcome.OK:
                d.rt_scheduled.append(d.rt_order[0])
                if d.rt_order[0] in d.skipped:
                    d.skipped.remove(d.rt_order[0])

    def _held_for_be(self, r: Request) -> bool:
        """Whether new RT request `r` must wait: admitting it would leave fewer free blocks than
        BE is owed, for this step's owed tokens or for the BE memory floor (`BEFloor`)."""
        reserve = max(self.owed_blocks, self.floor.deficit)
        if not reserve or self.kv.holds(r):
            return False
        return self.kv.pool.num_free - self.kv.blocks_needed(r, r.num_tokens) < reserve

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
            if self._held_back(b):
                continue
            if self.pack.tokens_left <= 0:
                d.be_no_time.extend(order[i:])
                break
            full = len(self.pack) >= d.cap
            # an admitted BE request may swap out BE behind it: parked on host with no free block
            # to restore into, it would otherwise hold its device blocks idle (docs/bros.md)
            outcome = (
                _Outcome.COST
                if full
                else self._try(b, be=True, force=not self.pack.items, evict_behind=self.kv.holds(b))
            )
            if outcome is _Outcome.COST and d.rt_scheduled:
                outcome = self._replace_least_urgent(b)
            if outcome is _Outcome.OK:
                d.be_scheduled.append(b)
                continue
            (d.be_no_memory if outcome is _Outcome.MEMORY else d.be_no_time).append(b)
            if outcome is _Outcome.COST and (full or self._no_decode_fits()):
                d.be_no_time.extend(order[i + 1 :])
                break  # nothing behind it can fit either (first-fit otherwise: a decode may)

    def _held_back(self, b: Request) -> bool:
        """BE admission control: a BE request with no KV waits while an admitted BE request has
        KV on host (listed in `Decision.be_held`), as new RT requests do for parked RT ones.
        Admitting it anyway took the memory the parked request needed to come back, RT growth
        pushed the newcomer to host in turn, host space filled with half-prefilled BE requests
        and every later eviction dropped KV for recompute (docs/bros.md, "Sixth pass")."""
        if not self.be_parked or self.kv.holds(b):
            return False
        if b not in self.decision.be_held:
            self.decision.be_held.append(b)
        return True

    def _no_decode_fits(self) -> bool:
        return self.pack.cost_with(1, 1, self.kv.pending_swap_bytes) > self.decision.budget_s

    def _be_order(self) -> list[Request]:
        is_be = lambda r: r.req_class is RequestClass.BE  # noqa: E731
        candidates = [*filter(is_be, self.state.running), *filter(is_be, self.state.waiting)]
        return sorted(candidates, key=self._be_key)

    def _be_key(self, r: Request) -> tuple[int, float, str]:
        return be_key(self.kv, self.policy.be_order, r)

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
        self,
        r: Request,
        *,
        be: bool,
        force: bool,
        deferred=None,
        evict_rt: bool = False,
        limit: int | None = None,
        evict_behind: bool = False,
        last_resort: bool = False,
    ) -> _Outcome:
        """Reserve KV for `r`, check the step time, keep or roll back. `limit`: at most that
        many tokens, and a forced chunk of up to that many (the minimum BE share).
        `last_resort`: the RT head when nothing else could run, which alone may evict the BE
        requests inside the memory floor.
        `evict_behind`: an admitted BE request may swap out BE requests behind it in BE order
        to get its KV back from host (or grow); those swap-outs are undone with it if it is then
        rejected, so a BE request that does not run never leaves copies behind."""
        prefix, base = self._prefix(r)
        n_full = r.num_tokens - base
        if limit is not None:
            n_full = min(n_full, limit) if self._may_chunk(n_full) else n_full
        if not self.state.limits.enable_chunked_prefill and n_full > self.pack.tokens_left and self.pack.items:
            return _Outcome.COST
        n_full = min(n_full, max(self.pack.tokens_left, 1))
        outer, swapped = self.kv.undo.mark(), len(self.batch.swapped_out)
        evict = _Evict(evict_rt, evict_behind, last_resort)
        outcome = self._reserve_and_fit(r, prefix, base, n_full, force, be, deferred, evict, limit)
        if outcome is not _Outcome.OK and evict_behind and not force:  # undo its swap-outs too
            self.kv.undo.rollback(outer)
            del self.batch.swapped_out[swapped:]
        return outcome

    def _reserve_and_fit(
        self,
        r: Request,
        prefix: list[Block],
        base: int,
        n_full: int,
        force: bool,
        be: bool,
        deferred,
        evict: _Evict,
        limit: int | None,
    ) -> _Outcome:
        """`_try`'s reservation and time check (see there)."""
        mark = self._make_room(r, n_full, prefix, be, force, evict)
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
            if self._make_room(r, n, prefix, be, False, replace(evict, rt=False)) is None:
                return _Outcome.MEMORY
        self._accept(r, n, base)
        return _Outcome.OK

    def _make_room(self, r: Request, n: int, prefix: list[Block], be: bool, force: bool, evict: _Evict) -> int | None:
        """Reserve KV for `n` tokens of `r` (`StepMemory.make_room`), never evicting a request
        this step has packed or replaced, nor (for RT, but the last resort) a BE request inside
        the memory floor."""
        keep = [*self.pack.items, *self.decision.replaced]
        if not be and not evict.last_resort:
            keep += self.floor.protected
        return self.memory.make_room(
            r, n, prefix, be=be, force=force, evict_rt=evict.rt, keep=keep, evict_behind=evict.behind
        )

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
