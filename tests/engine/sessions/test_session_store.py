"""SessionStore behaviour around the engine: prefetch pins (TTL, release, memory pressure),
disk budget, listeners, aborted turns, the disk writer, cost estimates, and AsyncLLM."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncLLM, EngineConfig, SamplingParams
from engine.cost_model import CostModel, PhaseFit
from engine.sessions import SessionInfo, TransferCosts
from engine.sessions.disk_tier import DiskTier
from engine.sessions.kvfile import KVLayout, file_size, read_file_header
from tests.engine.sessions.conftest import (
    BS,
    KEPT,
    PROMPT1,
    assert_no_leaked_pins,
    evict_device,
    run,
    tokens,
    turn2_prompt,
)


def test_prefetch_pin_expires_and_releases_blocks(make_engine):
    engine = make_engine(session_prefetch_ttl_s=0.0)
    run(engine, "t1", PROMPT1, session_id="chat")
    evict_device(engine, "chat")
    pool = engine.kv.pool
    assert engine.sessions.prefetch("nobody").found is False
    result = engine.sessions.prefetch("chat")
    assert (result.found, result.tier, result.num_tokens, result.tokens_promoted, result.tokens_pinned) == (
        True,
        "host",
        KEPT,
        KEPT,
        KEPT,
    )
    assert pool.num_free == pool.capacity - KEPT // BS
    assert engine.sessions.wait_loads(timeout=120)
    assert "gpu" in engine.sessions.info("chat").tiers
    engine.step()  # idle step: the expired pin is released...
    assert pool.num_free == pool.capacity
    assert "gpu" in engine.sessions.info("chat").tiers  # ...and the blocks stay cached


def test_prefetched_turn_reuses_device_blocks(make_engine):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1, session_id="chat")
    evict_device(engine, "chat")
    assert engine.sessions.prefetch("chat").tier == "host"
    engine.sessions.wait_loads(timeout=120)
    t2 = run(engine, "t2", turn2_prompt(t1), session_id="chat")
    stats = engine.sessions.stats
    assert t2.num_cached_tokens == KEPT and stats.tokens_reused["gpu"] == KEPT and stats.prefetches == 1
    assert_no_leaked_pins(engine)  # the turn took over the prefetch pin and released it on admission


def test_invariant_check_counts_pinned_blocks(make_engine):
    """A prefetch pin's references are holders, not leaks: the engine's check passes while it is
    held, the table-only check sees the extra references, and both pass once it is released."""
    engine = make_engine()
    run(engine, "t1", PROMPT1, session_id="chat")
    engine.sessions.prefetch("chat")
    assert len(engine.sessions.pins.held_blocks()) == KEPT // BS
    engine.check_invariants()
    with pytest.raises(AssertionError):
        engine.kv.check_invariants()
    engine.sessions.release("chat")
    assert engine.sessions.pins.held_blocks() == []
    engine.kv.check_invariants()


def test_release_drops_prefetch_pin(make_engine):
    engine = make_engine()
    run(engine, "t1", PROMPT1, session_id="chat")
    assert engine.sessions.prefetch("chat").tier == "gpu"  # still on the device: nothing to move
    assert engine.kv.pool.num_free == engine.kv.pool.capacity - KEPT // BS
    engine.sessions.release("chat")
    assert engine.kv.pool.num_free == engine.kv.pool.capacity


@pytest.mark.timeout(300)
def test_pins_yield_under_memory_pressure(make_engine):
    engine = make_engine()
    run(engine, "t1", PROMPT1, session_id="chat")
    engine.sessions.prefetch("chat")
    big = run(engine, "big", tokens(360, seed=5), params=SamplingParams(temperature=0, max_tokens=2))
    assert big.num_output_tokens == 2  # needed every block: the prefetch pin gave way
    assert engine.kv.pool.num_free == engine.kv.pool.capacity


def test_aborted_waiting_turn_releases_its_pin(make_engine):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1, session_id="chat")
    evict_device(engine, "chat")
    engine.add_request("t2", turn2_prompt(t1), SamplingParams(max_tokens=4), session_id="chat")
    engine.abort("t2")
    assert_no_leaked_pins(engine)
    assert engine.sessions.stats.turns == 2 and sum(engine.sessions.stats.tokens_reused.values()) == 0
    assert engine.sessions.info("chat").num_tokens == KEPT  # an aborted turn keeps nothing new


def test_disk_budget_drops_least_recent_sessions(make_engine):
    prompts = {f"s{i}": tokens(40, seed=10 + i) for i in range(3)}
    layout_probe = make_engine(session_dir=None)
    size = file_size("s0", prompts["s0"][:32], layout_probe.sessions.layout)  # 42 tokens keep 2 blocks
    engine = make_engine(session_disk_gib=2.5 * size / 2**30)
    seen: list[SessionInfo] = []
    engine.sessions.listeners.append(seen.append)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for sid, prompt in prompts.items():
        run(engine, sid, prompt, session_id=sid, params=params)
        # Each file is written before the next turn, so the budget deletes a written file.
        # (Without this, a slow writer thread may still have s0's write queued when s2's turn
        # drops s0; the store then cancels that write, rightly, and only two are counted.)
        engine.sessions.flush()
    assert engine.sessions.info("s0") is None and {i.session_id for i in engine.sessions.snapshot()} == {"s1", "s2"}
    assert engine.sessions.stats.sessions_dropped == 1
    dropped = [i for i in seen if i.session_id == "s0" and i.dropped]
    assert len(dropped) == 1 and seen[0] == SessionInfo(
        "s0", 32, ("gpu", "host", "disk"), seen[0].nbytes, seen[0].last_activity
    )
    engine.sessions.flush()
    files = {read_file_header(p).session_id for p in engine.sessions.disk.dir.glob("*.kv")}
    assert files == {"s1", "s2"}
    engine.step()
    assert engine.sessions.stats.bytes_written_disk >= 3 * size - 30


def test_disk_writer_failure_is_reported(tmp_path):
    layout = KVLayout("m", "llama", 2, 1, 4, "float32", 4)
    disk = DiskTier(tmp_path, layout)
    try:
        good = [torch.zeros(2, 1, 4, 4)] * 2
        disk.write("a", [1, 2, 3, 4], good, 1, 0.0)
        disk.write("b", [1, 2, 3, 4], [torch.zeros(2, 1, 3, 4)] * 2, 1, 0.0)  # wrong shape: the write fails
        assert disk.flush(timeout=120)
        results = {r.session_id: r for r in disk.take_results()}
        assert results["a"].error is None and results["a"].nbytes == disk.path_for("a").stat().st_size
        assert "does not match" in results["b"].error and not disk.path_for("b").exists()
    finally:
        disk.close()


def test_failed_write_forgets_only_its_own_copy(tmp_path):
    """A failed write drops the session's disk entry, unless a newer write of it was queued
    since: that one's entry (and file) must survive the older failure being collected."""
    layout = KVLayout("m", "llama", 2, 1, 4, "float32", 4)
    disk = DiskTier(tmp_path, layout)
    try:
        good, bad = [torch.zeros(2, 1, 4, 4)] * 2, [torch.zeros(2, 1, 3, 4)] * 2
        disk.write("a", [1, 2, 3, 4], bad, 1, 0.0)
        assert disk.flush(timeout=120)
        disk.write("a", [1, 2, 3, 4], good, 1, 1.0)
        assert disk.flush(timeout=120)
        assert [r.error is None for r in disk.take_results()] == [False, True]
        assert disk.holds("a") and disk.export_path("a") == disk.path_for("a")
        disk.write("b", [1, 2, 3, 4], bad, 1, 0.0)
        assert disk.flush(timeout=120)
        assert disk.take_results()[0].error is not None
        assert not disk.holds("b") and disk.export_path("b") is None
    finally:
        disk.close()


