"""Whether a cost profile can be trusted: the host's load while it was measured, and its fit.

Why (session 9): a profile cached while the host ran at load ~50 on 2 cores had a decode step
of 1.01 s instead of 0.014 s and a prefill MAPE of 51%; every later run on the quiet host reused
it silently and BROS planned RT out of its SLOs (TTFT attainment 18% instead of 80%). The cache
keyed on model, dtype and grid and accepted any fit. So every profile now records how it was
taken (`Conditions`, in `meta["conditions"]`) and is judged against `TrustBounds` each time it
is read, not only when it is written (a stricter bound applies to old files too).

What is recorded around a measurement:
- the 1-minute load average and the runnable-task count of /proc/loadavg at start and end, the
  online and usable CPUs, the wall seconds, the timestamp and the CPU model;
- the measuring thread's CPU seconds over its wall seconds (`cpu_share`). On a CPU device the
  thread that times the passes is busy the whole time (Python, or its share of the ops), so on a
  quiet host this is ~1; on an oversubscribed one it is the share of a core it got (~0.05 at
  load 50 on 2 cores). It is the most direct reading of contention *during* the measurement,
  where the load average lags by a minute. Not judged on other devices (the thread waits on
  the GPU there).

Others' load. The load average at the end includes the profiler's own threads: over a
measurement of T seconds they add up to `threads·(1 − e^(−T/60))` to the 1-minute average (its
exponential decay); that much is taken off before the bound is applied (generous to the profile
where its threads slept, which only lets the other checks decide). The start reading is taken as
it is (it includes the engine's own model loading, a fraction of one core).

Bounds (`EngineConfig.profile_*`; unset there, `TANDEM_PROFILE_*` in the environment; then the
defaults below), chosen from the two profiles of the default model we know: quiet (load < 1)
fits with prefill/decode MAPE 1.7%/1.6% in 10.6 s; the busy one above had 51% and took 870 s.
- others' load per online CPU ≤ 1.0: above it the profiler's threads wait for a core at least
  half the time;
- measuring thread's CPU share ≥ 0.5 (CPU devices);
- prefill and decode MAPE ≤ 0.25 (15x the quiet fits' error, half the busy one's).
The same load bound says whether the host is quiet *now* (`host_load`), which decides whether an
untrusted cached profile is measured again or used with a warning (engine/profile_cache.py).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_MAX_LOAD_PER_CPU = 1.0
DEFAULT_MIN_CPU_SHARE = 0.5
DEFAULT_MAX_FIT_ERROR = 0.25
DEFAULT_SPOT_CHECK_FACTOR = 3.0
ENV_PREFIX = "TANDEM_"  # + the EngineConfig field's name in upper case (the worker's settings do the same)


@dataclass(frozen=True)
class TrustBounds:
    """What a profile must meet to be trusted (module docstring: why these defaults)."""

    max_load_per_cpu: float = DEFAULT_MAX_LOAD_PER_CPU
    min_cpu_share: float = DEFAULT_MIN_CPU_SHARE
    max_fit_error: float = DEFAULT_MAX_FIT_ERROR
    # a cached profile whose decode prediction misses a spot timing by this factor, either way,
    # is stale (engine/profile_cache.py); 0 turns the spot check off
    spot_check_factor: float = DEFAULT_SPOT_CHECK_FACTOR

    @classmethod
    def of(cls, config: Any) -> TrustBounds:
        """From an EngineConfig's `profile_*` fields; a field left None comes from the
        environment (`TANDEM_PROFILE_MAX_LOAD_PER_CPU` ...), then the default."""
        values = {}
        for name, default in asdict(cls()).items():
            field = f"profile_{name}"
            given = getattr(config, field, None)
            if given is None:
                env = os.environ.get(ENV_PREFIX + field.upper())
                given = float(env) if env not in (None, "") else default
            values[name] = float(given)
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class HostLoad:
    """One reading of /proc/loadavg (os.getloadavg where it is missing)."""

    load1: float
    running: int | None  # runnable tasks now (this process's running threads included)
    cpus_online: int
    cpus_usable: int  # this process's affinity

    @classmethod
    def now(cls) -> HostLoad:
        running = None
        try:
            fields = open("/proc/loadavg").read().split()
            load1, running = float(fields[0]), int(fields[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        online = os.cpu_count() or 1
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
        return cls(load1, running, online, usable)

    @property
    def per_cpu(self) -> float:
        return self.load1 / self.cpus_online


@dataclass(frozen=True)
class Conditions:
    """How one measurement was taken (module docstring). Stored in the profile's meta."""

    taken_at: str  # ISO 8601 UTC, seconds
    cpu_model: str
    cpus_online: int
    cpus_usable: int
    threads: int  # the measuring process's intra-op threads
    load1_start: float
    load1_end: float
    running_start: int | None
    running_end: int | None
    wall_s: float
    cpu_share: float  # measuring thread's CPU seconds / wall seconds
    others_load_per_cpu: float  # max(start, end less our own threads) / online CPUs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Conditions | None:
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None


