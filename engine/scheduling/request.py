"""A request and the runtime facts every scheduling policy may need.

Besides tokens and progress, a request carries its class (RT/BE), SLO targets and token
timings from the start: slack-based (BROS) and pending-time-based (Apt-Serve) policies read
them, and the worker reports achieved TTFT/TPOT from them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.kv.hidden import CacheForm
from engine.sampler import make_generator
from engine.sampling import SamplingParams


class RequestClass(str, enum.Enum):
    RT = "rt"  # interactive: per-token deadlines
    BE = "be"  # best effort: throughput only


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # admitted: holds KV blocks
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None  # deadline for the first token after arrival
    tpot_s: float | None = None  # deadline for every later inter-token gap


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    req_class: RequestClass = RequestClass.RT
    slo: SLO = SLO()
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    cache_salt: str | None = None  # prefix-cache isolation: hashes start from it (engine/kv/prefix_hash.py)

    # progress
    token_ids: list[int] = field(init=False)  # prompt + generated; grows by one per decode
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prefix-cache hit when first admitted (what usage reports)
    # prefix-cache hits of later admissions (after a recompute preemption): work the cache
    # saved that `num_cached_tokens` does not show
    num_recompute_cached_tokens: int = 0
    num_registered_blocks: int = 0  # blocks already published to the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # memo of full-block hashes
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    output_text: str | None = None  # final text, when the engine detokenized incrementally
    num_preemptions: int = 0
    # KV or HIDDEN; changed only while the request holds no cache (a conversion is "free and
    # re-prefill in the new form", docs/aptserve.md)
    cache_form: CacheForm = CacheForm.KV

    # timings (time.perf_counter seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.generator = make_generator(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        return self.first_token_time is not None

    def append_token(self, token_id: int, logprob: float | None, now: float) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def check_stop(self) -> tuple[FinishReason, int | None] | None:
        """Why generation must end after the last appended token, if it must."""
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP, last
            if last in self.params.stop_token_ids:
                return FinishReason.STOP, last
        if n_out >= self.params.max_tokens:
            return FinishReason.LENGTH, None
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None
