"""The `ellm` policy: its (b, r) search trades rebuilt tokens for batch size exactly when
memory binds and the SLO allows, and the engine under it gives the same greedy tokens as FCFS."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cost_model import CostModel, PhaseFit, PrefixStepFit
from engine.scheduling.ellm import RATIO_GRID, Choice, DecisionStats, choose
from engine.scheduling.ellm_admission import PrefixFutures, peak_need, peak_points
from engine.scheduling.prefix_pricing import REBUILD_ONLY, PrefixSources, host_step_seconds

BS = 16
# A step dominated by its constant (weights read once per step), as on this engine: more rows are cheap.
COST = CostModel(PhaseFit(2e-5, 1e-9, 0.01), PhaseFit(2e-4, 1e-8, 0.02), 1e9, {"model": "test"})


def test_all_fit_means_no_rebuilding():
    choice = choose([100] * 8, capacity_tokens=8 * 112, block_size=BS, cost=COST, tpot_s=1.0, max_batch=128)
    assert (choice.batch, choice.ratio) == (8, 0.0)


def test_binding_memory_trades_rebuilding_for_batch():
    """Half the candidates fit at r = 0; rebuilding half of each context fits them all, and
    the step constant makes the larger batch worth the rebuild."""
    contexts = [200] * 8
    capacity = 4 * 208
    choice = choose(contexts, capacity, BS, COST, tpot_s=1.0, max_batch=128)
    assert choice.batch == 8 and choice.ratio > 0
    at_zero = choose(contexts, capacity, BS, COST, tpot_s=COST.estimate_sums(0, 0, 4, 800) * 1.0001, max_batch=128)
    assert (at_zero.batch, at_zero.ratio) == (4, 0.0)  # a TPOT target no rebuild meets: plain FCFS


def test_max_batch_bounds_the_choice():
    choice = choose([200] * 8, 4 * 208, BS, COST, tpot_s=1.0, max_batch=6)
    assert choice.batch <= 6


def test_choice_prices_the_rebuild_and_stats_add_up():
    """A rebuilding choice says how much of its step the rebuild is; the running totals
    average the choices (an infinite fallback step is counted but not priced)."""
    rebuild = choose([200] * 8, 4 * 208, BS, COST, tpot_s=1.0, max_batch=128)
    plain = choose([100] * 8, 8 * 112, BS, COST, tpot_s=1.0, max_batch=128)
    assert rebuild.ratio > 0 and 0 < rebuild.rebuild_s < rebuild.step_s
    assert plain.rebuild_s == 0
    stats = DecisionStats()
    assert stats.as_dict()["p99_decision_cpu_s"] == 0.0  # nothing decided yet
    for c in (rebuild, plain, Choice(1, 0.0, math.inf, decision_s=0.002, decision_cpu_s=0.0015)):
        stats.add(c)
    out = stats.as_dict()
    assert out["steps"] == 3 and out["rebuilding_step_share"] == 1 / 3
    assert out["max_ratio"] == rebuild.ratio and out["max_decision_s"] == 0.002
    assert out["max_decision_cpu_s"] == 0.0015 and out["mean_decision_cpu_s"] == 0.0005
    assert out["p50_decision_s"] == 0.0 and 0.0014 < out["p99_decision_cpu_s"] < 0.0015
    assert out["rebuild_share_of_step_time"] == rebuild.rebuild_s / (rebuild.step_s + plain.step_s)


def scan_choose(contexts, capacity_tokens, block_size, cost, tpot_s, max_batch, sources=None) -> Choice:
    """The optimiser written as the plain scan it replaces: one pass over the candidates per
    ratio, each ratio priced with every allowed source. `choose` (vectorised) must pick
    exactly what this picks."""
    bs = block_size
    best = fallback = None
    for r in RATIO_GRID:
        used = b = d_work = p_ln = p_work = rows = 0
        for s in contexts[:max_batch]:
            u = int(r * (s - 1)) // bs * bs
            need = -(-(s - u) // bs) * bs
            if used + need > capacity_tokens:
                break
            used, b, d_work, p_ln, p_work = used + need, b + 1, d_work + s, p_ln + u, p_work + u * u
            rows += u > 0
        if b == 0:
            continue
        step = cost.estimate_sums(p_ln, p_work, b, d_work) + (sources.off_graph_s(rows) if sources else 0.0)
        if r == 0:
            fallback = Choice(b, r, step)
        if sources is not None and sources.host and p_ln and p_ln <= sources.host_capacity_tokens:
            exec_s = cost.estimate_sums(0, 0, b, d_work)
            host, _ = host_step_seconds(exec_s, step - exec_s, p_ln, sources, rows)
            step = host if host < step or not sources.rebuild else step
        if step <= tpot_s and (best is None or b / step > best.batch / best.step_s):
            best = Choice(b, r, step)
        if b == min(len(contexts), max_batch):
            break
    return best or fallback or Choice(1, 0.0, math.inf)


@settings(max_examples=300, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 3000), max_size=80),
    capacity_blocks=st.integers(0, 400),
    block_size=st.sampled_from([1, 16, 32]),
    tpot_s=st.floats(0.001, 2.0),
    max_batch=st.integers(1, 100),
)
def test_vectorised_choice_equals_the_scan(contexts, capacity_blocks, block_size, tpot_s, max_batch):
    capacity = capacity_blocks * block_size
    got = choose(contexts, capacity, block_size, COST, tpot_s, max_batch)
    want = scan_choose(contexts, capacity, block_size, COST, tpot_s, max_batch)
    assert (got.batch, got.ratio) == (want.batch, want.ratio)
    assert got.step_s == want.step_s or (math.isinf(got.step_s) and math.isinf(want.step_s))


@settings(max_examples=200, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 3000), max_size=60),
    capacity_blocks=st.integers(0, 300),
    tpot_s=st.floats(0.001, 2.0),
    source=st.sampled_from(["host", "auto"]),
    copy_s=st.sampled_from([1e-7, 1e-5, 1e-3]),
    overlap=st.booleans(),
    split=st.booleans(),
    host_tokens=st.integers(0, 20000),
    penalty=st.sampled_from([None, (0.0, 1e-3, 1e-5), (0.05, 0.01, 1e-4), (0.002, 0.0, 1e-6)]),
)
def test_vectorised_choice_with_host_sources_equals_the_scan(
    contexts, capacity_blocks, tpot_s, source, copy_s, overlap, split, host_tokens, penalty
):
    """...with and without a measured prefix-step penalty (`CostModel.prefix_step`); the
    scalar pricing of the all-host case (no split) is the vectorised one's to the bit."""
    sources = PrefixSources.of(
        source,
        kv_bytes_per_token=1000,
        swap_bytes_per_s=1000 / copy_s,
        overlap=overlap,
        host_capacity_tokens=host_tokens,
        num_layers=8,
        layer_split=split,
        step=None if penalty is None else PrefixStepFit(*penalty),
    )
    capacity = capacity_blocks * BS
    got = choose(contexts, capacity, BS, COST, tpot_s, 64, sources)
    want = scan_choose(contexts, capacity, BS, COST, tpot_s, 64, sources)
    assert (got.batch, got.ratio) == (want.batch, want.ratio)
    assert got.step_s == want.step_s or (math.isinf(got.step_s) and math.isinf(want.step_s))


