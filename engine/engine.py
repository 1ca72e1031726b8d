"""The engine core: one synchronous `step()` = schedule, run the model, sample, emit.

Both the offline `LLM` and the asyncio `AsyncLLM` drive this class; neither adds
scheduling logic of its own.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv import BlockPool, KVCacheManager, KVCacheStorage, PartialResidency, num_blocks_for_budget
from engine.kv.partial import check_ratio
from engine.kv.storage import bytes_per_block
from engine.loader.formats import load_architecture, load_weights
from engine.models import build_model
from engine.models.packed_linear import pack_linear_layers, packing_supported
from engine.outputs import RequestOutput
from engine.platform_tuning import tune_allocator
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.scheduling import (
    SLO,
    BatchLimits,
    FinishReason,
    Request,
    RequestClass,
    RequestStatus,
    Scheduler,
    SchedulerState,
    make_policy,
)
from engine.sessions import KVLayout, SessionStore

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prefill tokens actually run through the model
    prompt_tokens_cached: int = 0  # prefill tokens served by the prefix cache
    generation_tokens: int = 0
    tokens_computed: int = 0  # every token run through the model, recomputation included
    preemptions: int = 0  # recompute preemptions (KV dropped)
    swap_outs: int = 0  # whole requests moved to host
    kv_copy_bytes: int = 0  # host <-> device bytes (checkpoints, swaps, restores)
    schedule_time_s: float = 0.0  # total time in the scheduler (mean per step: / schedule_calls)
    schedule_calls: int = 0
    step_time_s: float = 0.0  # total wall time of steps that ran a batch (schedule + copies + forward + sample)

    @property
    def mean_schedule_time_s(self) -> float:
        return self.schedule_time_s / self.schedule_calls if self.schedule_calls else 0.0

    @property
    def schedule_overhead(self) -> float:
        """Scheduler time as a fraction of step time (the paper's Fig. 14 metric)."""
        return self.schedule_time_s / self.step_time_s if self.step_time_s else 0.0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_schedule_time_s": self.mean_schedule_time_s,
            "schedule_overhead": self.schedule_overhead,
        }


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = config.resolved()  # dtype "auto" decided for this machine, once
        self.config = config
        decode_kernel = config.decode_kernel  # an unknown or unusable choice fails before loading
        if config.uncached_ratio or config.policy == "ellm":
            self._check_partial_residency(config, decode_kernel)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.config.device == "cpu":
            tune_allocator()
        arch = load_architecture(config.model, config.load_format)
        source = arch.source  # None for a built-in architecture (dummy weights, no files)
        self.model_config: ModelConfig = arch.config
        self.tokenizer = arch.tokenizer  # None: token ids in and out only
        self.max_model_len = self._max_model_len(config, self.model_config)
        self.device = torch.device(config.device)
        self.model = build_model(self.model_config, self.max_model_len, config.torch_dtype, self.device)
        load_weights(self.model, arch, config.load_format, config.seed)
        if config.packed_weights and packing_supported(config.torch_dtype, self.device):
            pack_linear_layers(self.model)
        self.kv, self.storage = self._make_kv_cache(config)
        limits = BatchLimits(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.runner = ModelRunner(
            self.model,
            self.storage,
            self.kv,
            self.device,
            decode_kernel,
            fallback=config.attention == "auto",
            compile_layers=config.compile_layers,
        )
        self.cost_model = None
        if config.policy in ("bros", "ellm"):
            self.cost_model = self._cost_model(config, source)
        self.scheduler = Scheduler(self.kv, limits, make_policy(config.policy, **self._policy_options(config)))
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
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | self._tokenizer_eos()
        self.stats = EngineStats()
        self.last_logits: tuple[list[Request], torch.Tensor] | None = None  # for tests and debugging
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.2f GiB), policy %s",
            self.model_config.name,
            self.kv.pool.num_blocks,
            config.block_size,
            self.storage.nbytes / 2**30,
            config.policy,
        )

    @staticmethod
    def _check_partial_residency(config: EngineConfig, decode_kernel: str) -> None:
        """The combinations partial residency refuses, before anything is loaded (docs/ellm.md)."""
        check_ratio(config.uncached_ratio)
        if config.policy == "bros":
            raise ValueError(
                "uncached_ratio > 0 cannot be combined with policy 'bros': BROS shares one block between "
                "two requests' ends, and a shared block cannot leave the pool for one of them (docs/ellm.md)"
            )
        if config.policy == "ellm" and config.uncached_ratio:
            raise ValueError("policy 'ellm' chooses the uncached ratio itself each step: leave uncached_ratio at 0")
        if decode_kernel == "triton":
            raise ValueError(
                "partial residency (uncached_ratio > 0, policy 'ellm') needs attention 'reference' or 'fused': "
                "the Triton kernels have no rebuilt-prefix path yet (docs/ellm.md)"
            )

    def _attach_partial_residency(self, config: EngineConfig) -> None:
        """eLLM's partial residency for every request but session turns (docs/ellm.md says why)."""
        turns = self.sessions.turns
        self.kv.attach(
            functools.partial(PartialResidency, ratio=config.uncached_ratio, excluded=lambda r: r.request_id in turns)
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
    ) -> Request:
        """Queue a request. Raises ValueError for input the engine can never serve.

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
        )
        self.scheduler.add(request)
        if session_id is not None:
            self.sessions.begin_turn(request, session_id)
        if (stream_text or params.stop) and self.tokenizer is not None:  # no tokenizer: outputs are ids only
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if resumed_output_ids:
                self._detokenizers[request_id].push(list(resumed_output_ids))  # the client has this text
        return request

    def abort(self, request_id: str) -> Request | None:
        self._detokenizers.pop(request_id, None)
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.sessions.end_turn(request, keep=False)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.sessions.active:  # pins to release, loads to retire, disk writes to account
            self.sessions.before_step()
        batch = self.scheduler.schedule(start)
        self._count_schedule(batch)
        if batch.copies:  # checkpoints, swaps and restores the policy decided, before the forward pass
            self.storage.execute(batch.copies)
        if not batch:
            return []
        waiter = self.sessions.waiter(batch.items) if self.sessions.loading else None
        result = self.runner.execute(batch.items, None if waiter is None else waiter.wait_layer)
        failed = self._recompute_failed_loads(waiter) if waiter is not None else ()
        self.stats.steps += 1
        prefill_tokens = 0
        for item in batch.items:
            request = item.request
            if request in failed:
                continue
            if not request.is_prefill_done:
                prefill_tokens += item.num_new_tokens
            request.num_computed_tokens += item.num_new_tokens
            self.stats.tokens_computed += item.num_new_tokens
            self.kv.commit(request)
        self.stats.prompt_tokens_computed += prefill_tokens
        outputs = []
        if result.logits is not None:
            logits, sampled = self._without(result.logits, result.sampled, failed)
            self.last_logits = (sampled, logits)
            outputs = self._sample_and_emit(logits, sampled) if sampled else []
        elapsed = time.perf_counter() - start
        if prefill_tokens:
            self.sessions.record_prefill(prefill_tokens, elapsed)
        self.stats.step_time_s += elapsed
        self.scheduler.step_done(batch, elapsed)
        return outputs

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

    def _count_schedule(self, batch) -> None:
        self.stats.schedule_time_s += self.scheduler.last_schedule_s
        self.stats.schedule_calls += 1
        self.stats.preemptions += len(batch.preempted)
        self.stats.swap_outs += len(batch.swapped_out)
        self.stats.kv_copy_bytes += batch.swap_bytes

    def _sample_and_emit(self, logits: torch.Tensor, sampled: list[Request]) -> list[RequestOutput]:
        out = self.sampler.sample(
            logits, [r.params for r in sampled], [r.generator for r in sampled], self._banned_ids(sampled)
        )
        now = time.perf_counter()
        outputs = []
        for i, request in enumerate(sampled):
            if not request.is_prefill_done:
                self.stats.prompt_tokens_cached += request.num_cached_tokens
            logprob = out.logprobs[i] if request.params.logprobs and out.logprobs is not None else None
            request.append_token(out.token_ids[i], logprob, now)
            self.stats.generation_tokens += 1
            outputs.append(self._emit(request, out.token_ids[i], logprob))
        return outputs

    def _emit(self, request: Request, token: int, logprob: float | None) -> RequestOutput:
        stop = request.check_stop()
        detok = self._detokenizers.get(request.request_id)
        text = ""
        if detok is not None:
            ends_on_token = stop is not None and stop[0] is FinishReason.STOP
            text = "" if ends_on_token else detok.push([token])
            if detok.stopped_by is not None:
                stop = (FinishReason.STOP, detok.stopped_by)
            elif stop is not None:
                text += detok.finish()
        if stop is not None:
            request.stop_reason = stop[1]
            self.sessions.end_turn(request, keep=True)  # before finish frees the blocks it copies from
            self.scheduler.finish(request, stop[0])
            if detok is not None:
                request.output_text = detok.text
            self._detokenizers.pop(request.request_id, None)
        return RequestOutput(
            request.request_id,
            [token],
            text,
            None if logprob is None else [logprob],
            stop is not None,
            None if stop is None else stop[0].value,
            request,
        )

    def _banned_ids(self, requests: list[Request]) -> list[list[int]] | None:
        """EOS and stop ids may not be sampled before min_tokens outputs."""
        bans = []
        for r in requests:
            if r.num_output_tokens < r.params.min_tokens:
                ids = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(self.eos_token_ids))
                bans.append(ids)
            else:
                bans.append([])
        return bans if any(bans) else None

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
        if needed > capacity:
            raise ValueError(
                f"the request needs up to {needed} KV slots but the KV cache holds {capacity}; "
                f"lower max_tokens or raise --kv-cache-gib"
            )

    @staticmethod
    def _max_model_len(config: EngineConfig, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context of {limit} tokens")
        return config.max_model_len

    def _make_kv_cache(self, config: EngineConfig) -> tuple[KVCacheManager, KVCacheStorage]:
        dtype = config.torch_dtype
        num_blocks = config.num_blocks or num_blocks_for_budget(
            self.model_config, config.block_size, dtype, config.kv_cache_gib
        )
        pool = BlockPool(num_blocks, config.enable_prefix_caching)
        block_bytes = bytes_per_block(self.model_config, config.block_size, dtype)
        host_blocks = config.num_host_blocks
        if host_blocks is None:
            host_blocks = int(config.swap_space_gib * 2**30) // block_bytes
        storage = KVCacheStorage(self.model_config, num_blocks, config.block_size, dtype, self.device, host_blocks)
        kv = KVCacheManager(
            pool, config.block_size, bytes_per_token=block_bytes // config.block_size, host_blocks=host_blocks
        )
        return kv, storage

    def _policy_options(self, config: EngineConfig) -> dict:
        if config.policy == "ellm":  # session turns stay resident (docs/ellm.md)
            excluded = lambda r: r.request_id in self.sessions.turns  # noqa: E731 (sessions are built later)
            return {"cost_model": self.cost_model, "default_slo": SLO(None, config.rt_tpot_s), "excluded": excluded}
        if config.policy != "bros":
            return {}
        return {
            "cost_model": self.cost_model,
            "default_slo": SLO(config.rt_ttft_s, config.rt_tpot_s),
            "base_cap": config.bros_base_cap,
        }

    def _cost_model(self, config: EngineConfig, source):
        """The profiled step-time model: a given file, the on-disk cache, or a fresh profile."""
        from engine.cost_model import CostModel
        from engine.profiling import profile, profile_cached

        if config.cost_model_path:
            return CostModel.load(config.cost_model_path)
        if source is None:  # a built-in architecture has no files to key a cached profile on
            return profile(self)
        return profile_cached(self, source)

    def _tokenizer_eos(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return frozenset() if eos is None else frozenset([eos])
