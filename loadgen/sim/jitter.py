"""Step-time jitter: the measured machine's noise, replayed onto simulated steps.

A cost model prices a batch by its shape; a real machine also has slow stretches (another
process, frequency changes, the host). Latency *tails* (P99 TBT, the slowest requests' TPOT)
come mostly from those, so a noise-free simulation is optimistic on tails even when its step
model is right on average. `StepJitter` keeps the ratios actual/predicted of a calibration
run's steps, in run order, and multiplies each simulated step by the next ratio of a randomly
placed run of `block` consecutive ratios (a moving-block bootstrap: slow stretches stay
stretches, which i.i.d. draws would average away within a request). Deterministic per seed.

Sources of ratios: a calibration run's steps (`from_steps`, what `tandem sim validate` does),
a saved file (`load`, format `tandem-step-jitter/1`), or `lognormal(cv)` for a machine we
cannot measure (a GPU profile): i.i.d. mean-1 draws with that coefficient of variation.
`parse` reads the command line's `--step-noise` (docs/simulator.md, "Fairness").
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

FORMAT = "tandem-step-jitter/1"


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

    @classmethod
    def lognormal(cls, cv: float, n: int = 4096, seed: int = 0, block: int = 20) -> StepJitter:
        """`n` mean-1 ratios with coefficient of variation `cv` (a log-normal, so never <= 0)."""
        if cv < 0:
            raise ValueError(f"step noise cv must be >= 0, got {cv}")
        sigma = math.sqrt(math.log1p(cv * cv))
        rng = random.Random(seed)
        return cls(tuple(round(rng.lognormvariate(-sigma * sigma / 2, sigma), 4) for _ in range(n)), block)

    @classmethod
    def parse(cls, text: str | None, seed: int = 0) -> StepJitter | None:
        """`none`/empty: noise-free; `lognormal:CV`; or a path to a saved jitter file."""
        if not text or text == "none":
            return None
        if text.startswith("lognormal:"):
            return cls.lognormal(float(text.split(":", 1)[1]), seed=seed)
        return cls.load(text)

    def save(self, path: str | Path) -> None:
        doc = {"format": FORMAT, "block": self.block, "ratios": list(self.ratios)}
        Path(path).write_text(json.dumps(doc) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepJitter:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file")
        return cls(tuple(float(r) for r in doc["ratios"]), int(doc.get("block", 20)))

    def describe(self) -> dict:
        mean = sum(self.ratios) / len(self.ratios)
        var = sum((r - mean) ** 2 for r in self.ratios) / len(self.ratios)
        return {"ratios": len(self.ratios), "block": self.block, "mean": mean, "cv": math.sqrt(var) / mean}

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
