"""The one seam for batch policies: `SchedulingPolicy.schedule(state) -> ScheduledBatch`.

A policy sees the queues, the KV-cache manager and the step's limits; it decides which
requests run and how many new tokens each computes, allocating KV as it goes and preempting
(recompute) when it must. The engine then executes the batch. FCFS is the first policy and
BROS plugs in here; the hybrid-cache (Apt-Serve) and partial-KV (eLLM) policies are to. A
policy whose allocations need more than the KV manager's core names the KV components it
relies on (`kv_components`). The policies by name are in `registry.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from engine.kv.component import KVComponent
from engine.kv.copies import KVCopy
from engine.kv.hidden import CacheForm, HiddenBlocks
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.ledger import KVLedger
from engine.scheduling.request import Request, RequestStatus


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledItem:
    request: Request
    num_new_tokens: int


@dataclass
class ScheduledBatch:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # recompute-preempted (KV dropped)
    copies: list[KVCopy] = field(default_factory=list)  # executed in order before the forward pass
    swapped_out: list[Request] = field(default_factory=list)  # whole requests moved to host this step
    # eLLM's layer split as the `ellm` policy priced it (engine/scheduling/prefix_pricing.py):
    # the shares of the host-kept prefixes' all-layer K/V bytes read this step and of their
    # prefill rebuilt; the simulator charges it, the engine runs no split (reads all: (1, 0))
    host_prefix_split: tuple[float, float] = (1.0, 0.0)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.items.append(ScheduledItem(request, num_new_tokens))

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new_tokens for it in self.items)

    @property
    def swap_bytes(self) -> int:
        """Bytes crossing host <-> device this step (what the cost model's swap term charges)."""
        return sum(c.nbytes for c in self.copies if c.crosses_host)

    @property
    def swap_slots(self) -> int:
        """Token slots crossing host <-> device (for callers that price bytes themselves)."""
        return sum(c.num_slots for c in self.copies if c.crosses_host)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class SchedulerState:
    waiting: deque[Request]  # arrival order; preempted requests return to the front
    running: list[Request]  # admitted requests holding KV, in admission order
    kv: KVCacheManager
    limits: BatchLimits
    now: float

    def preempt(self, request: Request) -> None:
        """Recompute-preemption: drop the request's KV and put it back at the head of the queue."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def convert(self, request: Request, form: CacheForm) -> None:
        """Change the request's cache form the paper's way: drop its cache and re-prefill
        (prompt + generated tokens) in the new form (docs/aptserve.md, "Conversions"). A
        running request is preempted for it (and counted so); a waiting one holds nothing."""
        if request.cache_form is form:
            return
        if form is CacheForm.HIDDEN:
            self.kv.component(HiddenBlocks)  # LookupError: nothing would place its rows
        if request.status is RequestStatus.RUNNING:
            self.preempt(request)
        request.cache_form = form

    def admit(self, request: Request, num_cached_tokens: int) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.now
            request.num_cached_tokens = num_cached_tokens
        else:  # re-admitted after a recompute preemption
            request.num_recompute_cached_tokens += num_cached_tokens
        request.num_computed_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)


class SchedulingPolicy(ABC):
    """Chooses each step's batch. One instance per engine (adaptive policies keep state)."""

    name: ClassVar[str]

    def kv_components(self) -> tuple[Callable[[KVLedger], KVComponent], ...]:
        """Factories of the KV components this policy's allocations rely on (the contract is
        `engine/kv/component.py`). The `Scheduler` attaches them to its KV manager once, before
        the first request; the policy finds them there with `kv.component(cls)`. Default: the
        core's forward allocation is enough."""
        return ()

    def on_step_end(self, batch: ScheduledBatch, elapsed_s: float) -> None:
        """Called after the batch ran, with its measured (or simulated) duration."""

    def published_stats(self) -> dict[str, float] | None:
        """The policy's own figures for the engine's snapshot (and from there the worker's
        telemetry): a fresh flat dict the caller may keep, or None for a policy that keeps
        none. Called by the engine thread after every step, so it must be cheap."""
        return None

    @abstractmethod
    def schedule(self, state: SchedulerState) -> ScheduledBatch:
        """Return the requests to run this step with their new-token counts.

        Must allocate KV (through `state.kv`) for every scheduled token, may preempt
        running requests with `state.preempt`, and must never schedule more than
        `limits.max_num_batched_tokens` tokens or `limits.max_num_seqs` sequences.
        """
