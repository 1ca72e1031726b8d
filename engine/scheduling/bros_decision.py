"""What one BROS step decided (`Decision`, for tests and traces) and the BE orders
(`BE_ORDERS`, `be_key`): shared by the step (`bros_step.py`), its memory side and the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling.request import Request


@dataclass
class Decision:
    """What the last step decided (tests check Algorithm 1's invariants against it)."""

    rt_order: list[Request] = field(default_factory=list)  # saveable by slack, then demoted
    num_saveable: int = 0
    rt_scheduled: list[Request] = field(default_factory=list)
    replaced: list[Request] = field(default_factory=list)  # dropped from the back for BE
    skipped: list[Request] = field(default_factory=list)  # passed over: no memory, or held by admission control
    be_scheduled: list[Request] = field(default_factory=list)
    budget_s: float = math.inf
    estimate_s: float = 0.0
    cap: int = 0
    early_exit: bool = False  # the RT cost check failed (cap resets)
    forced: bool = False  # the head RT request ran past the budget (late fallback)
    be_owed: list[Request] = field(default_factory=list)  # BE packed first for the minimum share
    be_waiting: bool = False  # some BE request was left out (the share counts only such steps)
    # why BE requests were left out (the "memory or time?" question of docs/bros.md): no KV
    # for them (even with what they may evict), or no time (budget, cap, or the scan stopped)
    be_no_memory: list[Request] = field(default_factory=list)
    be_no_time: list[Request] = field(default_factory=list)
    be_held: list[Request] = field(default_factory=list)  # new BE held back: an admitted one is on host


# The order BE requests are packed in (and, reversed, evicted in). The paper's is
# "checkpointed": fewest blocks on host first, which spends the fewest restore copies per
# step. Under a standing backlog it starves every BE request RT once took a block end from:
# a newer one always has fewer blocks on host, so the checkpointed ones wait on host, fill the
# swap space, and from then on every eviction drops KV for recompute; and a batch job is
# done only when its last request is. Measured in the fair simulator (docs/bros.md, "Why BE
# loses throughput") that is most of BROS's BE shortfall, so the default is "arrival"
# (oldest first, what a vLLM user expects of a queue), which restores them in turn.
BE_ORDERS = frozenset({"arrival", "checkpointed"})


def be_key(kv: KVCacheManager, be_order: str, r: Request) -> tuple[int, float, str]:
    """A request's place in the BE order, a total order (no ties): BE_ORDERS says why each
    order exists. Reversed, it is the order BE requests are evicted in."""
    checkpointed = kv.num_host_blocks(r) if be_order == "checkpointed" else 0
    return checkpointed, r.arrival_time, r.request_id
