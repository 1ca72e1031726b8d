"""Step-time jitter: the measured machine's noise, replayed onto simulated steps.

A cost model prices a batch by its shape; a real machine also has slow stretches (another
process, frequency changes, the host). Latency *tails* (P99 TBT, the slowest requests' TPOT)
come mostly from those, so a noise-free simulation is optimistic on tails even when its step
model is right on average. `StepJitter` keeps the ratios actual/predicted of a calibration
run's steps, in run order, and multiplies each simulated step by the next ratio of a randomly
placed run of `block` consecutive ratios (a moving-block bootstrap: slow stretches stay
stretches, which i.i.d. draws would average away within a request). Deterministic per seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepJitter:
    ratios: tuple[float, ...]  # actual / predicted step time, in the order the steps ran
    block: int = 20  # consecutive steps replayed together

    def __post_init__(self) -> None:
        if not self.ratios or any(r <= 0 for r in self.ratios):
            raise ValueError("step jitter needs at least one positive ratio")
        if self.block < 1:
            raise ValueError("step jitter block must be >= 1")

    @classmethod
    def from_steps(cls, actual: Sequence[float], predicted: Sequence[float], block: int = 20) -> StepJitter:
        return cls(tuple(round(a / max(p, 1e-9), 4) for a, p in zip(actual, predicted, strict=True)), block)

    def sampler(self, seed: int) -> Callable[[], float]:
        """A draw function: successive calls walk a block, then jump to a new random block."""
        return _BlockWalk(self.ratios, min(self.block, len(self.ratios)), random.Random(seed)).draw


class _BlockWalk:
    def __init__(self, ratios: tuple[float, ...], block: int, rng: random.Random) -> None:
        self.ratios, self.block, self.rng = ratios, block, rng
        self.next, self.left = 0, 0

    def draw(self) -> float:
        if self.left == 0:
            self.next, self.left = self.rng.randrange(len(self.ratios) - self.block + 1), self.block
        self.left -= 1
        self.next += 1
        return self.ratios[self.next - 1]
