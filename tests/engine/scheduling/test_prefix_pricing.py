"""Pricing the non-resident prefixes by source: a host read is a copy added to a CPU step and
overlapped with a GPU one, the layer split balances copy and rebuild only where they overlap,
and `choose` prices each ratio with the cheaper source within the host space."""

from __future__ import annotations

import pytest

from engine.cost_model import CostModel, PhaseFit, PrefixStepFit
from engine.scheduling.ellm import choose
from engine.scheduling.prefix_pricing import PrefixSources, host_step_seconds, split_shares

BS = 16


def _sources(overlap: bool, split: bool, layers: int = 4, copy: float = 1.0, capacity: int = 10**9, source="auto"):
    return PrefixSources.of(
        source,
        kv_bytes_per_token=int(copy * 1e9),
        swap_bytes_per_s=1e9,  # copy seconds per token = `copy`
        overlap=overlap,
        host_capacity_tokens=capacity,
        num_layers=layers,
        layer_split=split,
    )


def test_host_read_adds_on_a_cpu_and_overlaps_on_a_gpu():
    cpu, layers = host_step_seconds(1.0, 50.0, 10, _sources(overlap=False, split=False))
    assert (cpu, layers) == (pytest.approx(11.0), 4)  # 1 s step + 10 tokens x 1 s
    gpu, _ = host_step_seconds(1.0, 50.0, 10, _sources(overlap=True, split=False))
    assert gpu == pytest.approx(10.0)


def test_layer_split_balances_only_where_copies_overlap():
    """Copy 10 s and rebuild 10 s for the whole prefix, 4 layers: overlapped, two layers each
    way balance them (6 s of step + rebuild against 6.25 s of copy, the stored layer input
    included); summed, the cost is linear in the layers and an end wins."""
    step, layers = host_step_seconds(1.0, 10.0, 10, _sources(overlap=True, split=True))
    assert layers == 2 and step == pytest.approx(max(1 + 5.0, 2.5 / 4 * 10))
    step, layers = host_step_seconds(1.0, 10.0, 10, _sources(overlap=False, split=True))
    assert layers in (0, 4) and step == pytest.approx(11.0)
    assert split_shares(2, 4) == (0.625, 0.5) and split_shares(4, 4) == (1.0, 0.0) and split_shares(0, 4) == (0, 1)


# a step constant that makes batching pay, and a rebuild that costs 1 ms per token: rebuilding never pays
COST = CostModel(PhaseFit(1e-3, 1e-9, 0.01), PhaseFit(2e-4, 1e-8, 0.02), 1e9, {"model": "test"})


def test_cheap_host_reads_pay_where_rebuilding_does_not():
    contexts, capacity = [200] * 8, 4 * 208
    rebuild = choose(contexts, capacity, BS, COST, tpot_s=0.1, max_batch=128)
    assert rebuild.ratio == 0 and rebuild.batch == 4
    cheap = _sources(overlap=False, split=False, copy=1e-6)
    host = choose(contexts, capacity, BS, COST, tpot_s=0.1, max_batch=128, sources=cheap)
    assert host.ratio > 0 and host.batch == 8 and host.source == "host" and host.host_layers == 4
    assert 0 < host.rebuild_s < host.step_s
    no_room = _sources(overlap=False, split=False, copy=1e-6, capacity=BS)  # the host cannot take them
    assert choose(contexts, capacity, BS, COST, tpot_s=0.1, max_batch=128, sources=no_room).ratio == 0


def test_expensive_host_reads_are_not_chosen():
    costly = _sources(overlap=False, split=False, copy=1.0)
    choice = choose([200] * 8, 4 * 208, BS, COST, tpot_s=0.1, max_batch=128, sources=costly)
    assert choice.ratio == 0 and choice.source == "rebuild"


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="prefix source"):
        _sources(overlap=False, split=False, source="disk")


def _measured(step: PrefixStepFit, copy: float = 1e-6, overlap: bool = False):
    return PrefixSources.of(
        "auto",
        kv_bytes_per_token=int(copy * 1e9),
        swap_bytes_per_s=1e9,
        overlap=overlap,
        host_capacity_tokens=10**9,
        num_layers=4,
        step=step,
    )


def test_measured_prefix_step_replaces_the_copy_price():
    """A host step with the measured penalty: step + overhead + per row + per token (which
    replaces the bandwidth's copy price); a rebuild step pays the overhead and per-row part."""
    step = PrefixStepFit(overhead_s=0.5, per_row_s=0.25, per_token_s=0.01)
    sources = _measured(step, copy=1.0)  # the bandwidth would say 1 s per token: ignored
    seconds, layers = host_step_seconds(1.0, 50.0, 10, sources, rows=2)
    assert (seconds, layers) == (pytest.approx(1.0 + 0.5 + 0.5 + 0.1), 4)
    assert sources.off_graph_s(2) == pytest.approx(1.0) and sources.off_graph_s(0) == 0.0
    assert (
        PrefixSources.of(
            "rebuild", kv_bytes_per_token=1, swap_bytes_per_s=1.0, overlap=False, host_capacity_tokens=0, step=step
        ).copy_s_per_token
        == 0.0
    )


def test_the_off_graph_penalty_stops_a_ratio_that_loses():
    """The CPU engine's failure (docs/ellm.md): a copy priced at a few µs per token makes a
    large ratio look free, so `ellm` doubles the batch; with the measured penalty of leaving the
    compiled decode path (here 2x the step, as measured) the same batch gain does not pay and
    it keeps r = 0. A penalty small against the gain still lets it trade."""
    contexts, capacity = [200] * 8, 4 * 208
    copy_only = choose(contexts, capacity, BS, COST, tpot_s=1.0, max_batch=128, sources=_measured(None))
    assert copy_only.ratio > 0 and copy_only.batch == 8
    plain = choose(contexts, capacity, BS, COST, tpot_s=1.0, max_batch=128).step_s  # r = 0, b = 4
    heavy = PrefixStepFit(overhead_s=2 * plain, per_row_s=2e-3, per_token_s=2e-6)
    chosen = choose(contexts, capacity, BS, COST, tpot_s=1.0, max_batch=128, sources=_measured(heavy))
    assert chosen.ratio == 0 and chosen.batch == 4
    light = PrefixStepFit(overhead_s=0.05 * plain, per_row_s=1e-5, per_token_s=2e-7)
    chosen = choose(contexts, capacity, BS, COST, tpot_s=1.0, max_batch=128, sources=_measured(light))
    assert chosen.ratio > 0 and chosen.batch == 8 and chosen.source == "host"
    assert chosen.rebuild_s == pytest.approx(chosen.step_s - COST.estimate_sums(0, 0, 8, sum(contexts)))
