"""Owns the request queues and runs the configured policy each step."""

from __future__ import annotations

import time
from collections import deque

from engine.kv.hidden import CacheForm
from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling.policy import BatchLimits, ScheduledBatch, SchedulerState, SchedulingPolicy
from engine.scheduling.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, limits: BatchLimits, policy: SchedulingPolicy) -> None:
        """Joins a KV manager and a policy: the KV components the policy relies on are attached
        to the manager here, once (a later policy of the same name finds them there)."""
        for factory in policy.kv_components():
            kv.attach(factory)
        self.kv = kv
        self.limits = limits
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.last_schedule_s = 0.0  # wall time of the last `schedule` call (a published metric)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float | None = None) -> ScheduledBatch:
        start = time.perf_counter()
        state = SchedulerState(self.waiting, self.running, self.kv, self.limits, start if now is None else now)
        batch = self.policy.schedule(state)
        if self.kv.ledger.copies:  # recorded by allocations the policy did not collect (partial
            batch.copies += self.kv.take_copies()  # residency's host source under FCFS): run them too
        self.last_schedule_s = time.perf_counter() - start
        return batch

    def convert(self, request: Request, form: CacheForm, now: float | None = None) -> None:
        """Change a request's cache form between steps (`SchedulerState.convert`)."""
        state = SchedulerState(
            self.waiting, self.running, self.kv, self.limits, time.perf_counter() if now is None else now
        )
        state.convert(request, form)

    def step_done(self, batch: ScheduledBatch, elapsed_s: float) -> None:
        """Report the executed batch's duration to the policy (T_avg, adaptive caps)."""
        self.policy.on_step_end(batch, elapsed_s)

    def finish(self, request: Request, reason: FinishReason, now: float | None = None) -> None:
        """End a request (done or aborted) and free its KV."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter() if now is None else now
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request
