"""Turn a `WorkloadConfig` into the submissions and closed-loop sources of one run.

The same config and seed always give the same requests, in the same order, with the same
open-loop arrival times: that is what makes policy comparisons fair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from loadgen.arrivals import ArrivalSpec, open_loop_times
from loadgen.workloads.datasets import LengthProfile, get_profile
from loadgen.workloads.jsonl import estimate_tokens, load_jsonl
from loadgen.workloads.sources import BEBacklog, ClosedUser, HumanSpeeds, Session, SessionUser, Source
from loadgen.workloads.spec import RequestSpec, SLOSpec, Submission

SINGLE_TURN = ("sharegpt", "sharegpt-opt", "lmsys", "code", "summarisation", "sharegpt-ellm")
WORKLOADS = (*SINGLE_TURN, "jsonl", "sessions", "rt-be", "be")


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "sharegpt"
    arrival: ArrivalSpec = ArrivalSpec()
    duration_s: float = 60.0
    seed: int = 0
    length_scale: float = 1.0
    slo_scale: float = 1.0
    slo_ttft_s: float | None = None  # overrides (after scaling)
    slo_tpot_s: float | None = None
    max_len: int | None = None  # the model's context: prompt + output must fit
    rt_profile: str = "sharegpt"  # lengths of sessions' turns and of rt-be's RT requests
    dataset_path: str | None = None
    be_batch: int = 0  # > 0 adds a standing BE backlog (rt-be defaults to 16)
    be_refill: str = "batch"
    turns_mean: float = 4.0  # sessions: turns per session (geometric, >= 1)
    # closed-loop sessions: users start typing at uniform offsets in [0, ramp) instead of all at
    # t=0 (a ramp of one mean turn cycle makes the first turns arrive at the steady rate)
    users_ramp_s: float = 0.0
    speeds: HumanSpeeds = field(default_factory=HumanSpeeds)


@dataclass
class Workload:
    config: WorkloadConfig
    open_loop: list[Submission]
    sources: list[Source]

    def describe(self) -> dict:
        return {
            "name": self.config.name,
            "open_loop_requests": len(self.open_loop),
            "closed_loop_sources": len(self.sources),
        }


def build_workload(cfg: WorkloadConfig, count_tokens: Callable[[str], int] = estimate_tokens) -> Workload:
    if cfg.name not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.name!r}; available: {', '.join(WORKLOADS)}")
    if cfg.duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {cfg.duration_s}")
    rng = np.random.default_rng([cfg.seed, 0])
    open_loop: list[Submission] = []
    sources: list[Source] = []
    if cfg.name == "jsonl":
        open_loop, sources = _jsonl(cfg, rng, count_tokens)
    elif cfg.name == "sessions":
        sources = _sessions(cfg, rng)
    elif cfg.name != "be":
        open_loop, sources = _single_turn(cfg, rt_profile(cfg), rng)
    be_batch = cfg.be_batch or (16 if cfg.name in ("rt-be", "be") else 0)
    if be_batch:
        sources.append(
            BEBacklog(
                _profile(cfg, "be"),
                be_batch,
                cfg.be_refill,
                np.random.default_rng([cfg.seed, 1]),
                cfg.duration_s,
                cfg.max_len,
            )
        )
    return Workload(cfg, open_loop, sources)


def _profile(cfg: WorkloadConfig, name: str) -> LengthProfile:
    prof = get_profile(name).scaled(cfg.length_scale, cfg.slo_scale)
    if prof.req_class == "rt" and (cfg.slo_ttft_s is not None or cfg.slo_tpot_s is not None):
        slo = SLOSpec(
            cfg.slo_ttft_s if cfg.slo_ttft_s is not None else prof.slo.ttft_s,
            cfg.slo_tpot_s if cfg.slo_tpot_s is not None else prof.slo.tpot_s,
        )
        prof = replace(prof, slo=slo)
    return prof


def rt_profile(cfg: WorkloadConfig) -> LengthProfile:
    return _profile(cfg, cfg.name if cfg.name in SINGLE_TURN else cfg.rt_profile)


def _single_turn(cfg: WorkloadConfig, prof: LengthProfile, rng) -> tuple[list[Submission], list[Source]]:
    if cfg.arrival.kind == "closed":
        return [], _closed_users(cfg, prof)
    out = []
    for i, t in enumerate(open_loop_times(cfg.arrival, cfg.duration_s, rng)):
        p, o = prof.sample_pair(rng, cfg.max_len)
        out.append(Submission(t, RequestSpec(f"rt-{i}", "rt", p, o, prof.slo)))
    return out, []


def _closed_users(cfg: WorkloadConfig, prof: LengthProfile) -> list[Source]:
    if cfg.arrival.users < 1:
        raise ValueError("closed-loop arrivals need --users N (N >= 1)")
    return [
        ClosedUser(f"u{i}", prof, np.random.default_rng([cfg.seed, 100 + i]), cfg.duration_s, cfg.max_len)
        for i in range(cfg.arrival.users)
    ]


def _sessions(cfg: WorkloadConfig, rng) -> list[Source]:
    if cfg.turns_mean < 1:
        raise ValueError(f"turns per session must average >= 1, got {cfg.turns_mean}")
    prof = _profile(cfg, cfg.rt_profile)
    if cfg.arrival.kind == "closed":
        if cfg.arrival.users < 1:
            raise ValueError("closed-loop sessions need --users N (N >= 1)")
        if cfg.users_ramp_s < 0:
            raise ValueError(f"the users' ramp must be >= 0 s, got {cfg.users_ramp_s}")
        # their own generator, so a ramp changes when users start, never what they send
        starts = np.random.default_rng([cfg.seed, 2]).uniform(0.0, cfg.users_ramp_s, cfg.arrival.users)
        return [
            SessionUser(
                f"u{i}",
                cfg.turns_mean,
                prof,
                cfg.speeds,
                np.random.default_rng([cfg.seed, 1000 + i]),
                cfg.duration_s,
                cfg.max_len,
                float(starts[i]),
            )
            for i in range(cfg.arrival.users)
        ]
    starts = open_loop_times(cfg.arrival, cfg.duration_s, rng)
    turns = rng.geometric(1.0 / cfg.turns_mean, size=len(starts))
    return [
        Session(
            f"s{i}",
            t,
            int(n),
            prof,
            cfg.speeds,
            np.random.default_rng([cfg.seed, 1000 + i]),
            cfg.duration_s,
            cfg.max_len,
        )
        for i, (t, n) in enumerate(zip(starts, turns))
    ]


def _jsonl(cfg: WorkloadConfig, rng, count_tokens) -> tuple[list[Submission], list[Source]]:
    if not cfg.dataset_path:
        raise ValueError("the jsonl workload needs --dataset FILE")
    items = load_jsonl(cfg.dataset_path, count_tokens)
    slo = _profile(cfg, "sharegpt").slo
    if cfg.arrival.kind == "closed":
        raise ValueError("the jsonl workload replays its lines open-loop; use --arrival poisson, gamma or trace")
    out = []
    for i, t in enumerate(open_loop_times(cfg.arrival, cfg.duration_s, rng)):
        it = items[i % len(items)]
        spec = RequestSpec(
            f"rt-{i}", "rt", it.prompt_len, it.max_tokens, slo, prompt_text=it.prompt_text, messages=it.messages
        )
        out.append(Submission(t, spec))
    return out, []
