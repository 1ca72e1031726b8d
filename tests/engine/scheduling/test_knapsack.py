"""Apt-Serve's packing greedy against brute force (the paper's testable claims T7-T9):
concave options, never over capacity, at least half the optimum."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.scheduling.knapsack import SKIP, Candidate, Choice, objective, option_value, options, solve


@st.composite
def instances(draw, hidden: bool = True, held: bool = False):
    """Random candidates; `held`: some hold a form already and are worth a keep bonus in it
    (the priced conversions of a decode iteration)."""
    n = draw(st.integers(0, 7))
    ratio = draw(st.sampled_from([0.5, 0.75]))
    nrho = draw(st.floats(0, 0.5))  # N·ρ
    cands = []
    for _ in range(n):
        m = draw(st.integers(1, 12))
        p = draw(st.floats(0, 10))
        h = max(1, math.ceil(m * ratio)) if hidden and draw(st.booleans()) else None
        holds = draw(st.sampled_from([None, False] + ([True] if h is not None else []))) if held else None
        bonus = draw(st.floats(0, 10)) if holds is not None else 0.0
        cands.append(Candidate(p, m, h, nrho * m, holds, bonus))
    return cands, draw(st.integers(0, 30))


def brute_force(cands, capacity) -> float:
    best = 0.0
    forms = [SKIP, Choice(True, True), Choice(True, False)]
    for combo in itertools.product(forms, repeat=len(cands)):
        if any(ch.hidden and c.hidden_blocks is None for c, ch in zip(cands, combo)):
            continue
        value, blocks = objective(cands, combo)
        if blocks <= capacity:
            best = max(best, value)
    return best


@settings(max_examples=300, deadline=None)
@given(st.one_of(instances(), instances(held=True)))
def test_greedy_is_feasible_and_at_least_half_the_optimum(instance):
    """T8: ALG >= OPT/2 and the memory constraint holds, also with priced conversions (a held
    form worth a keep bonus; the optimum chooses among all three options of each request)."""
    cands, capacity = instance
    choices = solve(cands, capacity)
    value, blocks = objective(cands, choices)
    assert blocks <= capacity
    assert value >= brute_force(cands, capacity) / 2 - 1e-9


@settings(max_examples=200, deadline=None)
@given(instances(hidden=False))
def test_without_hidden_it_is_the_knapsack_2_approximation(instance):
    """T9: HIDDEN never offered: 0-1 knapsack greedy + best single item, never HIDDEN."""
    cands, capacity = instance
    choices = solve(cands, capacity)
    assert not any(ch.hidden for ch in choices)
    value, blocks = objective(cands, choices)
    assert blocks <= capacity and value >= brute_force(cands, capacity) / 2 - 1e-9


@settings(max_examples=300, deadline=None)
@given(
    p=st.floats(0.01, 100),
    m=st.integers(2, 64),
    nrho=st.floats(0, 5),
    ratio=st.sampled_from([0.5, 0.75]),
)
def test_offered_options_are_concave(p, m, nrho, ratio):
    """T7: where HIDDEN is offered, θ_hidden >= θ_upgrade and its value >= p·h/m̄ (p/2 for MHA)."""
    h = math.ceil(m * ratio)
    opts = options(Candidate(p, m, h, nrho * m), capacity=10**6)
    if len(opts) == 2:
        (hb, hv, hc), (kb, kv, kc) = opts
        assert hc.hidden and not kc.hidden
        assert hv / hb >= (kv - hv) / (kb - hb) - 1e-12
        assert hv >= p * h / m - 1e-9
    elif opts and opts[0][2].hidden is False:
        assert p - nrho * m < p * h / m + 1e-9 or p - nrho * m <= 0  # dropped only when dominated


@settings(max_examples=300, deadline=None)
@given(instances(held=True), st.integers(0, 30))
def test_options_with_a_held_form_are_concave_and_never_drop_the_best(instance, capacity):
    """Priced conversions: each request's options stay increasing in blocks and value with
    non-increasing value per block (what the 2-approximation rests on), and the best option
    that fits alone is always among them (so the best-single fallback is the true one)."""
    cands, _ = instance
    for c in cands:
        opts = options(c, capacity)
        prev_blocks, prev_value, prev_theta = 0, 0.0, math.inf
        for blocks, value, _ in opts:
            assert blocks > prev_blocks and value > prev_value
            theta = (value - prev_value) / (blocks - prev_blocks)
            assert theta <= prev_theta + 1e-12
            prev_blocks, prev_value, prev_theta = blocks, value, theta
        fitting = [option_value(c, False)] if c.kv_blocks <= capacity else []
        if c.hidden_blocks is not None and c.hidden_blocks <= capacity:
            fitting.append(option_value(c, True))
        best = max([v for v in fitting if v > 0], default=None)
        assert (best is None and not opts) or max(v for _, v, _ in opts) == best


def test_a_held_form_is_kept_unless_the_gain_beats_the_reprefill():
    """The rule (docs/aptserve.md, "Conversions priced"): a running HIDDEN request whose
    penalty exceeds its value is kept HIDDEN while the re-prefill bonus covers it; without the
    bonus (the paper) it is not worth HIDDEN at all and, KV not fitting, it is dropped."""
    held = Candidate(value=0.05, kv_blocks=19, hidden_blocks=10, hidden_penalty=0.38, holds_hidden=True, keep_bonus=0.6)
    assert [ch for _, _, ch in options(held, 24)] == [Choice(True, True)]  # KV (0.05) < staying (0.27)
    assert solve([held], 12) == [Choice(True, True)]
    paper = Candidate(value=0.05, kv_blocks=19, hidden_blocks=10, hidden_penalty=0.38)
    assert solve([paper], 12) == [SKIP]
    # the other way: a KV request converts to HIDDEN only when HIDDEN alone fits and is worth
    # more than keeping KV is (its value plus the re-prefill it avoids): here it is not
    kv = Candidate(value=5.0, kv_blocks=8, hidden_blocks=4, hidden_penalty=1.5, holds_hidden=False, keep_bonus=3.0)
    assert [ch for _, _, ch in options(kv, 100)] == [Choice(True, False)]  # 3.5/4 < 8/8: below the chord
    cheap = Candidate(value=5.0, kv_blocks=8, hidden_blocks=4, hidden_penalty=1.5, holds_hidden=False, keep_bonus=0.1)
    assert [ch for _, _, ch in options(cheap, 100)] == [Choice(True, True), Choice(True, False)]


def test_hidden_lets_more_requests_in_when_the_penalty_is_small():
    """Four MHA requests of 8 blocks, 20 blocks free: KV alone fits two, HIDDEN fits all four."""
    cands = [Candidate(5.0, 8, 4, 0.01 * 8) for _ in range(4)]
    choices = solve(cands, 20)
    assert sum(ch.scheduled for ch in choices) == 4
    assert sum(ch.hidden for ch in choices) >= 3
    heavy = [Candidate(5.0, 8, 4, 4.9) for _ in range(4)]  # penalty eats the value: KV only
    assert [ch.hidden for ch in solve(heavy, 20)] == [False] * 4


def test_fallback_takes_the_big_single_request():
    """The classic counter-example to plain density greedy: a dense small item and one big one."""
    cands = [Candidate(2.0, 1), Candidate(10.0, 10)]
    assert solve(cands, 10) == [SKIP, Choice(True, False)]


def test_greedy_goes_on_filling_past_the_critical_increment():
    """The paper's Algorithm 1 stops at the first increment that does not fit; we skip it and
    keep filling (knapsack.py): the small request sorted after a large one still gets in."""
    first = Candidate(value=10.0, kv_blocks=6)  # θ 1.67: taken
    large = Candidate(value=6.0, kv_blocks=5)  # θ 1.2: does not fit in the 4 left
    small = Candidate(value=1.0, kv_blocks=3)  # θ 0.33: fits after the skip
    choices = solve([first, large, small], capacity=10)
    assert choices == [Choice(True, False), SKIP, Choice(True, False)]
    assert objective([first, large, small], choices) == (11.0, 9)


def test_a_skipped_hidden_step_skips_its_upgrade():
    """A request's chain is taken in order: its KV upgrade (2 more blocks, which would fit)
    never without its HIDDEN step (4 blocks, which does not): that would hold 6, not 2."""
    filler = Candidate(value=9.0, kv_blocks=7)
    chain = Candidate(value=4.0, kv_blocks=6, hidden_blocks=4, hidden_penalty=0.1)
    choices = solve([filler, chain], capacity=10)
    _, used = objective([filler, chain], choices)
    assert used <= 10 and choices == [Choice(True, False), SKIP]
