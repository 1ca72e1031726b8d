"""Iteration-level round-robin between an RT and a BE FCFS queue (the BROS paper's RR baseline).

Each step serves one class: its admitted requests first (decodes and unfinished prefill
chunks, in admission order), then its waiting requests in arrival order, under the same
token budget, sequence cap and chunked prefill as FCFS. The next step serves the other class;
a class with nothing to run passes its turn. No bidirectional KV: when blocks run out, the
most recently admitted request (of either class) is recompute-preempted, as in FCFS.
"""

from __future__ import annotations

from engine.scheduling.fcfs import allocate_or_preempt
from engine.scheduling.policy import (
    ScheduledBatch,
    SchedulerState,
    SchedulingPolicy,
)
from engine.scheduling.request import RequestClass

_OTHER = {RequestClass.RT: RequestClass.BE, RequestClass.BE: RequestClass.RT}


class RoundRobinPolicy(SchedulingPolicy):
    name = "rr"

    def __init__(self) -> None:
        self.turn = RequestClass.RT  # the class served next

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        batch = ScheduledBatch()
        for cls in (self.turn, _OTHER[self.turn]):
            self._serve(state, batch, cls)
            if batch:
                self.turn = _OTHER[cls]
                break
        return batch

    def _serve(self, state: SchedulerState, batch: ScheduledBatch, cls: RequestClass) -> None:
        budget = self._run_admitted(state, batch, cls, state.limits.max_num_batched_tokens)
        if not batch.preempted:  # as FCFS: never admit in a step that had to evict running work
            self._admit_waiting(state, batch, cls, budget)

    @staticmethod
    def _run_admitted(state: SchedulerState, batch: ScheduledBatch, cls: RequestClass, budget: int) -> int:
        for request in [r for r in state.running if r.req_class is cls]:
            if budget <= 0:
                break
            if request not in state.running:  # preempted as a victim of an earlier request
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not allocate_or_preempt(state, batch, request, n):
                break
            batch.add(request, n)
            budget -= n
        return budget

    @staticmethod
    def _admit_waiting(state: SchedulerState, batch: ScheduledBatch, cls: RequestClass, budget: int) -> None:
        limits = state.limits
        for request in [r for r in state.waiting if r.req_class is cls]:
            if budget <= 0 or len(state.running) >= limits.max_num_seqs:
                break
            prefix, num_cached = state.kv.match_prefix(request)
            n = request.num_tokens - num_cached
            if n > budget:
                if not limits.enable_chunked_prefill and batch:
                    break
                n = budget if limits.enable_chunked_prefill else n
            if not state.kv.allocate(request, n, prefix):
                break
            state.admit(request, num_cached)
            batch.add(request, n)
            budget -= n
