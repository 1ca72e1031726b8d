"""What the driver needs from a target that it advances step by step (in-process engine, simulator).

Times are seconds from the run's start (`begin`). `advance(until_s)` does a bounded amount of
work — one engine step, or simulated events up to the next completion — and returns the
tokens it produced, so the driver can react to completions (closed-loop sources) promptly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    req_class: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    session_id: str | None = None


@dataclass
class TokenEvent:
    request_id: str
    time_s: float
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    worker: str | None = None


@dataclass
class LoadSample:
    """The target's state at one moment (for the latency-over-time / KV plot)."""

    time_s: float
    kv_usage: float
    running: int
    waiting: int
    extra: dict = field(default_factory=dict)


class StepTarget(ABC):
    name: str = "target"

    @abstractmethod
    def begin(self) -> None:
        """Mark time zero (after any model loading and warm-up)."""

    @abstractmethod
    def now(self) -> float: ...

    @abstractmethod
    def submit(self, request: PreparedRequest) -> None: ...

    @abstractmethod
    def advance(self, until_s: float) -> list[TokenEvent]: ...

    @abstractmethod
    def has_work(self) -> bool: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def load(self) -> LoadSample: ...

    def typing_hint(self, session_id: str) -> None:
        """A user started typing in `session_id` (the in-process targets have no use for it)."""

    def describe(self) -> dict:
        return {"target": self.name}

    def close(self) -> None:
        pass
