"""Per-key rate limits: requests per second and tokens per minute, as token buckets.

- **Requests/s**: a bucket of `rps` tokens per second holding at most `max(1, rps)` (one second
  of burst). Every `/v1` request takes one, whatever the route: a status poll is a request too,
  as in OpenAI's RPM.
- **Tokens/min**: a balance refilled at `tpm / 60` per second up to `tpm`. A generation request is
  admitted while the balance is positive; its prompt and completion tokens are charged when its
  stream ends (finished, failed or cut off: the tokens it produced). Decision: a running stream
  is not reserved against at admission, because its length is unknown (`max_tokens` is usually
  unset or far above what is produced, and reserving it would refuse work that fits). The
  balance may go negative, and the debt is repaid before the next admission, so over any
  window longer than the key's longest request the rate holds exactly; the overshoot is bounded
  by what the key's concurrent streams produce (bound that with `requests_per_s` or the
  gateway's in-flight limit).

The state is per gateway replica, in memory (a replica restart forgets it): with N replicas a
key can reach N times its limits. Batch items run in the queue service and are bounded by the
key's batch quota instead (docs/services.md, "API keys").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.apikeys.keys import ApiKey, KeyLimits


class TokenBucket:
    """`rate` tokens per second, at most `capacity` held; starts full."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level, self.updated = capacity, now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, now: float, n: float = 1.0) -> float:
        """Take `n` tokens: 0.0 when taken, else the seconds until they would be there (nothing taken)."""
        self._refill(now)
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate

    def wait_positive(self, now: float) -> float:
        """0.0 when the level is positive, else the seconds until it will be."""
        self._refill(now)
        return 0.0 if self.level > 0 else (-self.level) / self.rate + 1e-3

    def charge(self, now: float, n: float) -> None:
        """Take `n` unconditionally (the level may go negative: a debt)."""
        self._refill(now)
        self.level -= n


@dataclass
class _KeyState:
    limits: KeyLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused and when to retry (the 429's `Retry-After`, whole seconds)."""

    kind: str  # "requests" | "tokens"
    limit: str  # e.g. "2 requests/s"
    retry_after_s: int


class KeyLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    def _state(self, key: ApiKey) -> _KeyState:
        state = self._keys.get(key.id)
        if state is None or state.limits != key.limits:  # new key, or its limits changed: start afresh
            now, lim = self._clock(), key.limits
            rps, tpm = lim.requests_per_s, lim.tokens_per_min
            state = self._keys[key.id] = _KeyState(
                lim,
                TokenBucket(rps, max(1.0, rps), now) if rps else None,
                TokenBucket(tpm / 60.0, float(tpm), now) if tpm else None,
            )
        return state

    def take_request(self, key: ApiKey) -> Refusal | None:
        """Count one request against the key's requests/s; a Refusal when over."""
        bucket = self._state(key).requests
        if bucket is None:
            return None
        wait = bucket.take(self._clock())
        if wait == 0.0:
            return None
        return Refusal("requests", f"{key.limits.requests_per_s:g} requests/s", _whole_seconds(wait))

    def admit_tokens(self, key: ApiKey) -> Refusal | None:
        """Whether a generation may start: the key's tokens/min balance is positive."""
        bucket = self._state(key).tokens
        if bucket is None:
            return None
        wait = bucket.wait_positive(self._clock())
        if wait == 0.0:
            return None
        return Refusal("tokens", f"{key.limits.tokens_per_min} tokens/min", _whole_seconds(wait))

    def charge_tokens(self, key: ApiKey, tokens: int) -> None:
        """A finished stream's prompt + completion tokens."""
        bucket = self._state(key).tokens
        if bucket is not None and tokens > 0:
            bucket.charge(self._clock(), tokens)


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))