def measured(fn: Callable[[], T], threads: int) -> tuple[T, Conditions]:
    """`fn()` and the conditions it ran under (module docstring)."""
    start_load, t0, c0 = HostLoad.now(), time.perf_counter(), time.thread_time()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    end_load = HostLoad.now()
    own = threads * (1.0 - math.exp(-wall / 60.0))
    others = max(start_load.load1, end_load.load1 - own, 0.0) / start_load.cpus_online
    return out, Conditions(
        taken_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cpu_model=_cpu_model(),
        cpus_online=start_load.cpus_online,
        cpus_usable=start_load.cpus_usable,
        threads=threads,
        load1_start=start_load.load1,
        load1_end=end_load.load1,
        running_start=start_load.running,
        running_end=end_load.running,
        wall_s=wall,
        cpu_share=cpu / wall if wall > 0 else 1.0,
        others_load_per_cpu=others,
    )


def doubts(meta: dict, bounds: TrustBounds, device: str = "cpu") -> list[str]:
    """Why a profile with this meta is not to be trusted; empty when it is. A profile without
    recorded conditions (written before they were) is never trusted: its load is unknown."""
    out: list[str] = []
    for key, what in (("conditions", "the profile"), ("additions_conditions", "the terms added to it")):
        if key not in meta:
            if key == "conditions":
                out.append("no record of the host's load while it was measured (an older profile)")
            continue
        cond = Conditions.from_dict(meta[key] or {})
        if cond is None:
            out.append(f"an unreadable record of how {what} was measured")
            continue
        if cond.others_load_per_cpu > bounds.max_load_per_cpu:
            out.append(
                f"{what} was measured at load {cond.others_load_per_cpu:.2f} per CPU from other work "
                f"(bound {bounds.max_load_per_cpu:g}; load average {cond.load1_start:.1f} -> {cond.load1_end:.1f} "
                f"on {cond.cpus_online} CPUs)"
            )
        if device == "cpu" and cond.cpu_share < bounds.min_cpu_share:
            out.append(
                f"{what} was measured by a thread that got {cond.cpu_share:.0%} of a core "
                f"(bound {bounds.min_cpu_share:.0%})"
            )
    for phase in ("prefill", "decode"):
        err = meta.get(f"{phase}_mape")
        if err is not None and err > bounds.max_fit_error:
            out.append(
                f"its {phase} fit misses its own points by {err:.0%} on average (bound {bounds.max_fit_error:.0%})"
            )
    return out


def host_quiet(bounds: TrustBounds) -> tuple[bool, HostLoad]:
    """Whether a measurement started now could be trusted, by the load bound, and the reading."""
    load = HostLoad.now()
    return load.per_cpu <= bounds.max_load_per_cpu, load


@functools.cache
def _cpu_model() -> str:
    try:
        from kernels.cpu_caps import probe

        return probe().model
    except Exception:  # noqa: BLE001 - a record without the model beats no profile
        return "unknown"
