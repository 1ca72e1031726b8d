"""The scheduling policies by name, as one static table.

A table written out here, not filled by decorators as modules are imported: what exists does
not depend on which modules someone imported first, and there is nothing to import "for its
side effects". A new policy is one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from engine.scheduling.aptserve import AptServePolicy
from engine.scheduling.bros import BROSPolicy
from engine.scheduling.ellm import ELLMPolicy
from engine.scheduling.fcfs import FCFSPolicy
from engine.scheduling.policy import SchedulingPolicy
from engine.scheduling.prefill_first import PrefillFirstFCFSPolicy
from engine.scheduling.rr import RoundRobinPolicy
from engine.scheduling.swap import SwapPolicy

POLICIES: Mapping[str, type[SchedulingPolicy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            FCFSPolicy,
            PrefillFirstFCFSPolicy,
            RoundRobinPolicy,
            BROSPolicy,
            AptServePolicy,
            ELLMPolicy,
            SwapPolicy,
        )
    }
)


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The policy class registered as `name`; a ValueError listing the names otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; available: {sorted(POLICIES)}") from None


def make_policy(name: str, **options) -> SchedulingPolicy:
    """Build a policy by name; `options` go to its constructor (e.g. `make_policy("bros",
    cost_model=CostModel.load(path), default_slo=SLO(0.4, 0.2))`)."""
    return policy_class(name)(**options)
