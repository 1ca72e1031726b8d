"""The policy registry is a static table: every built-in policy by name, a clear error for
an unknown one, and nothing that depends on which modules were imported first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.scheduling import POLICIES, SchedulingPolicy, make_policy, policy_class


def test_table_lists_the_built_in_policies_under_their_names():
    assert sorted(POLICIES) == ["aptserve", "bros", "ellm", "fcfs", "fcfs-prefill-first", "rr", "swap"]
    for name, cls in POLICIES.items():
        assert issubclass(cls, SchedulingPolicy) and cls.name == name and policy_class(name) is cls
    with pytest.raises(TypeError):
        POLICIES["mine"] = POLICIES["fcfs"]  # read-only: a policy is added in registry.py


def test_unknown_policy_names_the_available_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown scheduling policy 'lifo'; available: \['aptserve', 'bros', 'ellm', 'fcfs', "
        r"'fcfs-prefill-first', 'rr', 'swap'\]",
    ):
        make_policy("lifo")


def test_make_policy_needs_no_prior_imports():
    """A fresh interpreter that imports only the registry builds every policy (no decorator
    side effects, no import order)."""
    code = (
        "from engine.scheduling.registry import make_policy\n"
        "from engine.cost_model import CostModel, PhaseFit\n"
        "fit = PhaseFit(1e-3, 1e-6, 4e-3)\n"
        "options = {'bros': {'cost_model': CostModel(fit, fit, 1e9)}}\n"
        "names = ('fcfs', 'rr', 'bros', 'aptserve', 'ellm', 'swap')\n"
        "print(sorted(type(make_policy(n, **options.get(n, {}))).__name__ for n in names))\n"
    )
    root = Path(__file__).resolve().parents[3]  # this checkout's packages come first on sys.path
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "['AptServePolicy', 'BROSPolicy', 'ELLMPolicy', 'FCFSPolicy', 'RoundRobinPolicy', 'SwapPolicy']"
    )
