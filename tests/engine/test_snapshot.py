"""The engine's published state (engine/snapshot.py): immutable, and equal to the engine's own
state after every step."""

from __future__ import annotations

import dataclasses

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.scheduling import RequestClass
from engine.snapshot import flatten_stats


def _config(path, **kw) -> EngineConfig:
    base = dict(model=str(path), dtype="float32", num_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    return EngineConfig(**{**base, **kw})


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 131 + j * 7) % 4000 + 10 for j in range(n)]


def _assert_matches(engine: LLMEngine) -> None:
    snap, sched, pool = engine.snapshot, engine.scheduler, engine.kv.pool
    for cls, counts in ((RequestClass.RT, snap.rt), (RequestClass.BE, snap.be)):
        assert counts.running == sum(r.req_class is cls for r in sched.running)
        assert counts.waiting == sum(r.req_class is cls for r in sched.waiting)
    assert snap.running_ids == tuple(r.request_id for r in sched.running)
    assert (snap.kv_blocks_free, snap.kv_blocks_capacity) == (pool.num_free, pool.capacity)
    assert snap.kv_usage == pool.usage() and snap.kv_blocks_used == pool.capacity - pool.num_free
    assert dict(snap.session_stats) == flatten_stats(engine.sessions.stats.as_dict())
    assert dict(snap.engine_stats) == engine.stats.as_dict()
    assert snap.num_unfinished == len(sched.running) + len(sched.waiting)


@pytest.mark.timeout(300)
def test_snapshot_matches_the_engine_after_every_step_and_never_changes(tiny_model_dir):
    engine = LLMEngine(_config(tiny_model_dir("llama")))
    first = engine.snapshot
    assert first.seq == 0 and first.num_unfinished == 0 and first.kv_blocks_used == 0
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(6):  # more than max_num_seqs: some wait; BE and RT mixed
        cls = RequestClass.BE if i % 2 else RequestClass.RT
        engine.add_request(f"r{i}", _prompt(i, 40 + 9 * i), params, req_class=cls)
    seen, old = [], None
    while engine.has_unfinished():
        engine.step()
        _assert_matches(engine)
        seen.append(engine.snapshot)
        if old is None and engine.snapshot.rt.waiting + engine.snapshot.be.waiting:
            old = (engine.snapshot, dataclasses.asdict(engine.snapshot))
    assert [s.seq for s in seen] == list(range(1, len(seen) + 1))
    assert any(s.rt.running and s.be.running for s in seen) and old is not None
    assert dataclasses.asdict(old[0]) == old[1]  # later steps replaced it, never changed it
    assert seen[-1].num_unfinished == 0 and seen[-1].engine_stats["generation_tokens"] == 36
    engine.step()  # an idle step publishes too
    assert engine.snapshot.seq == len(seen) + 1


@pytest.mark.timeout(300)
def test_snapshot_is_immutable(tiny_model_dir):
    snap = LLMEngine(_config(tiny_model_dir("llama"))).snapshot
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.rt = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.rt.running = 3
    with pytest.raises(TypeError):
        snap.session_stats["turns"] = 1
    with pytest.raises(TypeError):
        snap.engine_stats["steps"] = 1
    assert isinstance(snap.running_ids, tuple)
    assert "tokens_reused_gpu" in snap.session_stats  # nested counters flattened
