"""FCFS with whole-request swap preemption (vLLM-Swap, a baseline of the eLLM paper).

As FCFS (running requests in admission order, then waiting ones in arrival order, chunked
prefill, the same limits), except what happens when blocks run out: the most recently
admitted *resident* request that is not yet in this step's batch moves all its KV to host
(`KVCacheManager.swap_out`) and stays admitted, instead of being dropped and recomputed. A
swapped-out request is brought back (`restore`) before it runs again, in admission order,
when memory allows; until every swapped-out request is back no waiting request is admitted
(vLLM's rule: swapped work goes first). When host space is full too, the victim is
recompute-preempted as in FCFS.
"""

from __future__ import annotations

from typing import ClassVar

from engine.scheduling.fcfs import FCFSPolicy
from engine.scheduling.policy import ScheduledBatch, SchedulerState, SchedulingPolicy
from engine.scheduling.request import Request


class SwapPolicy(SchedulingPolicy):
    name: ClassVar[str] = "swap"

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = state.limits.max_num_batched_tokens
        for request in list(state.running):
            if budget <= 0:
                break
            if request not in state.running or request in batch.swapped_out:
                continue  # a victim of an earlier request this step
            if not state.kv.is_resident(request) and not state.kv.restore(request):
                break  # FCFS order: later requests wait until this one is back
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_swap(state, batch, request, n):
                break
            batch.add(request, n)
            budget -= n
        if not batch.preempted and not batch.swapped_out and all(state.kv.is_resident(r) for r in state.running):
            FCFSPolicy._admit_waiting(state, batch, budget)
        batch.copies = state.kv.take_copies()
        return batch

    @staticmethod
    def _allocate_or_swap(state: SchedulerState, batch: ScheduledBatch, request: Request, n: int) -> bool:
        """Allocate, moving the most recently admitted resident request not in the batch to host
        (or recomputing it when host space is full) until it fits; False when only `request`
        itself is left to move (it is then moved)."""
        in_batch = {id(it.request) for it in batch.items}
        while not state.kv.allocate(request, n):
            victim = next(
                (r for r in reversed(state.running) if id(r) not in in_batch and state.kv.is_resident(r)), None
            )
            if victim is None:
                return False
            if state.kv.swap_out(victim):
                batch.swapped_out.append(victim)
            else:
                state.preempt(victim)
                batch.preempted.append(victim)
            if victim is request:
                return False
        return True
