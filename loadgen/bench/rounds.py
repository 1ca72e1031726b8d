"""Alternating rounds on a busy host: the one runner behind `tandem bench policies --rounds N`
and `tandem bench ellm` (`loadgen/bench/policies.py`, `loadgen/bench/ellm_ab.py`).

On a shared machine a policy's absolute figures move several-fold with the load over minutes,
and the policy run last in a process did worst (docs/ellm.md). So the policies run N times,
each once per round on the same arrivals, the order changing every round so no policy always
gets the earlier or the later minutes, and every run records the load average before and after
it and its wall time. What can be read is each run's ratio to the baseline *of the same round*;
the commands compute those from their own metrics.

Two orders, one per command, kept as they were when the runners were two copies:
- `rotate` (`bench ellm`): round i starts at policy i mod n (fcfs,swap,ellm; swap,ellm,fcfs;
  ellm,fcfs,swap), so with n policies each holds every slot once per n rounds;
- `reverse` (`bench policies`): every other round reversed (fcfs,bros; bros,fcfs), the same as
  `rotate` for two policies, and with more it keeps the baseline at the ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ORDERS = ("rotate", "reverse")


@dataclass(frozen=True)
class RoundRun:
    """One policy's run in one round: what the command's `run` returned, and its conditions."""

    round: int  # 0-based
    policy: str
    result: Any  # the command's own record of the run
    load_before: tuple[float, float, float]  # os.getloadavg() just before the run
    load_after: tuple[float, float, float]  # ... and just after
    wall_s: float


def round_order(policies: list[str], i: int, order: str) -> list[str]:
    """The policies' order in round `i` (0-based) under `order` (module docstring)."""
    if order == "rotate":
        k = i % len(policies)
        return policies[k:] + policies[:k]
    if order == "reverse":
        return list(policies) if i % 2 == 0 else policies[::-1]
    raise ValueError(f"round order must be one of {', '.join(ORDERS)}, got {order!r}")


def run_rounds(
    policies: list[str],
    rounds: int,
    run: Callable[[str], Any],
    order: str,
    on_run: Callable[[RoundRun], None] | None = None,
) -> list[list[RoundRun]]:
    """Run `run(policy)` for every policy in each of `rounds` rounds, in `round_order`; per
    round its runs in the order they ran. `on_run` sees each run as it ends (progress)."""
    out: list[list[RoundRun]] = []
    for i in range(rounds):
        out.append([])
        for policy in round_order(policies, i, order):
            before, start = os.getloadavg(), time.monotonic()
            result = run(policy)
            done = RoundRun(i, policy, result, before, os.getloadavg(), time.monotonic() - start)
            out[-1].append(done)
            if on_run is not None:
                on_run(done)
    return out
