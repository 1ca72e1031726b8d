"""When the hidden form pays (`loadgen/sim/hidden_breakeven.py`): the closed form against the
priced ratio, its independence of the lengths, agreement with the simulator's step price, and
the verdicts docs/aptserve.md draws from the shipped A100 profile and the quiet CPU profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cost_model import CostModel, PhaseFit
from engine.kv.hidden import CacheForm
from engine.sampling import SamplingParams
from engine.scheduling import ScheduledBatch
from engine.scheduling.request import Request
from loadgen.factory import load_cost_model
from loadgen.sim.hidden_breakeven import analyse, closed_form_pool, full_pool_decode, main
from loadgen.sim.step_time import step_seconds

ROOT = Path(__file__).resolve().parents[2]
CPU_QUIET = ROOT / "docs/results/aptserve/cpu9/engine-default-quiet.profile.json"


def _model(beta: float, alpha0: float, alpha1: float, c: float, overhead: float = 0.0) -> CostModel:
    phase = PhaseFit(alpha0, alpha1, beta)
    return CostModel(phase, phase, 1e10, {"hidden_step_overhead_s": overhead}, hidden_s_per_token=c)


positive = st.floats(1e-6, 1e-1)


@settings(max_examples=200, deadline=None)
@given(
    beta=positive,
    alpha0=st.floats(0, 1e-3),
    alpha1=st.floats(0, 1e-5),
    c=st.floats(1e-7, 1e-3),
    overhead=st.floats(0, 2e-2),
    pool=st.floats(16, 1e6),
    context=st.floats(8, 4096),
    r=st.floats(0.1, 0.9),
)
def test_hidden_wins_exactly_below_the_closed_form_pool(beta, alpha0, alpha1, c, overhead, pool, context, r):
    cost = _model(beta, alpha0, alpha1, c, overhead)
    star = closed_form_pool(cost, r)
    if abs(pool - star) <= 1e-6 * max(pool, star):
        return  # at the boundary the two sides tie within rounding
    assert (full_pool_decode(cost, pool, context, r).ratio > 1) == (pool < star)


def test_the_verdict_does_not_depend_on_the_lengths():
    """The ratio's size does (the rows' own terms), its side of 1 does not."""
    cost = _model(0.02, 3e-5, 6e-7, 3e-5, overhead=2e-3)
    star = closed_form_pool(cost)
    assert star == pytest.approx((0.02 - 2e-3) / (2 * 3e-5))  # (β - o) / 2c
    for context in (16, 64, 340, 2000, 16000):
        assert full_pool_decode(cost, 0.95 * star, context).ratio > 1
        assert full_pool_decode(cost, 1.05 * star, context).ratio < 1


def test_without_a_knee_the_priced_pool_is_the_closed_form():
    cost = _model(0.02, 3e-5, 6e-7, 3e-5, overhead=2e-3)
    row = analyse("knee-less", cost, 4096, 340)
    assert row["breakeven_pool_tokens_priced"] == pytest.approx(closed_form_pool(cost), rel=2e-3)


def test_gqa_never_pays():
    with pytest.raises(ValueError, match="saves no memory"):
        full_pool_decode(_model(0.02, 0, 0, 1e-5), 4096, 340, r=1.5)


@pytest.mark.parametrize("profile", ["opt-13b-a100-40gb", str(CPU_QUIET)])
def test_the_fluid_step_is_the_simulators_step_price(profile):
    """Whole rows: the module's HIDDEN step is what `step_seconds` charges a decode batch of
    the same HIDDEN requests (the roofline's knee; the CPU profile's fixed extra)."""
    cost = load_cost_model(profile)
    context, rows = 300, 6
    batch = ScheduledBatch()
    for i in range(rows):
        req = Request(f"r{i}", list(range(context)), SamplingParams(max_tokens=8))
        req.num_computed_tokens = context
        req.cache_form = CacheForm.HIDDEN
        batch.add(req, 1)
    point = full_pool_decode(cost, pool_tokens=rows * context * 0.5, context=context)
    assert point.hidden_rows == pytest.approx(rows)
    assert step_seconds(cost, batch, 0) == pytest.approx(point.hidden_step_s, rel=1e-9)


def test_the_paper_setup_and_the_quiet_cpu_verdicts():
    a100 = analyse("a100", load_cost_model("opt-13b-a100-40gb"), 13192, 340)
    assert 300 < a100["breakeven_pool_tokens_closed_form"] < 500  # a few hundred tokens
    assert 0 < a100["breakeven_pool_tokens_priced"] < 13192 / 10
    assert a100["setup"]["ratio"] < 0.2  # at the paper's pool HIDDEN decodes >5x slower
    assert a100["breakeven_rho_at_setup_pool_s_per_block"] < a100["rho_s_per_block"] / 10
    cpu = analyse("cpu", load_cost_model(str(CPU_QUIET)), 768, 85)
    # below two blocks: HIDDEN is never offered to a one-block request, so no pool at all
    assert cpu["breakeven_pool_tokens_closed_form"] < 32
    assert cpu["breakeven_pool_tokens_priced"] == 0
    assert cpu["setup"]["ratio"] < 0.5


def test_the_command_writes_a_stamped_document(tmp_path):
    out = tmp_path / "breakeven.json"
    assert main(["--cost-model", "opt-13b-a100-40gb", "--pool-tokens", "400", "--out", str(out)]) == 0
    import json

    doc = json.loads(out.read_text())
    assert doc["provenance"]["git"]["commit"]
    assert doc["cases"][0]["setup_pool_tokens"] == 400