def test_transfer_cost_estimates():
    costs = TransferCosts(bytes_per_token=1000)
    assert costs.estimate_pull_s(200_000_000) == pytest.approx(1.02)
    assert costs.estimate_recompute_s(1000) == pytest.approx(1.0)  # default 1000 tokens/s
    assert costs.should_pull(1000)  # 1 MB: 25 ms to pull vs 1 s to recompute
    for _ in range(10):  # EWMAs: a fast engine (recomputing is cheap) and a slow network
        costs.record_prefill(1000, 0.01)
        costs.record_pull(1_000_000, 1.0)
    assert not costs.should_pull(1000)
    model = CostModel(PhaseFit(1e-3, 0.0, 0.01), PhaseFit(1e-3, 0.0, 0.01), 1e9)
    chunked = TransferCosts(1000, model, max_batched_tokens=512)
    assert chunked.estimate_recompute_s(1024) == pytest.approx(2 * (0.512 + 0.01))


def test_engine_measures_prefill_rate(make_engine):
    engine = make_engine(session_dir=None)
    before = engine.sessions.costs.prefill_tokens_per_s
    run(engine, "t1", PROMPT1)
    assert engine.sessions.costs.prefill_tokens_per_s != before
    assert engine.sessions.estimate_recompute_s(100) > 0


@pytest.mark.timeout(300)
def test_async_llm_sessions_and_call(tiny_llama, tmp_path):
    config = EngineConfig(model=tiny_llama, dtype="float32", num_blocks=24, session_dir=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def turn(llm, rid, prompt):
        deltas = [d async for d in llm.generate(rid, prompt, params, session_id="chat")]
        return [t for d in deltas for t in d.token_ids], deltas[-1].metrics

    async def main():
        llm = AsyncLLM(config)
        await llm.start()
        try:
            out1, _ = await turn(llm, "t1", PROMPT1)
            out2, metrics = await turn(llm, "t2", PROMPT1 + out1 + tokens(20, seed=2))
            info = await llm.call(lambda engine, sid: engine.sessions.info(sid), "chat")
            prefetch = await llm.call(lambda engine, sid: engine.sessions.prefetch(sid), "chat")
            with pytest.raises(ZeroDivisionError):
                await llm.call(lambda engine: 1 / 0)
            return metrics, info, prefetch
        finally:
            await llm.shutdown()

    metrics, info, prefetch = asyncio.run(main())
    assert metrics.num_cached_tokens == KEPT
    assert info.num_tokens == 64 and prefetch.found and prefetch.tier == "gpu"
    assert list(tmp_path.glob("*/*.kv"))  # shutdown flushed the writer


def test_bad_session_settings_are_refused(make_engine):
    for overrides, match in [
        (dict(session_disk_gib=-1), "session_disk_gib"),
        (dict(session_prefetch_ttl_s=-0.5), "session_prefetch_ttl_s"),
        (dict(session_eviction="random"), "unknown session eviction policy"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_engine(**overrides)
    engine = make_engine(session_dir=None)
    with pytest.raises(ValueError, match="session_id"):
        engine.add_request("x", PROMPT1, SamplingParams(), session_id="")
