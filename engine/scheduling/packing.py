"""A batch being packed, with running cost-model sums so each "what if I add this" is O(1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cost_model import CostModel
from engine.scheduling.request import Request


@dataclass
class Packing:
    cost_model: CostModel
    token_budget: int
    items: dict[Request, tuple[int, int]] = field(default_factory=dict)  # request -> (new tokens, context)
    p_ln: int = 0  # prefill rows: Σ n_i
    p_work: int = 0  # Σ n_i·a_i
    d_ln: int = 0  # decode rows
    d_work: int = 0

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.p_ln - self.d_ln

    def __len__(self) -> int:
        return len(self.items)

    def cost_with(self, n: int, context: int, swap_bytes: int) -> float:
        """Estimated step time if a row of `n` new tokens (context `context` after the step) joins."""
        if n == 1:
            return self.cost_model.estimate_sums(
                self.p_ln, self.p_work, self.d_ln + 1, self.d_work + context, swap_bytes
            )
        return self.cost_model.estimate_sums(
            self.p_ln + n, self.p_work + n * context, self.d_ln, self.d_work, swap_bytes
        )

    def cost(self, swap_bytes: int) -> float:
        return self.cost_model.estimate_sums(self.p_ln, self.p_work, self.d_ln, self.d_work, swap_bytes)

    def add(self, request: Request, n: int, context: int) -> None:
        self.items[request] = (n, context)
        self._count(n, context, +1)

    def remove(self, request: Request) -> None:
        self._count(*self.items.pop(request), -1)

    def _count(self, n: int, context: int, sign: int) -> None:
        if n == 1:
            self.d_ln += sign
            self.d_work += sign * context
        else:
            self.p_ln += sign * n
            self.p_work += sign * n * context
