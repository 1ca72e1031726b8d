"""Pull-vs-recompute estimates for a turn that lands where its KV is not.

Pull: `bytes / bandwidth + latency`, the bandwidth an EWMA of measured pulls (200 MB/s until
the first one). Recompute: the engine's profiled cost model when it has one (prefill in
chunks of the step token budget), else `tokens / prefill rate`, the rate an EWMA of measured
prefill steps. All methods are thread-safe (plain floats behind a lock): the worker service
asks from its own threads.
"""

from __future__ import annotations

import threading

DEFAULT_PULL_BYTES_PER_S = 200e6
PULL_LATENCY_S = 0.020
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0  # until the first measured prefill; CPU-engine order of magnitude
_ALPHA = 0.3  # EWMA weight of the newest sample
_MIN_PREFILL_SAMPLE = 16  # shorter prefill rows are dominated by per-step overhead


class TransferCosts:
    def __init__(self, bytes_per_token: int, cost_model=None, max_batched_tokens: int = 1024) -> None:
        self.bytes_per_token = bytes_per_token
        self.cost_model = cost_model
        self.max_batched_tokens = max_batched_tokens
        self.pull_bytes_per_s = DEFAULT_PULL_BYTES_PER_S
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S
        self._lock = threading.Lock()

    def estimate_pull_s(self, nbytes: int) -> float:
        return nbytes / self.pull_bytes_per_s + PULL_LATENCY_S

    def estimate_recompute_s(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        if self.cost_model is not None:
            return self._model_prefill_s(num_tokens)
        return num_tokens / self.prefill_tokens_per_s

    def should_pull(self, num_tokens: int) -> bool:
        return self.estimate_pull_s(num_tokens * self.bytes_per_token) < self.estimate_recompute_s(num_tokens)

    def record_pull(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.pull_bytes_per_s = _ewma(self.pull_bytes_per_s, nbytes / seconds)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled `num_tokens` tokens in `seconds` (engine thread, per prefill step)."""
        if num_tokens < _MIN_PREFILL_SAMPLE or seconds <= 0:
            return
        with self._lock:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, num_tokens / seconds)

    def _model_prefill_s(self, num_tokens: int) -> float:
        total, done = 0.0, 0
        while done < num_tokens:
            n = min(self.max_batched_tokens, num_tokens - done)
            done += n
            total += self.cost_model.estimate([(n, done)], [])
        return total


def _ewma(old: float, sample: float) -> float:
    return (1 - _ALPHA) * old + _ALPHA * sample
