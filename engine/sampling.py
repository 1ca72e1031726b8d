"""Per-request sampling parameters.

`SamplingParams` is immutable so that one instance can be shared between the API layer,
the scheduler and the sampler without anyone mutating it behind the others' backs. Lists
given for `stop` / `stop_token_ids` are normalised to tuples (hashable, immutable).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    `temperature == 0` means greedy decoding (argmax); `top_k` of 0 or -1 disables top-k.
    `logprobs=True` asks for the log-probability of each chosen token under the model's raw
    distribution (log_softmax of the unscaled logits, OpenAI semantics).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise container fields first (frozen dataclass: go through object.__setattr__).
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_token_ids(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)

    @property
    def is_greedy(self) -> bool:
        """True when the choice is the argmax: temperature 0, or top_k == 1 (same result)."""
        return self.temperature == 0.0 or self.top_k == 1


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; reject it so `max_tokens=True` is not silently 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _normalise_stop(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"stop strings must be str, got {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must be non-empty")
    return items


def _normalise_token_ids(ids: int | Iterable[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    items = (ids,) if isinstance(ids, int) else tuple(ids)
    for t in items:
        _check_int("stop_token_ids entries", t)
        if t < 0:
            raise ValueError(f"stop_token_ids entries must be >= 0, got {t}")
    return items
