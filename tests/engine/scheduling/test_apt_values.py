"""Apt-Serve's runtime quantities: pending time, SLO demotion (T12), iteration type (T11)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.sampling import SamplingParams
from engine.scheduling import SLO, Request
from engine.scheduling.apt_values import (
    DEMOTED_VALUE,
    iteration_type,
    make_candidate,
    pending_time,
    request_value,
    slo_violated,
)


def _req(arrival: float, slo: SLO = SLO(1.0, 1.0)) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=arrival, slo=slo)


def test_pending_time_runs_from_arrival_then_from_the_last_token():
    r = _req(10.0)
    assert pending_time(r, 10.5) == 0.5
    r.append_token(7, None, now=11.0)
    assert pending_time(r, 11.25) == 0.25


def test_demotion_past_the_slo():
    """T12: past TTFT (waiting) or TBT (decoding), the value drops to ~0, or x0.4 with decay."""
    r = _req(0.0)
    assert not slo_violated(r, 0.9) and request_value(r, 0.9) == 0.9
    assert slo_violated(r, 1.5)
    assert request_value(r, 1.5) == 1.5 * DEMOTED_VALUE
    assert request_value(r, 1.5, decay=0.4) == 1.5 * 0.4
    r.append_token(7, None, now=2.0)  # now the TBT target applies
    assert not slo_violated(r, 2.5) and slo_violated(r, 3.5)
    assert not slo_violated(_req(0.0, SLO()), 100.0)  # no SLO, never demoted


@given(
    waiting=st.lists(st.floats(0, 10), max_size=8),
    running=st.lists(st.floats(0, 10), max_size=8),
    fits=st.booleans(),
)
def test_iteration_type_rule(waiting, running, fits):
    """T11: prefill iff the waiting queue's pending time is larger and a waiting request fits."""
    kind = iteration_type(waiting, running, fits)
    assert (kind == "prefill") == (fits and sum(waiting) > sum(running))


def test_candidate_penalty_scales_with_outstanding_requests_and_size():
    c = make_candidate(2.0, 8, 4, outstanding=10, rho=0.001)
    assert c.hidden_penalty == 10 * 0.001 * 8 and c.hidden_blocks == 4
