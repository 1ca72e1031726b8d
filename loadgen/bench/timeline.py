"""The timed run of `tandem bench engine`, step by step: where a request's first token waits.

`timed_run` adds every prompt at once and steps the engine until it is done, as `LLM.generate`
does, recording each step (when it started and ended, how many prompt tokens it prefilled, how
many tokens it sampled and how many of those were first tokens) and each request's timestamps
(arrival, first scheduled, first token, finish), all relative to the run's start. From these,
`ttft_breakdown` says what a median request's time to first token is made of: waiting to be
admitted (queueing behind earlier prompts under the token budget), its own prefill steps, and
how many steps, of which kind, ran before its first token. Issue 15 asked for this: the TTFT
gap to vLLM could be queueing, the budget, chunking, a slow first step or prefill attention,
and only per-step data tells them apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from loadgen.bench.common import percentile


@dataclass(frozen=True)
class StepRecord:
    """One engine step of the timed run (seconds since the run started)."""

    start_s: float
    end_s: float
    prefill_tokens: int  # prompt tokens run through the model this step
    sampled: int  # tokens sampled (decode rows plus prompts that finished their prefill)
    first_tokens: int  # of those, a request's first token


@dataclass(frozen=True)
class RequestRecord:
    """One request's timestamps (seconds since the run started; None: never reached)."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    first_token_step: int | None  # index into the run's steps


@dataclass(frozen=True)
class TimedRun:
    elapsed_s: float
    steps: list[StepRecord]
    requests: list[RequestRecord]

    def as_dict(self) -> dict:
        return {
            "steps": [asdict(s) for s in self.steps],
            "requests": [asdict(r) for r in self.requests],
            "ttft_breakdown": ttft_breakdown(self),
        }


def timed_run(engine, prompts: Sequence[list[int]], params: Sequence) -> TimedRun:
    """Add every prompt at once, step until done; `engine` is an `LLMEngine`."""
    stats = engine.stats
    start = time.perf_counter()
    requests = [engine.add_request(f"bench-{i}", list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    steps: list[StepRecord] = []
    while engine.has_unfinished():
        prefilled, sampled = stats.prompt_tokens_computed, stats.generation_tokens
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        firsts = sum(1 for o in outputs if o.request.num_output_tokens == 1)
        steps.append(
            StepRecord(
                t0 - start,
                t1 - start,
                stats.prompt_tokens_computed - prefilled,
                stats.generation_tokens - sampled,
                firsts,
            )
        )
    elapsed = time.perf_counter() - start
    rel = lambda t: None if t is None else t - start  # noqa: E731
    records = []
    for r in requests:
        first = rel(r.first_token_time)
        step = None if first is None else next(i for i, s in enumerate(steps) if s.end_s >= first)
        records.append(
            RequestRecord(
                r.num_prompt_tokens,
                r.num_output_tokens,
                rel(r.arrival_time),
                rel(r.first_scheduled_time),
                first,
                rel(r.finish_time),
                step,
            )
        )
    return TimedRun(elapsed, steps, records)


def ttft_breakdown(run: TimedRun) -> dict:
    """What the median request's first token waited on, and the steps that made the wait.

    - `queue_s`: arrival to first scheduled (prompts ahead of it in the token budget);
    - `prefill_s`: first scheduled to first token (its own prefill steps, chunked or not);
    - `steps_before_first_token`: steps up to and including the one that gave the median
      request its first token, and their durations: the first (first-call costs show here),
      the median of the others, and how many decode rows they carried in all.
    """
    done = [r for r in run.requests if r.first_token_s is not None]
    if not done:
        return {}
    ttfts = sorted(done, key=lambda r: r.first_token_s - r.arrival_s)
    median = ttfts[len(ttfts) // 2]
    upto = run.steps[: median.first_token_step + 1]
    durations = [s.end_s - s.start_s for s in upto]
    prefill_steps = [s for s in run.steps if s.prefill_tokens]
    return {
        "ttft_p50_s": percentile([r.first_token_s - r.arrival_s for r in done], 50),
        "median_request": {
            "prompt_tokens": median.prompt_tokens,
            "ttft_s": median.first_token_s - median.arrival_s,
            "queue_s": median.first_scheduled_s - median.arrival_s,
            "prefill_s": median.first_token_s - median.first_scheduled_s,
        },
        "queue_s_p50": statistics.median(r.first_scheduled_s - r.arrival_s for r in done),
        "prefill_s_p50": statistics.median(r.first_token_s - r.first_scheduled_s for r in done),
        "steps_before_first_token": len(upto),
        "first_step_s": durations[0],
        "other_steps_s_median": statistics.median(durations[1:]) if len(durations) > 1 else None,
        "prompt_tokens_before_first_token": sum(s.prefill_tokens for s in upto),
        "decode_rows_before_first_token": sum(s.sampled - s.first_tokens for s in upto),
        "prefill_steps": len(prefill_steps),
        "prefill_tokens_per_s": sum(s.prefill_tokens for s in prefill_steps)
        / sum(s.end_s - s.start_s for s in prefill_steps)
        if prefill_steps
        else None,
        "decode_only_step_s_median": statistics.median(
            [s.end_s - s.start_s for s in run.steps if not s.prefill_tokens] or [0.0]
        ),
    }
