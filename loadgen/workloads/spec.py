"""What a load generator submits: one request's shape, class and SLO, independent of target.

A spec carries lengths, not token ids or text: each target materialises the prompt in its own
form (token ids in-process and in the simulator, text over HTTP), so one workload drives all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLOSpec:
    ttft_s: float | None = None  # deadline for the first token, from arrival
    tpot_s: float | None = None  # deadline for every later inter-token gap (and for the P99 TBT)

    def scaled(self, factor: float) -> SLOSpec:
        return SLOSpec(_mul(self.ttft_s, factor), _mul(self.tpot_s, factor))


def _mul(v: float | None, f: float) -> float | None:
    return None if v is None else v * f


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    req_class: str  # "rt" (interactive) or "be" (best effort)
    prompt_len: int  # new prompt tokens of this request (a session turn adds them to its history)
    max_tokens: int  # output tokens (EOS is ignored, as in the papers' setups)
    slo: SLOSpec = SLOSpec()
    session_id: str | None = None
    turn: int = 0
    prompt_text: str | None = None  # user-supplied datasets: the real text
    messages: tuple[dict, ...] | None = None  # user-supplied chat datasets

    def __post_init__(self) -> None:
        if self.req_class not in ("rt", "be"):
            raise ValueError(f"request class must be 'rt' or 'be', got {self.req_class!r}")
        if self.prompt_len < 1 or self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt_len and max_tokens must be >= 1")


@dataclass(frozen=True)
class Submission:
    """Submit `spec` at `at_s` (seconds from the run's start); a typing hint goes out at `typing_at_s`."""

    at_s: float
    spec: RequestSpec
    typing_at_s: float | None = None
