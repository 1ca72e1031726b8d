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

Others' load. The 1-minute load average counts this process too: its profiler threads, and
whatever it ran just before (a benchmark's previous policy kept both cores busy for a minute, and
its load then made the next engine's profile look "loaded" on a quiet host). So each reading
takes off the process's own average CPU rate since it started (CPU seconds over its age, at most
its threads + 1): about right for a process that kept busy, generous to one that was busy long
ago and idle since (the CPU share then decides), and small exactly when other work holds the
cores (this process's threads wait rather than run). `others_load_per_cpu` is the larger of the
start and end readings so corrected, over the online CPUs.

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
    """One reading of /proc/loadavg (os.getloadavg where it is missing) and of this process's
    own share of it (module docstring)."""

    load1: float
    running: int | None  # runnable tasks now (this process's running threads included)
    cpus_online: int
    cpus_usable: int  # this process's affinity
    own: float  # this process's average CPU rate since it started, in cores

    @classmethod
    def now(cls, threads: int = 1) -> HostLoad:
        running = None
        try:
            fields = open("/proc/loadavg").read().split()
            load1, running = float(fields[0]), int(fields[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        online = os.cpu_count() or 1
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
        return cls(load1, running, online, usable, min(float(threads + 1), _own_rate()))

    @property
    def others(self) -> float:
        return max(0.0, self.load1 - self.own)

    @property
    def per_cpu(self) -> float:
        """Others' load per online CPU."""
        return self.others / self.cpus_online


def _own_rate() -> float:
    """CPU seconds this process used over the seconds it has lived (0 where unknown)."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    return time.process_time() / age if age > 1.0 else 0.0


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
    own_load_start: float  # this process's own share of the readings (module docstring)
    own_load_end: float
    running_start: int | None
    running_end: int | None
    wall_s: float
    cpu_share: float  # measuring thread's CPU seconds / wall seconds
    others_load_per_cpu: float  # max(start, end), each less this process's own, / online CPUs

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
    start_load, t0, c0 = HostLoad.now(threads), time.perf_counter(), time.thread_time()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    end_load = HostLoad.now(threads)
    return out, Conditions(
        taken_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cpu_model=_cpu_model(),
        cpus_online=start_load.cpus_online,
        cpus_usable=start_load.cpus_usable,
        threads=threads,
        load1_start=start_load.load1,
        load1_end=end_load.load1,
        own_load_start=start_load.own,
        own_load_end=end_load.own,
        running_start=start_load.running,
        running_end=end_load.running,
        wall_s=wall,
        cpu_share=cpu / wall if wall > 0 else 1.0,
        others_load_per_cpu=max(start_load.per_cpu, end_load.per_cpu),
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


def host_quiet(bounds: TrustBounds, threads: int = 1) -> tuple[bool, HostLoad]:
    """Whether a measurement started now could be trusted, by the load bound, and the reading."""
    load = HostLoad.now(threads)
    return load.per_cpu <= bounds.max_load_per_cpu, load


@functools.cache
def _cpu_model() -> str:
    try:
        from kernels.cpu_caps import probe

        return probe().model
    except Exception:  # noqa: BLE001 - a record without the model beats no profile
        return "unknown"
