"""First-come-first-served with chunked prefill and recompute preemption (vLLM-like).

Running requests go first (decodes and unfinished prefill chunks) in admission order; when
KV blocks run out the most recently admitted request is preempted. Waiting requests are
then admitted in arrival order while the token budget, sequence cap and KV allow, the last
one possibly with a partial (chunked) prefill.
"""

from __future__ import annotations

from engine.scheduling.policy import (
    ScheduledBatch,
    SchedulerState,
    SchedulingPolicy,
)
from engine.scheduling.request import Request


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(state, batch, state.limits.max_num_batched_tokens)
        if not batch.preempted:
            self._admit_waiting(state, batch, budget)
        return batch

    def _schedule_running(self, state: SchedulerState, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(state.running) and budget > 0:
            request = state.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not allocate_or_preempt(state, batch, request, n):
                break
            batch.add(request, n)
            budget -= n
            i += 1
        return budget

    @staticmethod
    def _admit_waiting(state: SchedulerState, batch: ScheduledBatch, budget: int) -> None:
        limits = state.limits
        while state.waiting and budget > 0 and len(state.running) < limits.max_num_seqs:
            request = state.waiting[0]
            prefix, num_cached = state.kv.match_prefix(request)
            n = request.num_tokens - num_cached
            if n > budget:
                if limits.enable_chunked_prefill:
                    n = budget
                elif batch:  # whole prompts only: wait for a step with room
                    break
            if not state.kv.allocate(request, n, prefix):
                break
            state.admit(request, num_cached)
            batch.add(request, n)
            budget -= n


def allocate_or_preempt(state: SchedulerState, batch: ScheduledBatch, request: Request, n: int) -> bool:
    """Allocate, evicting the most recently admitted request until it fits.

    Requests already in this batch come earlier in admission order than `request`, so the
    victim (`running[-1]`) is never one of them; at worst it is `request` itself.
    """
    while not state.kv.allocate(request, n):
        victim = state.running[-1]
        state.preempt(victim)
        batch.preempted.append(victim)
        if victim is request:
            return False
    return True