def test_published_step_includes_the_prefill_chunks_the_step_carries():
    """Two decoding and two waiting requests of 100 tokens and a 150-token budget: FCFS runs
    a 150-token chunk with the decodes, and the choice's published step is that whole step
    (the x10-link run's prefill-carrying steps cost 3x a price that left the chunks out);
    the choice itself is the one made without them."""
    contexts, capacity = [100] * 4, 4 * 112
    plain = choose(contexts, capacity, BS, COST, 1.0, 128)
    with_chunks = choose(contexts, capacity, BS, COST, 1.0, 128, pending=[1, 1, 100, 100], token_budget=150)
    assert (with_chunks.batch, with_chunks.ratio) == (plain.batch, plain.ratio) == (4, 0.0)
    assert plain.step_s == COST.estimate_sums(0, 0, 4, 400)
    # the chunk: 150 of the 200 pending tokens, their query-key work scaled alike
    assert with_chunks.step_s == pytest.approx(COST.estimate_sums(150, 200 * 100 * 150 / 200, 4, 400))


def test_hysteresis_keeps_the_ratio_the_running_set_needs():
    """Eight running requests fit the pool only with half their context out of it: without
    the floor a TPOT target no rebuild meets sends r back to 0 (and FCFS then preempts half
    of them by recompute); with it `r` stays at the least ratio that holds them all, and
    nothing new is admitted."""
    contexts, capacity = [200] * 8, 4 * 208
    tight = COST.estimate_sums(0, 0, 4, 800) * 1.0001
    plain = choose(contexts, capacity, BS, COST, tight, 128)
    assert (plain.batch, plain.ratio) == (4, 0.0)
    kept = choose(contexts, capacity, BS, COST, tight, 128, final_contexts=[300] * 8, running=8)
    floor = min(r for r in RATIO_GRID if sum(208 - int(r * 199) // BS * BS for _ in range(8)) <= capacity)
    assert (kept.batch, kept.ratio) == (8, floor) and floor > 0


def test_hysteresis_admits_at_a_ratio_only_what_fits_to_the_end():
    """Four running and four waiting requests of 200 tokens, a pool of six: r > 0 fits all
    eight now. If they grow to 5,000 tokens the pool cannot hold them at any ratio, so the
    committed search keeps FCFS's admission at r = 0; if they end at 220 it admits all."""
    contexts, capacity = [200] * 8, 6 * 208
    host = PrefixSources.of(  # a host read that costs nothing: r > 0 pays whenever it admits more
        "host", kv_bytes_per_token=1000, swap_bytes_per_s=1e12, overlap=True, host_capacity_tokens=10**5
    )
    myopic = choose(contexts, capacity, BS, COST, 1.0, 128, host)
    assert myopic.batch == 8 and myopic.ratio > 0
    long_ends = choose(contexts, capacity, BS, COST, 1.0, 128, host, final_contexts=[5000] * 8, running=4)
    assert (long_ends.batch, long_ends.ratio) == (6, 0.0)
    short_ends = choose(contexts, capacity, BS, COST, 1.0, 128, host, final_contexts=[220] * 8, running=4)
    assert short_ends.batch == 8 and short_ends.ratio > 0


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 2000)), min_size=1, max_size=60),
    running=st.integers(0, 60),
    capacity_blocks=st.integers(0, 300),
    tpot_s=st.floats(0.001, 2.0),
    host_tokens=st.sampled_from([None, 0, 3000, 100000]),
    swap_bytes_per_s=st.sampled_from([1e12, 1e6]),
)
def test_hysteresis_choice_never_commits_past_what_a_ratio_holds(
    data, running, capacity_blocks, tpot_s, host_tokens, swap_bytes_per_s
):
    """Whatever the candidates: the chosen ratio is never below the least one that holds the
    running requests now, and at r > 0 the admitted set beyond them is held through its whole
    future (each request decoding a token per step until its projected end, then leaving) by
    some ratio from the chosen one up: pool, and host space for a host source. Checked step
    by step with the component's own block rounding, independently of the search's
    departure-point bound."""
    contexts = [c for c, _ in data]
    finals = [c + g for c, g in data]
    running = min(running, len(data))
    capacity = capacity_blocks * BS
    sources = (
        REBUILD_ONLY
        if host_tokens is None
        else PrefixSources.of(
            "host",
            kv_bytes_per_token=1000,
            swap_bytes_per_s=swap_bytes_per_s,
            overlap=True,
            host_capacity_tokens=host_tokens,
        )
    )
    got = choose(contexts, capacity, BS, COST, tpot_s, 64, sources, finals, running)

    def resident(lengths, r):
        return [-(-(s - int(r * (s - 1)) // BS * BS) // BS) * BS for s in lengths]

    def fits_now(r):
        return sum(resident(contexts[:running], r)) <= capacity

    floor = next((r for r in RATIO_GRID if fits_now(r)), None)
    assert floor is None or got.ratio >= floor  # None: no ratio holds them, FCFS preempts anyway
    if got.ratio > 0 and got.batch > running:
        b = got.batch
        now = np.array(contexts[:b])
        rem = np.maximum(np.array(finals[:b]) - now, 1)
        t = np.arange(int(rem.max()))[:, None]
        ctx = now[None, :] + t
        live = rem[None, :] > t

        def held(r):
            u = (np.floor(r * (ctx - 1)).astype(np.int64) // BS) * BS
            pool = (-(-(ctx - u) // BS) * BS * live).sum(axis=1)
            host = (u * live).sum(axis=1)
            return (pool <= capacity).all() and (host_tokens is None or (host <= host_tokens).all())

        assert any(held(r) for r in RATIO_GRID if r >= got.ratio)


def test_admission_past_the_end_bound_is_priced():
    """Eight requests of 200 tokens, four running, a four-block pool: r = 0.6 holds all eight
    now. Seven end at 300 and one at 5,000: all at their end at once, no ratio holds the
    eight (the old end-of-life bound admitted seven), but through their future (the short
    ones leave first) 0.85 does. With a host read that hides under the step, holding them at
    0.85 later costs nothing and all eight are admitted at 0.6, as the per-step search alone
    would; with a link whose copy at 0.85 outlasts the step for the long one's ~690 steps,
    that hold costs more than recomputing what 0.6 would not hold, so at 0.6 the bound stays
    and the eight come in only at a ratio that itself holds them to the end."""
    contexts, capacity, finals = [200] * 8, 4 * 208, [300] * 4 + [5000] + [300] * 3

    def host(link):
        return PrefixSources.of(
            "host", kv_bytes_per_token=1000, swap_bytes_per_s=link, overlap=True, host_capacity_tokens=10**5
        )

    for link in (1e15, 5e7):
        assert (choose(contexts, capacity, BS, COST, 1.0, 128, host(link)).batch, link) == (8, link)  # myopic
    free = choose(contexts, capacity, BS, COST, 1.0, 128, host(1e15), final_contexts=finals, running=4)
    assert free.batch == 8 and free.ratio > 0
    slow = choose(contexts, capacity, BS, COST, 1.0, 128, host(5e7), final_contexts=finals, running=4)
    assert slow.batch == 8 and slow.ratio == 0.85


def test_admission_past_the_end_bound_meets_the_tpot_target_at_its_peak():
    """The setup above with a free link and a per-token decode cost that matters: the eight
    fit a step of the target now (23.2 ms at 0.6), but held through their future the peak step
    (the long one alone near 5,000 tokens at 0.85) takes 25.2 ms. With a loose target the free
    hold admits them at 0.6 as before; with a 24.5 ms target it is refused although it costs no
    prefix time, at every ratio (0.85 holds them through their future too, at the same peak
    step), and the end-of-life bound's seven come in."""
    cost = CostModel(PhaseFit(2e-5, 1e-9, 0.01), PhaseFit(2e-4, 1e-6, 0.02), 1e9, {"model": "test"})
    contexts, capacity, finals = [200] * 8, 4 * 208, [300] * 4 + [5000] + [300] * 3
    free = PrefixSources.of(
        "host", kv_bytes_per_token=1000, swap_bytes_per_s=1e15, overlap=True, host_capacity_tokens=10**5
    )
    loose = choose(contexts, capacity, BS, cost, 1.0, 128, free, final_contexts=finals, running=4)
    assert loose.batch == 8 and 0 < loose.ratio < 0.85
    tight = choose(contexts, capacity, BS, cost, 0.0245, 128, free, final_contexts=finals, running=4)
    assert tight.step_s <= 0.0245 and tight.batch == 7


def test_peak_need_counts_departures():
    """Two requests of 100 tokens, one leaving after 10 more and one after 1,000: the live
    tokens peak at 1,099 (the long one alone, just before its end), not at their finals' sum."""
    rows, tokens, peak = peak_need(np.array([100, 100]), np.array([110, 1100]), BS)
    assert sorted(zip(rows.tolist(), tokens.tolist())) == [(1, 1099), (2, 218)]
    assert tokens[peak[0]] == 1099 and tokens[peak[-1]] == 1099


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000)), min_size=1, max_size=40))
def test_prefix_futures_pick_each_prefix_its_own_peak(data):
    """`PrefixFutures` (one pass for every FCFS prefix of the candidates) picks, per ratio, the
    same (live rows, live tokens) for the first `b` as the set's own departure points do (the
    original one-set computation, written out here), for every `b`."""
    contexts = np.array([c for c, _ in data])
    finals = contexts + np.array([g for _, g in data])
    futures = PrefixFutures(contexts, finals)
    for b in range(1, len(data) + 1):
        s, f = contexts[:b], finals[:b]
        rem = np.maximum(f - s, 1)
        t = np.unique(rem) - 1
        live = rem[None, :] > t[:, None]
        rows, tokens = live.sum(axis=1), (live * (s[None, :] + t[:, None])).sum(axis=1)
        want = (1 - np.array(RATIO_GRID)[:, None]) * tokens[None, :] + 2 * BS * rows[None, :]
        k = want.argmax(axis=1)
        got_rows, got_tokens = futures.of(b)
        j = peak_points(got_rows, got_tokens, BS)
        assert (got_rows[j] == rows[k]).all() and (got_tokens[j] == tokens[k]).all()


def test_engine_under_ellm_and_swap_matches_fcfs(tiny_model_dir, tmp_path):
    """A pool too small for the batch: ellm rebuilds prefixes to fit more requests, swap moves
    whole requests to host and back, and the greedy tokens are FCFS's; ellm's decision time is
    published."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.scheduling.ellm import ELLMPolicy

    path = tmp_path / "cost.json"
    COST.save(path)
    prompts = [[1000 + 7 * i + j for i in range(n)] for j, n in enumerate((60, 50, 70, 40, 65))]

    def run(policy: str, **overrides):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir("llama")),
                dtype="float32",
                attention="reference",
                num_blocks=14,
                block_size=BS,
                max_num_batched_tokens=64,
                policy=policy,
                cost_model_path=str(path),
                rt_tpot_s=1.0,
                num_threads=1,
                **overrides,
            )
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        ratios = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            engine.kv.check_invariants()
            policy_obj = engine.scheduler.policy
            if isinstance(policy_obj, ELLMPolicy):
                ratios.append(policy_obj.last.ratio)
                assert policy_obj.last.decision_s > 0 and policy_obj.last.decision_cpu_s > 0
        engines.append(engine)
        return tokens, ratios, engine.stats

    engines = []
    fcfs, _, _ = run("fcfs")
    ellm, ratios, _ = run("ellm")
    assert ellm == fcfs
    assert max(ratios) > 0, json.dumps(ratios)
    swap, _, stats = run("swap", num_host_blocks=64)  # the vLLM-Swap baseline: requests move to host and back
    assert swap == fcfs and stats.swap_outs > 0
    # the host source: COST's 1 GB/s host link prices a read far below a rebuild, so ellm picks host
    host, ratios, _ = run("ellm", uncached_source="auto", num_host_blocks=64)
    assert host == fcfs and max(ratios) > 0
    assert engines[-1].scheduler.policy.stats.host_steps > 0
