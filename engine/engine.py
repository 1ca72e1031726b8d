"""The engine core: one synchronous `step()` = schedule, run the model, sample, emit, publish.

Both the offline `LLM` and the asyncio `AsyncLLM` drive this class; neither adds
scheduling logic of its own. Everything here runs on one thread (the caller's, or AsyncLLM's
engine thread); what other threads may read is `info` and the `snapshot` each step publishes.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import torch

from engine.bookkeeping import EngineStats, StepBookkeeping
from engine.config import EngineConfig, ModelConfig
from engine.emitter import OutputEmitter
from engine.engine_setup import (
    aptserve_needs_rho,
    attach_hidden_cache,
    check_partial_residency,
    cost_model_at_start,
    make_kv_cache,
    max_model_len,
    policy_options,
)
from engine.kv import PartialResidency
from engine.loader.formats import load_architecture, load_weights
from engine.models import build_model
from engine.models.kv_expand import expand_kv_heads
from engine.models.packed_linear import pack_linear_layers, packing_pays
from engine.outputs import RequestOutput
from engine.platform_tuning import tune_allocator
from engine.profiling import ProfileTarget
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.scheduling import (
    SLO,
    BatchLimits,
    CacheForm,
    Request,
    RequestClass,
    RequestStatus,
    Scheduler,
    SchedulerState,
    make_policy,
)
from engine.sessions import KVLayout, SessionStore
from engine.snapshot import EngineInfo, EngineSnapshot, take_snapshot
from kernels.greedy import choose_argmax
from kernels.layer_ops import choose_layer_ops

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = config.resolved()  # dtype "auto" decided for this machine, once
        self.config = config
        decode_kernel = config.decode_kernel  # an unknown or unusable choice fails before loading
        if config.uncached_ratio or config.policy == "ellm":
            check_partial_residency(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.config.device == "cpu":
            tune_allocator()
        arch = load_architecture(config.model, config.load_format)
        source = arch.source  # None for a built-in architecture (dummy weights, no files)
        self.model_config: ModelConfig = arch.config
        self.tokenizer = arch.tokenizer  # None: token ids in and out only
        self.max_model_len = max_model_len(config, self.model_config)
        self.device = torch.device(config.device)
        layer_ops = choose_layer_ops(config.fused_ops, self.device, config.torch_dtype)
        self.model = build_model(self.model_config, self.max_model_len, config.torch_dtype, self.device, layer_ops)
        load_weights(self.model, arch, config.load_format, config.seed)
        if config.kv_heads_expand:  # before packing: the QKV projection is rebuilt
            self.model_config = expand_kv_heads(self.model, self.model_config)
        if config.packed_weights and packing_pays(self.model, config.torch_dtype, self.device):
            pack_linear_layers(self.model)
        self.kv, self.storage = make_kv_cache(config, self.model_config, self.device)
        self.hidden_blocks = attach_hidden_cache(config, self.model_config, self.kv, self.storage)
        limits = BatchLimits(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.runner = ModelRunner(
            self.model,
            self.storage,
            self.kv,
            self.device,
            decode_kernel,
            fallback=config.attention == "auto",
            compile_layers=config.layers_compiled,
            prefill_in_kernel=config.prefill_attention == "auto",
        )
        # A given profile is loaded for every policy (the scheduler's SLO placement reads it from
        # the worker's telemetry); the policies that need one profile at start without it.
        # `profile_record` says which profile the policy plans from and how far it is trusted.
        needs_profile = config.policy in ("bros", "ellm") or aptserve_needs_rho(config, self.hidden_blocks)
        planned = cost_model_at_start(config, source, needs_profile, self.profile_target)
        self.cost_model = planned.model if planned else None
        self.profile_record = planned.record if planned else None
        in_session = lambda r: r.request_id in self.sessions.turns  # noqa: E731 (sessions are built below)
        options = policy_options(config, self.cost_model, self.model_config.num_layers, in_session)
        self.scheduler = Scheduler(self.kv, limits, make_policy(config.policy, **options))
        self.sessions = SessionStore(
            config,
            KVLayout.of(self.model_config, config.dtype, config.block_size),
            self.kv,
            self.storage,
            self.cost_model,
        )
        self.kv.reclaim = self.sessions.reclaim  # session pins yield to memory pressure
        if config.uncached_ratio:
            self._attach_partial_residency(config)
        self.sampler = Sampler(config.seed, argmax=choose_argmax(config.greedy_kernel, self.device))
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | self._tokenizer_eos()
        self.stats = EngineStats()
        self.bookkeeping = StepBookkeeping(self.scheduler, self.stats, on_finish=self._keep_session_turn)
        self.emitter = OutputEmitter(self.sampler, self.bookkeeping, self.eos_token_ids)
        self.last_logits: tuple[list[Request], torch.Tensor] | None = None  # for tests and debugging
        self.info = EngineInfo(
            model=config.model,
            model_name=self.model_config.name,
            device=config.device,
            dtype=config.dtype,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            block_size=config.block_size,
            kv_blocks=self.kv.pool.num_blocks,
            max_num_seqs=config.max_num_seqs,
            policy=config.policy,
            cost_model=self.cost_model,
        )
        self.snapshot: EngineSnapshot = self._take_snapshot(0)
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.2f GiB), policy %s",
            self.model_config.name,
            self.kv.pool.num_blocks,
            config.block_size,
            self.storage.nbytes / 2**30,
            config.policy,
        )

    def _attach_partial_residency(self, config: EngineConfig) -> None:
        """eLLM's partial residency for every request but session turns (docs/ellm.md says why)."""
        turns = self.sessions.turns
        self.kv.attach(
            functools.partial(
                PartialResidency,
                ratio=config.uncached_ratio,
                excluded=lambda r: r.request_id in turns,
                source=config.uncached_source,
            )
        )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        req_class: RequestClass = RequestClass.RT,
        slo: SLO = SLO(),
        arrival_time: float | None = None,
        stream_text: bool = False,
        resumed_output_ids: Sequence[int] = (),
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request. Raises ValueError for input the engine can never serve.

        `cache_salt`: the request shares prefix-cache blocks (and session KV) only with requests
        of the same salt (`engine/kv/prefix_hash.py`).

        `session_id`: a turn of that session: its kept KV is reused (prefix match on tokens,
        promoted from host or disk if needed) and the grown KV is kept when it finishes.

        `resumed_output_ids`: output tokens an earlier attempt already delivered (its worker
        died). They extend the prompt, and the detokenizer consumes them silently, so the text
        stream continues exactly where the client's copy ends.
        """
        full_prompt = list(prompt_token_ids) + list(resumed_output_ids)
        self.validate(full_prompt, params)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer and this model has none (dummy weights): use stop_token_ids"
            )
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError("session_id must be a non-empty string")
        request = Request(
            request_id,
            full_prompt,
            params,
            arrival_time or time.perf_counter(),
            req_class,
            slo,
            self.eos_token_ids,
            self.max_model_len,
            cache_salt=cache_salt,
        )
        if session_id is not None and self.config.policy == "aptserve":
            raise ValueError("sessions keep K/V; the aptserve policy (which may pick HIDDEN) does not serve them yet")
        if self.config.cache_form == "hidden":
            if session_id is not None:
                raise ValueError("sessions keep K/V; they cannot be served with cache_form='hidden'")
            request.cache_form = CacheForm.HIDDEN
        self.scheduler.add(request)
        if session_id is not None:
            self.sessions.begin_turn(request, session_id)
        if (stream_text or params.stop) and self.tokenizer is not None:  # no tokenizer: outputs are ids only
            self.emitter.open_text(request_id, self.tokenizer, prompt_token_ids, params, resumed_output_ids)
        return request

    def abort(self, request_id: str) -> Request | None:
        self.emitter.drop(request_id)
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.sessions.end_turn(request, keep=False)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def check_invariants(self) -> None:
        """The KV manager's consistency check with the session store's pins counted as holders
        (tests and debugging; `KVCacheManager.check_invariants` alone sees only block tables)."""
        self.kv.check_invariants(outside=self.sessions.pins.held_blocks())

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; its end publishes a fresh `snapshot`, also when there was nothing to run."""
        outputs = self._step()
        self.snapshot = self._take_snapshot(self.snapshot.seq + 1)
        return outputs

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.sessions.active:  # pins to release, loads to retire, disk writes to account
            self.sessions.before_step()
        batch = self.scheduler.schedule(start)
        self.bookkeeping.scheduled(batch)
        if batch.copies:  # checkpoints, swaps and restores the policy decided, before the forward pass
            self.storage.execute(batch.copies)
        if not batch:
            return []
        waiter = self.sessions.waiter(batch.items) if self.sessions.loading else None
        result = self.runner.execute(batch.items, None if waiter is None else waiter.wait_layer)
        failed = self._recompute_failed_loads(waiter) if waiter is not None else ()
        prefill_tokens = self.bookkeeping.advance(batch.items, failed)
        outputs = []
        if result.logits is not None:
            logits, sampled = self._without(result.logits, result.sampled, failed)
            self.last_logits = (sampled, logits)
            outputs = self.emitter.sample_and_emit(logits, sampled) if sampled else []
        elapsed = time.perf_counter() - start
        if prefill_tokens:
            self.sessions.record_prefill(prefill_tokens, elapsed)
        self.bookkeeping.step_done(batch, elapsed)
        return outputs

    def _take_snapshot(self, seq: int) -> EngineSnapshot:
        pool = self.kv.pool
        return take_snapshot(
            seq,
            self.scheduler.running,
            self.scheduler.waiting,
            pool.num_free,
            pool.capacity,
            self.sessions.stats.as_dict(),
            self.stats.as_dict(),
            self.scheduler.policy.published_stats(),
        )

    def _recompute_failed_loads(self, waiter) -> set[Request]:
        """Requests whose promoted KV failed to load (checksum, I/O) go back to be recomputed."""
        failed = set(waiter.failed_requests())
        if not failed:
            return failed
        self.sessions.retire_failed()  # the bad blocks leave the prefix cache before anyone re-matches them
        state = SchedulerState(
            self.scheduler.waiting, self.scheduler.running, self.kv, self.scheduler.limits, time.perf_counter()
        )
        for request in failed:
            if request.status is RequestStatus.RUNNING:
                state.preempt(request)
                request.first_scheduled_time = None  # re-admission records what is really reused
                request.num_cached_tokens = 0
        return failed

    @staticmethod
    def _without(logits: torch.Tensor, sampled: list[Request], failed) -> tuple[torch.Tensor, list[Request]]:
        if not failed:
            return logits, sampled
        keep = [i for i, r in enumerate(sampled) if r not in failed]
        return logits[keep], [sampled[i] for i in keep]

    def _keep_session_turn(self, request: Request) -> None:
        self.sessions.end_turn(request, keep=True)  # a no-op for requests outside sessions

    # -- set-up helpers ------------------------------------------------------------------

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the engine can never serve this prompt with these params."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but the model's context is {self.max_model_len} tokens "
                f"(prompt plus at least one generated token must fit)"
            )
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        needed = min(len(prompt) + params.max_tokens, self.max_model_len)
        capacity = self.kv.capacity_tokens()
        if self.config.cache_form == "hidden":
            capacity = self.hidden_blocks.capacity_tokens()
        if needed > capacity:
            raise ValueError(
                f"the request needs up to {needed} KV slots but the KV cache holds {capacity}; "
                f"lower max_tokens or raise --kv-cache-gib"
            )

    def profile_target(self) -> ProfileTarget:
        """What the profiler drives and reads. Needs only the model, runner and KV cache, so the
        constructor can profile before the scheduler and the session store exist."""
        return ProfileTarget(
            execute=self.runner.execute,
            copy_blocks=self.storage.execute,
            kv=self.kv,
            config=self.config,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            model_name=self.model_config.name,
            decode_kernel=self.runner.decode_kernel,
            compiled_layers=self.runner.decode_graph is not None,
            # ρ is worth measuring only where a policy may pick HIDDEN (it saves memory)
            calibrate_hidden=self.hidden_blocks is not None and self.hidden_blocks.layout.saves_memory,
            # what a host-read prefix step costs, where ellm may read prefixes from host
            calibrate_prefix=self.config.policy == "ellm" and self.config.uncached_source != "rebuild",
            calibrate_rebuild=self.config.policy == "ellm" and self.config.uncached_source != "host",
            prefix_read="copy" if self.storage.host_offset is None else "in_place",
        )

    def _tokenizer_eos(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return frozenset() if eos is None else frozenset([eos])
