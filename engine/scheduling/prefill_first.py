"""FCFS, prefill-first and unchunked: the vLLM the BROS, Apt-Serve and eLLM papers measured.

vLLM before chunked prefill (v0.2-v0.4, the papers' baseline) ran two kinds of step, never
mixed: when a waiting request could be admitted, the step prefilled waiting prompts whole, in
arrival order, as many as the token budget, the sequence cap and the KV pool allowed, and
every decoding request waited for it; otherwise the step decoded every running request. Out of
KV during a decode step, the most recently admitted request was preempted by recomputation
(vLLM's default for single-sequence requests). So under load its decodes stall behind every
prefill: TPOT suffers as well as TTFT, which is why the papers' TPOT ratios are far larger
than against our chunked `fcfs`.

Decisions where vLLM's behaviour does not carry over:
- A prompt longer than the token budget is admitted alone in its own step (vLLM v0 refused
  prompts above `max_num_batched_tokens`; ours is at least the context length in the
  simulator, so this only matters on small engine configs, where refusing would lose work).
- A request preempted by recomputation re-enters at the head of the waiting queue and
  re-prefills its prompt and generated tokens whole, as vLLM did.
- `enable_chunked_prefill` in the batch limits is ignored: this policy *is* the unchunked mode.
"""

from __future__ import annotations

from typing import ClassVar

from engine.scheduling.fcfs import allocate_or_preempt
from engine.scheduling.policy import ScheduledBatch, SchedulerState, SchedulingPolicy


class PrefillFirstFCFSPolicy(SchedulingPolicy):
    name: ClassVar[str] = "fcfs-prefill-first"

    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._prefill(state, batch)
        if not batch:
            self._decode(state, batch)
        return batch

    @staticmethod
    def _prefill(state: SchedulerState, batch: ScheduledBatch) -> None:
        """Whole prompts of waiting requests in arrival order, while everything allows."""
        budget = state.limits.max_num_batched_tokens
        while state.waiting and len(state.running) < state.limits.max_num_seqs:
            request = state.waiting[0]
            prefix, num_cached = state.kv.match_prefix(request)
            n = request.num_tokens - num_cached
            if n > budget and batch:
                break  # the next step takes it
            if not state.kv.allocate(request, n, prefix):
                break
            state.admit(request, num_cached)
            batch.add(request, n)
            budget -= n

    @staticmethod
    def _decode(state: SchedulerState, batch: ScheduledBatch) -> None:
        """One token for every running request, preempting the newest when KV runs out."""
        i = 0
        while i < len(state.running):
            request = state.running[i]
            n = request.num_tokens - request.num_computed_tokens
            if not allocate_or_preempt(state, batch, request, n):
                break
            batch.add(request, n)
            i += 1
