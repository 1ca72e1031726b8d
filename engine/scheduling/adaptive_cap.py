"""BROS's TCP-like batch-size cap: start at a base, double after every step whose RT time
check held, fall back to the base on the first step where it failed."""

from __future__ import annotations


class AdaptiveCap:
    def __init__(self, base: int, limit: int) -> None:
        if base < 1 or limit < 1:
            raise ValueError(f"batch caps must be >= 1 (base {base}, limit {limit})")
        self.limit = limit  # the engine's max_num_seqs: doubling never passes it
        self.base = min(base, limit)
        self.value = self.base

    def update(self, rt_check_failed: bool) -> None:
        self.value = self.base if rt_check_failed else min(self.value * 2, self.limit)
