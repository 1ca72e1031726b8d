"""Pricing the non-resident prefixes by source: a host read is a copy added to a CPU step and
overlapped with a GPU one, the layer split balances copy and rebuild only where they overlap,
and `choose` prices each ratio with the cheaper source within the host space."""

from __future__ import annotations

import pytest

from engine.cost_model import CostModel, PhaseFit
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
