"""What the engine hands back: per-step deltas and finished generations."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduling.request import Request


@dataclass(frozen=True)
class RequestMetrics:
    """Timings in time.perf_counter() seconds, and cache facts, of one request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @classmethod
    def of(cls, r: Request) -> RequestMetrics:
        return cls(
            r.arrival_time,
            r.first_scheduled_time,
            r.first_token_time,
            r.finish_time,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_cached_tokens,
            r.num_preemptions,
        )


@dataclass
class RequestOutput:
    """One request's news from one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # "" unless the request is detokenized incrementally
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    request: Request = field(repr=False)


@dataclass(frozen=True)
class StreamDelta:
    """One request's news from one step, as `AsyncLLM` streams it: plain values, read on the
    engine thread, safe to use on any other."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics | None  # set on the final delta
    token_texts: list[str] | None = None  # each token's own text, when logprobs were asked for
    # When the step that made it started and ended, its deltas then posted to the event loop
    # (wall-clock ns, engine/engine_thread.py): the worker times its hand-off by them.
    step_started_ns: int = 0
    posted_ns: int = 0


@dataclass
class GenerationOutput:
    """A finished request, as returned by `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    metrics: RequestMetrics
