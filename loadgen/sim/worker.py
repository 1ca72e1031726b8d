"""One simulated worker: the engine's `Scheduler`, policy, `KVCacheManager` and `BlockPool`,
with the forward pass replaced by the cost model's step time.

What a step does to its requests is the engine's own code (`engine/bookkeeping.py`,
`StepBookkeeping`), called in the engine's order: count the schedule, advance each row's
progress and commit its blocks, give each row that reached the end of its known tokens one
token and stop it when it must, then report the step's duration to the policy. Only the
token differs: a deterministic stand-in (the simulator has no logits), with outputs forced to
`max_tokens` (EOS ignored), as in the papers' setups.

The hybrid cache (docs/aptserve.md): where the spec knows the model's shape (`hidden_size`,
`head_dim`, `num_kv_heads`) and the cost model prices the rebuild (`hidden_s_per_token`), the
worker attaches the engine's `HiddenBlocks`, as the engine does for every policy but `bros`:
HIDDEN requests then hold blocks at the model's hidden ratio, and each step pays their rebuild
(`step_time.py`). Otherwise the worker is KV only (and `aptserve` schedules KV only).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from engine.bookkeeping import EngineStats, StepBookkeeping, produces_token
from engine.cost_model import CostModel
from engine.kv import BlockPool, KVCacheManager, hash_block
from engine.kv.hidden import HiddenBlocks, HiddenLayout
from engine.sampling import SamplingParams
from engine.scheduling import (
    SLO,
    BatchLimits,
    FinishReason,
    Request,
    RequestClass,
    ScheduledBatch,
    Scheduler,
    make_policy,
)
from loadgen.sim.jitter import StepJitter
from loadgen.sim.step_time import step_seconds
from loadgen.targets.base import PreparedRequest, TokenEvent


@dataclass(frozen=True)
class WorkerSpec:
    """What a simulated worker looks like: its KV pool, batching limits and model context."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int = 2048
    vocab_size: int = 49152
    kv_bytes_per_token: int = 0  # prices swaps and transfers
    # host swap space in blocks, the same for every policy (None: the manager's default, 4x the
    # device pool); sized from `--swap-space-gib` so FCFS-with-swap and BROS get equal room
    host_blocks: int | None = None
    # the model's shape for the hybrid cache's HIDDEN form (0: unknown, KV only)
    hidden_size: int = 0
    head_dim: int = 0
    num_kv_heads: int = 0

    def hidden_layout(self) -> HiddenLayout | None:
        """Where HIDDEN rows would lie, from the model's shape; None when it is unknown."""
        if not (self.hidden_size and self.head_dim and self.num_kv_heads):
            return None
        return HiddenLayout(self.hidden_size, self.head_dim, 2 * self.num_kv_heads, self.block_size, self.num_blocks)


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        spec: WorkerSpec,
        cost: CostModel,
        policy: str,
        policy_options: dict | None = None,
        jitter: StepJitter | None = None,
        seed: int = 0,
    ) -> None:
        self.worker_id, self.spec, self.cost = worker_id, spec, cost
        # noise on step times (measured on a real machine, or parametric); None = noise-free
        self.noise = jitter
        self._jitter = None if jitter is None else jitter.sampler(seed ^ zlib.crc32(worker_id.encode()))
        self.kv = KVCacheManager(
            BlockPool(spec.num_blocks, spec.enable_prefix_caching),
            spec.block_size,
            bytes_per_token=spec.kv_bytes_per_token,
            host_blocks=spec.host_blocks,
        )
        layout = spec.hidden_layout()
        if layout is not None and cost.hidden_s_per_token is not None and policy != "bros":
            self.kv.attach(HiddenBlocks.factory(layout))  # first, as the engine does
        limits = BatchLimits(spec.max_num_seqs, spec.max_num_batched_tokens, spec.enable_chunked_prefill)
        self.scheduler = Scheduler(self.kv, limits, make_policy(policy, **(policy_options or {})))
        self.stats = EngineStats()  # the engine's counters, kept by the engine's bookkeeping
        self.bookkeeping = StepBookkeeping(self.scheduler, self.stats, on_finish=self._count_cached)
        self.batch: ScheduledBatch | None = None  # the step in flight
        self.step_end_s: float | None = None
        self.duration_s = 0.0
        self.steps = 0  # steps started (a run may end with one in flight; `stats.steps` counts finished ones)
        self.prompt_tokens_cached = 0  # prefix-cache hits of finished requests' first admission (sessions' history)
        # ... and of their re-admissions after recompute preemption (`Request.num_recompute_cached_tokens`)
        self.recompute_tokens_cached = 0
        self.busy_s = 0.0

    # -- requests ------------------------------------------------------------------------

    def add(self, req: PreparedRequest, arrival_time: float) -> Request:
        self._validate(req)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            req.request_id,
            list(req.prompt_ids),
            params,
            arrival_time,
            RequestClass(req.req_class),
            SLO(req.slo_ttft_s, req.slo_tpot_s),
            frozenset(),
            self.spec.max_model_len,
        )
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str, now: float) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT, now)  # a row of the step in flight computes nothing
        return True

    def import_prefix(self, token_ids: list[int]) -> int:
        """Place the full blocks of `token_ids` in this worker's prefix cache, as a KV transfer
        from another worker would; returns the tokens now cached (0 when blocks are short)."""
        bs = self.spec.block_size
        n = len(token_ids) // bs
        pool = self.kv.pool
        if n == 0 or not pool.enable_caching or n > pool.num_free:
            return 0
        parent = None
        blocks = pool.allocate(n)
        for i, block in enumerate(blocks):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            pool.register(block, parent)
        pool.release(reversed(blocks))
        return n * bs

    # -- steps ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.batch is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def start_step(self, now: float) -> float | None:
        """Schedule the next batch at `now`; its simulated duration, or None if nothing runs."""
        batch = self.scheduler.schedule(now)
        self.bookkeeping.scheduled(batch)
        if not batch:
            return None
        duration = step_seconds(self.cost, batch, self.spec.kv_bytes_per_token, self.kv)
        if self._jitter is not None:
            duration *= self._jitter()
        self.batch, self.step_end_s, self.duration_s = batch, now + duration, duration
        self.steps += 1
        self.busy_s += duration
        return duration

    def finish_step(self) -> list[TokenEvent]:
        batch, now = self.batch, self.step_end_s
        self.batch = self.step_end_s = None
        sampled = [it.request for it in batch.items if not it.request.is_finished and produces_token(it)]
        self.bookkeeping.advance(batch.items)
        events = [self._emit(r, now) for r in sampled]
        self.bookkeeping.step_done(batch, self.duration_s)
        return events

    def _emit(self, request: Request, now: float) -> TokenEvent:
        token = self._token(request)
        stop = self.bookkeeping.append_token(request, token, None, now)
        if stop is not None:
            self.bookkeeping.finish(request, stop, now)
        return TokenEvent(
            request.request_id, now, [token], stop is not None, None if stop is None else stop[0].value, self.worker_id
        )

    def _count_cached(self, request: Request) -> None:
        self.prompt_tokens_cached += request.num_cached_tokens
        self.recompute_tokens_cached += request.num_recompute_cached_tokens

    def _token(self, request: Request) -> int:
        seed = zlib.crc32(request.request_id.encode())
        return (seed + 7919 * request.num_tokens) % self.spec.vocab_size

    # -- load ----------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        out = {"running_rt": 0, "waiting_rt": 0, "running_be": 0, "waiting_be": 0}
        for r in self.scheduler.running:
            out[f"running_{r.req_class.value}"] += 1
        for r in self.scheduler.waiting:
            out[f"waiting_{r.req_class.value}"] += 1
        return out

    def kv_usage(self) -> float:
        return self.kv.pool.usage()

    def queued_prefill_tokens(self) -> int:
        """Tokens the waiting requests still have to prefill (what a new arrival queues behind)."""
        return sum(max(0, r.num_tokens - r.num_computed_tokens) for r in self.scheduler.waiting)

    def mean_context_tokens(self) -> float | None:
        running = self.scheduler.running
        return sum(r.num_tokens for r in running) / len(running) if running else None

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` whose full blocks sit in this worker's prefix cache."""
        bs, pool, parent = self.spec.block_size, self.kv.pool, None
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            if pool.lookup(parent) is None:
                return i * bs
        return len(token_ids) // bs * bs

    def _validate(self, req: PreparedRequest) -> None:
        n = len(req.prompt_ids)
        if n >= self.spec.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but the model's context is {self.spec.max_model_len}")
        needed = min(n + req.max_tokens, self.spec.max_model_len)
        if needed > self.kv.capacity_tokens():
            raise ValueError(
                f"the request needs up to {needed} KV slots but the pool holds {self.kv.capacity_tokens()}"
            )
