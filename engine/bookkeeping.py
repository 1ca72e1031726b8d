"""What happens to requests after a batch ran: one implementation for the engine and the simulator.

`LLMEngine.step` runs the model and samples; `loadgen/sim/worker.py` prices the batch with the
cost model and makes up a token. Everything else a step does to its requests is here, and
both call it in the same order:

1. `scheduled(batch)` right after the policy chose the batch (scheduler time, preemptions,
   swaps);
2. `advance(items)` once the batch ran: each row's `num_computed_tokens` grows by its new
   tokens and its now-full blocks are committed to the prefix cache;
3. `append_token(...)` for each row that produced a token, then, when it must stop,
   `finish(...)` (the engine first lets its detokenizer turn a stop string into a stop);
4. `step_done(batch, seconds)`: step time and the policy's `on_step_end`.

So the simulator cannot drift from the engine by a hand-copied line; what is left in each is
what really differs (a forward pass and a sampler against a cost model and a stand-in token).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from engine.scheduling import FinishReason, Request, ScheduledBatch, ScheduledItem, Scheduler

Stop = tuple[FinishReason, str | int | None]  # why a request ends, and the stop string or token id


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
            **vars(self),  # flat scalars: what asdict gives, without its deep copy (once per step)
            "mean_schedule_time_s": self.mean_schedule_time_s,
            "schedule_overhead": self.schedule_overhead,
        }


def produces_token(item: ScheduledItem) -> bool:
    """Whether a row samples a token this step: its new tokens reach the end of the request's
    known tokens (the runner's rule for which rows get logits). Ask before `advance`."""
    request = item.request
    return request.num_computed_tokens + item.num_new_tokens == request.num_tokens


class StepBookkeeping:
    """Applies a step's outcome to its requests and counts it in `stats`.

    `on_finish(request)` runs for every request that stops (not for aborts), before the
    scheduler frees its blocks: the engine keeps a session turn's KV there, the simulator
    counts the request's prefix-cache hit.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        stats: EngineStats,
        on_finish: Callable[[Request], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.on_finish = on_finish

    def scheduled(self, batch: ScheduledBatch) -> None:
        """Count what the policy decided: its own time, preemptions, swaps and their bytes."""
        stats = self.stats
        stats.schedule_time_s += self.scheduler.last_schedule_s
        stats.schedule_calls += 1
        stats.preemptions += len(batch.preempted)
        stats.swap_outs += len(batch.swapped_out)
        stats.kv_copy_bytes += batch.swap_bytes

    def advance(self, items: Sequence[ScheduledItem], failed: Collection[Request] = ()) -> int:
        """The batch ran: advance each row's progress and commit its full blocks to the prefix
        cache. Rows in `failed` (their KV did not load) and rows whose request ended while the
        batch ran (aborted mid-step in the simulator) computed nothing. Returns the prefill
        tokens computed."""
        stats, kv = self.stats, self.scheduler.kv
        stats.steps += 1
        prefill_tokens = 0
        for item in items:
            request = item.request
            if request.is_finished or request in failed:
                continue
            if not request.is_prefill_done:
                prefill_tokens += item.num_new_tokens
            request.num_computed_tokens += item.num_new_tokens
            stats.tokens_computed += item.num_new_tokens
            kv.commit(request)
        stats.prompt_tokens_computed += prefill_tokens
        return prefill_tokens

    def append_token(self, request: Request, token: int, logprob: float | None, now: float) -> Stop | None:
        """Give a request its sampled token; returns why it must stop now, if it must (EOS,
        stop token id, `max_tokens`, context length; stop strings are the detokenizer's)."""
        if not request.is_prefill_done:  # its first token: the prefix-cache hit is final
            self.stats.prompt_tokens_cached += request.num_cached_tokens
        request.append_token(token, logprob, now)
        self.stats.generation_tokens += 1
        return request.check_stop()

    def finish(self, request: Request, stop: Stop, now: float | None = None) -> None:
        """End a request that stopped: record why, let `on_finish` see it, free its KV."""
        reason, stop_reason = stop
        request.stop_reason = stop_reason
        if self.on_finish is not None:
            self.on_finish(request)  # before finish frees the blocks it may copy from
        self.scheduler.finish(request, reason, now)

    def step_done(self, batch: ScheduledBatch, elapsed_s: float) -> None:
        """The step is over: add its duration and tell the policy (T_avg, adaptive caps)."""
        self.stats.step_time_s += elapsed_s
        self.scheduler.step_done(batch, elapsed_s)
