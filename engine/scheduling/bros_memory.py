"""KV for one BROS step: reserve a candidate's blocks, evicting whole requests when it must.

Every change runs under the KV manager's undo log: `make_room` returns the mark taken just
before its successful reservation, so the step can roll a rejected candidate back to it.
Victims are requests not in the batch (`keep`), BE first then RT by most slack; when host
space is full a victim is recompute-preempted instead of swapped out. The rules for who may
evict whom, and why, are in `victims`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from engine.kv.block_pool import Block
from engine.kv.two_ended import TwoEndedBlocks
from engine.scheduling.policy import ScheduledBatch, SchedulerState
from engine.scheduling.request import SLO, Request, RequestClass
from engine.scheduling.slack import deadline

BEKey = Callable[[Request], tuple]  # the BE packing order (`bros_decision.be_key`); reversed, the eviction order


class StepMemory:
    """The memory side of one step: `state`'s KV manager and its two-ended component, the
    step's `batch` (where swap-outs and recompute preemptions are listed), the RT targets
    (`slo`, for the RT victim order) and the BE order (`be_key`)."""

    def __init__(self, state: SchedulerState, batch: ScheduledBatch, slo: SLO, be_key: BEKey) -> None:
        self.state = state
        self.kv = state.kv
        self.ends = state.kv.component(TwoEndedBlocks)
        self.batch = batch
        self.slo = slo
        self.be_key = be_key

    def make_room(
        self,
        r: Request,
        n: int,
        prefix: list[Block],
        *,
        be: bool,
        force: bool,
        evict_rt: bool,
        keep: Collection[Request],
        evict_behind: bool = False,
    ) -> int | None:
        """Restore and reserve under a fresh undo mark, evicting victims (never one in `keep`)
        between attempts. Returns the mark (the caller may roll back to it) or None when nothing
        is left to evict."""
        victims = None
        if self._hopeless_fit(r, n, be, force or evict_behind, evict_rt):
            return None
        # a BE request evicting BE behind it outside the progress guarantee only swaps (a swap
        # is undone with the step's undo log if the request is then rejected; a recompute drop
        # is not, and throws work away)
        swap_only = be and evict_behind and not force
        while True:
            mark = self.kv.undo.mark()
            if (self.kv.is_resident(r) or self.kv.restore(r)) and self.kv.allocate(r, n, prefix):
                return mark
            self.kv.undo.rollback(mark)
            if victims is None:
                victims = iter(self.victims(r, be, force or evict_behind, evict_rt, keep))
            while (victim := next(victims, None)) is not None and not self.evict(victim, swap_only):
                pass
            if victim is None:
                return None

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

    def victims(self, r: Request, be: bool, force: bool, evict_rt: bool, keep: Collection[Request]) -> list[Request]:
        """BE requests first (most checkpointed, latest arrival), then RT by most slack; never
        a request in `keep` (the batch, the replaced RT requests, `r`). A BE candidate evicts
        only to guarantee progress (empty batch), and only BE requests behind it in BE order.
        Only the growth of a resident RT request (or the head when nothing else could run)
        evicts other RT requests: a prefill or a restore that pushed decoding requests out
        would be pushed out in turn next step (the evicted ones become the most urgent), and
        memory-bound load turns into swap thrash instead of finishing requests."""
        keep = set(keep) | {r}
        held = [x for x in self.state.running if x not in keep and self.kv.device_blocks(x)]
        be_victims = sorted((x for x in held if x.req_class is RequestClass.BE), key=self.be_key, reverse=True)
        rt_victims = [x for x in held if x.req_class is RequestClass.RT] if evict_rt else []
        rt_victims.sort(key=lambda x: deadline(x, self.slo), reverse=True)
        if be:  # BE never pushes RT out (under memory-bound overload RT would recompute it back)
            return [x for x in be_victims if self.be_key(x) > self.be_key(r)] if force else []
        return be_victims + rt_victims

    def evict(self, victim: Request, swap_only: bool = False) -> bool:
        """Swap `victim` out whole, or when host space is full drop its KV for recompute
        (unless `swap_only`); whether it was evicted."""
        mark = self.kv.undo.mark()
        if self.kv.swap_out(victim):
            self.batch.swapped_out.append(victim)
            return True
        self.kv.undo.rollback(mark)
        if swap_only:
            return False
        self.state.preempt(victim)  # host space is full: drop the KV and recompute later
        self.batch.preempted.append(victim)
        return True
