"""Token-length distributions fitted to published means and standard deviations.

The papers publish only the mean and standard deviation of prompt and output lengths. We fit
a log-normal by moments (lengths are positive and right-skewed, and ShareGPT/LMSYS have
std > mean, which a normal cannot produce without mass below zero), then round and clip to
``[min_len, max_len]`` (the model's context). Clipping moves the moments slightly; the
realised mean/std of a workload are reported with its results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    kind: str  # "lognormal" | "uniform" | "constant"
    a: float  # lognormal: mu; uniform: low; constant: value
    b: float = 0.0  # lognormal: sigma; uniform: high (inclusive)
    min_len: int = 1
    max_len: int = 1 << 30

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            raw = rng.lognormal(self.a, self.b, size=n)
        elif self.kind == "uniform":
            raw = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "constant":
            raw = np.full(n, self.a)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)

    def scaled(self, factor: float, max_len: int | None = None) -> LengthDist:
        """The same shape with every length multiplied by `factor` (CPU-sized workloads)."""
        if factor <= 0:
            raise ValueError(f"length scale must be > 0, got {factor}")
        cap = self.max_len if max_len is None else max_len
        if self.kind == "lognormal":  # scaling a log-normal shifts mu; the clip bounds stay absolute
            return LengthDist("lognormal", self.a + math.log(factor), self.b, self.min_len, min(self.max_len, cap))
        lo = max(1, round(self.min_len * factor))
        hi = max(lo, min(round(self.max_len * factor), cap))
        return LengthDist(self.kind, max(1.0, self.a * factor), max(1.0, self.b * factor), lo, hi)

    def clipped(self, max_len: int) -> LengthDist:
        return LengthDist(self.kind, self.a, self.b, self.min_len, min(self.max_len, max_len))

    def mean(self) -> float:
        """The unclipped mean (what the distribution was fitted to)."""
        if self.kind == "lognormal":
            return math.exp(self.a + self.b**2 / 2)
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a


def lognormal_from_moments(mean: float, std: float, min_len: int = 1, max_len: int = 1 << 30) -> LengthDist:
    """Log-normal with the given mean and standard deviation: sigma^2 = ln(1 + (std/mean)^2)."""
    if mean <= 0 or std < 0:
        raise ValueError(f"need mean > 0 and std >= 0, got mean={mean}, std={std}")
    sigma2 = math.log1p((std / mean) ** 2)
    return LengthDist("lognormal", math.log(mean) - sigma2 / 2, math.sqrt(sigma2), min_len, max_len)


def uniform(low: int, high: int) -> LengthDist:
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {(low, high)}")
    return LengthDist("uniform", low, high, low, high)


def constant(n: int) -> LengthDist:
    return LengthDist("constant", n, 0, n, n)
