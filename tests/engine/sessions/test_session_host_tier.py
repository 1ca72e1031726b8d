"""Host-tier eviction order (idle first, later layers first, then the largest) and policies."""

from __future__ import annotations

import pytest
import torch

from engine.sessions.eviction import make_eviction_policy
from engine.sessions.host_tier import HostTier

LAYER_BYTES = 4 * 4  # one float32 [2, 1, 2, 1] tensor per token pair below


def _layers(num_layers: int, tokens: int) -> list[torch.Tensor]:
    return [torch.zeros(2, 1, tokens, 1) for _ in range(num_layers)]


def _tier(budget: int, policy="idle-layer-size", **kw) -> HostTier:
    tier = HostTier(budget, make_eviction_policy(policy), **kw)
    tier.put("big", _layers(3, 4), last_activity=3.0)  # 3 layers x 32 bytes
    tier.put("small", _layers(3, 2), last_activity=1.0)  # 3 layers x 16 bytes
    tier.put("busy", _layers(3, 4), last_activity=0.0)  # oldest, but has a running turn
    return tier


def test_idle_first_then_later_layers_then_largest():
    tier = _tier(budget=0)
    order = tier.evict_to_budget(lambda sid: sid == "busy")
    assert order == [
        ("big", 2),
        ("small", 2),
        ("big", 1),
        ("small", 1),
        ("big", 0),
        ("small", 0),
        ("busy", 2),
        ("busy", 1),
        ("busy", 0),
    ]
    assert tier.nbytes == 0 and "big" not in tier


def test_evicts_only_down_to_budget():
    tier = _tier(budget=32 * 3 + 16 * 3 + 32 * 3 - 40)  # 40 bytes too many
    assert tier.evict_to_budget(lambda sid: sid == "busy") == [("big", 2), ("small", 2)]
    assert tier.layer("big", 2) is None and tier.layer("big", 1) is not None
    assert tier.layers_held("big") == 2 and tier.nbytes == 32 * 2 + 16 * 2 + 32 * 3


def test_lru_policy_evicts_whole_sessions_oldest_first():
    tier = _tier(budget=0, policy="lru")
    order = tier.evict_to_budget(lambda sid: sid == "busy")
    assert order[:6] == [("small", 2), ("small", 1), ("small", 0), ("big", 2), ("big", 1), ("big", 0)]


def test_without_disk_a_session_goes_whole():
    tier = _tier(budget=32 * 3 + 16 * 3 + 32 * 3 - 1, whole_sessions=True)
    assert tier.evict_to_budget(lambda sid: sid == "busy") == [("big", 0), ("big", 1), ("big", 2)]
    assert "big" not in tier and tier.layers_held("small") == 3


def test_put_replaces_and_budget_validation():
    tier = _tier(budget=1 << 20)
    tier.put("big", _layers(3, 1), last_activity=4.0)
    assert tier.nbytes == 3 * 8 + 3 * 16 + 3 * 32
    with pytest.raises(ValueError, match=">= 0"):
        HostTier(-1, make_eviction_policy("lru"))
    with pytest.raises(ValueError, match="unknown session eviction policy"):
        make_eviction_policy("random")
