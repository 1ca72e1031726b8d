"""Arrival processes: Poisson, Gamma with a coefficient of variation, or a replayed trace.

Open-loop processes return absolute arrival times in ``[0, duration)``; closed-loop users
(a fixed number of concurrent users) are a workload source, not a time list (see
`loadgen.workloads.sources.ClosedUser`). Every process is deterministic given its
`numpy.random.Generator`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str = "poisson"  # "poisson" | "gamma" | "trace" | "closed"
    rate: float = 1.0  # requests (or sessions) per second
    cv: float = 1.0  # gamma: coefficient of variation of inter-arrival times (1 = Poisson)
    trace_path: str | None = None  # trace: file of timestamps (seconds)
    users: int = 0  # closed: concurrent users


def poisson_times(rate: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    return gamma_times(rate, 1.0, duration_s, rng)


def gamma_times(rate: float, cv: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Gamma inter-arrivals with mean 1/rate: shape = 1/cv^2, scale = 1/(rate*shape) (Apt-Serve's code)."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    if cv <= 0:
        raise ValueError(f"coefficient of variation must be > 0, got {cv}")
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    times: list[float] = []
    t = 0.0
    # How many gaps to draw at once. It sets how far the generator advances, so the lengths drawn
    # after the arrivals depend on it: a `--requests N` window (duration N/rate) must draw the
    # same chunk at every rate, so that every probe of a rate search sees the same requests with
    # its times scaled (the papers' trace of N sampled requests). `rate * (N / rate)` can land a
    # hair below N in floating point (4.75, 9.5, 19 req/s ... for N = 1000), and `int` then drew
    # one gap less: a different set of requests at those rates. The epsilon absorbs only that.
    chunk = max(16, int(rate * duration_s * 1.2 + 1e-6) + 16)
    while True:
        for gap in rng.gamma(shape, scale, size=chunk):
            t += float(gap)
            if t >= duration_s:
                return times
            times.append(t)


def load_trace(path: str | Path, duration_s: float | None = None) -> list[float]:
    """Timestamps from a file: a JSON list, JSONL objects with ``timestamp``/``arrival_time``, or
    one number per line. Shifted so the first arrival is at 0; cut at `duration_s`."""
    text = Path(path).read_text()
    values = _parse_trace(text, str(path))
    if not values:
        raise ValueError(f"trace {path} has no timestamps")
    values.sort()
    start = values[0]
    out = [v - start for v in values]
    return [t for t in out if duration_s is None or t < duration_s]


def _parse_trace(text: str, where: str) -> list[float]:
    stripped = text.strip()
    if stripped.startswith("["):
        return [float(v) for v in json.loads(stripped)]
    values = []
    for n, line in enumerate(stripped.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            values.append(_trace_value(json.loads(line) if line.startswith("{") else float(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}:{n}: not a timestamp ({exc})") from None
    return values


def _trace_value(item) -> float:
    if isinstance(item, dict):
        for key in ("timestamp", "arrival_time", "time", "t"):
            if key in item:
                return float(item[key])
        raise KeyError("no timestamp/arrival_time field")
    return float(item)


def open_loop_times(spec: ArrivalSpec, duration_s: float, rng: np.random.Generator) -> list[float]:
    if spec.kind == "poisson":
        return poisson_times(spec.rate, duration_s, rng)
    if spec.kind == "gamma":
        return gamma_times(spec.rate, spec.cv, duration_s, rng)
    if spec.kind == "trace":
        if not spec.trace_path:
            raise ValueError("trace arrivals need --trace FILE")
        return load_trace(spec.trace_path, duration_s)
    raise ValueError(f"unknown arrival process {spec.kind!r} (poisson, gamma, trace, closed)")
