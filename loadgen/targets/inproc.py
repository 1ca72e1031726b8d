"""The in-process engine as a target: `LLMEngine.step()` in this thread, no services.

Each `advance` runs one engine step and timestamps the tokens it produced when the step
returns (what a streaming client would see, minus transport). With nothing to run it sleeps
until the next submission is due.

`ModelClock` replaces the wall clock by the cost model's estimate of each executed batch:
the engine still makes every decision and runs the real model, but time advances as the
simulator would advance it. Policies that read time (slack, pending time) see the engine's
wall-clock timestamps, so this mode is a harness for comparing the simulator's bookkeeping
with the engine's (tests, docs/simulator.md), not a way to run time-driven policies.
"""

from __future__ import annotations

import time

from loadgen.sim.step_time import batch_rows, step_seconds
from loadgen.targets.base import LoadSample, PreparedRequest, StepTarget, TokenEvent


class WallClock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def begin(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def to_engine(self, t: float) -> float:
        return self.t0 + t

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(min(delay, 0.25))  # short naps keep the progress bar alive


class ModelClock(WallClock):
    def __init__(self, cost, bytes_per_token: int = 0) -> None:
        super().__init__()
        self.cost, self.bytes_per_token, self.virtual = cost, bytes_per_token, 0.0

    def begin(self) -> None:
        super().begin()
        self.virtual = 0.0

    def now(self) -> float:
        return self.virtual

    def wait_until(self, t: float) -> None:
        self.virtual = max(self.virtual, t)


class InprocTarget(StepTarget):
    name = "inproc"

    def __init__(self, engine, clock: WallClock | None = None) -> None:
        self.engine = engine
        self.clock = clock or WallClock()
        self.step_log: list[tuple[list, list, float]] = []  # (prefill rows, decode rows, wall seconds)
        self._rows = None
        self._prev_end: float | None = None
        self._wrap_scheduler()

    @classmethod
    def from_config(cls, config, policy_options: dict | None = None, clock: WallClock | None = None) -> InprocTarget:
        from engine import LLMEngine
        from engine.scheduling import make_policy

        engine = LLMEngine(config)
        if policy_options:  # a policy that needs a cost model or default SLOs
            engine.scheduler.policy = make_policy(config.policy, **policy_options)
        return cls(engine, clock)

    def _wrap_scheduler(self) -> None:
        """Keep each step's batch (before it runs) so a model clock can price it."""
        scheduler = self.engine.scheduler
        schedule = scheduler.schedule

        def capture(now=None):
            batch = schedule(now)
            self._last_batch = batch
            if batch:
                self._priced = self._price(batch)
                self._rows = batch_rows(batch.items, self.engine.kv)  # before the step advances progress
            return batch

        self._last_batch = None
        self._priced = 0.0
        scheduler.schedule = capture

    def _price(self, batch) -> float:
        if isinstance(self.clock, ModelClock):
            return step_seconds(self.clock.cost, batch, self.clock.bytes_per_token, self.engine.kv)
        return 0.0

    # -- StepTarget ----------------------------------------------------------------------

    def begin(self) -> None:
        self.clock.begin()

    def now(self) -> float:
        return self.clock.now()

    def submit(self, request: PreparedRequest) -> None:
        from engine import SamplingParams
        from engine.scheduling import SLO, RequestClass

        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(
            request.request_id,
            request.prompt_ids,
            params,
            req_class=RequestClass(request.req_class),
            slo=SLO(request.slo_ttft_s, request.slo_tpot_s),
            arrival_time=self.clock.to_engine(request.arrival_s),
        )

    def advance(self, until_s: float) -> list[TokenEvent]:
        if not self.engine.has_unfinished():
            self.clock.wait_until(until_s)
            return []
        self._last_batch = None
        start = time.perf_counter()
        outputs = self.engine.step()
        if self._last_batch:
            # back-to-back steps: charge the loop's own time between them to the step too
            end = time.perf_counter()
            begin = self._prev_end if self._prev_end is not None and start - self._prev_end < 0.05 else start
            self.step_log.append((*self._rows, end - begin))
            self._prev_end = end
        if not self._last_batch:  # nothing could run: let time pass (a model clock would stall)
            self.clock.wait_until(until_s)
        elif isinstance(self.clock, ModelClock):
            self.clock.virtual += self._priced
        t = self.now()
        return [TokenEvent(o.request_id, t, list(o.new_token_ids), o.finished, o.finish_reason) for o in outputs]

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load(self) -> LoadSample:
        s = self.engine.scheduler
        return LoadSample(self.now(), self.engine.kv.pool.usage(), len(s.running), len(s.waiting))

    def describe(self) -> dict:
        cfg = self.engine.config
        return {
            "target": "inproc",
            "model": cfg.model,
            "policy": cfg.policy,
            "dtype": cfg.dtype,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "kv_blocks": self.engine.kv.pool.num_blocks,
            "block_size": cfg.block_size,
            "clock": "model" if isinstance(self.clock, ModelClock) else "wall",
            "engine_stats": _stats(self.engine),
            "policy_stats": _policy_stats(self.engine),
            "steps_logged": len(self.step_log),
            "cost_model_meta": getattr(getattr(self.engine, "cost_model", None), "meta", None),
            # which profile the policy planned from, and how far it is trusted (engine/profile_cache.py)
            "cost_model_profile": _profile_record(self.engine),
        }


def _profile_record(engine) -> dict | None:
    record = getattr(engine, "profile_record", None)
    return record.as_dict() if record is not None else None


def _stats(engine) -> dict | None:
    import dataclasses

    stats = getattr(engine, "stats", None)
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None


def _policy_stats(engine) -> dict | None:
    """The policy's own published totals where it keeps any (ellm's `DecisionStats`: its
    choices and its decision time, wall and CPU)."""
    stats = getattr(getattr(getattr(engine, "scheduler", None), "policy", None), "stats", None)
    return stats.as_dict() if hasattr(stats, "as_dict") else None
