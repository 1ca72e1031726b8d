"""The engine's published state (engine/snapshot.py): immutable, equal to the engine's own state
after every step, and safe to read from another thread while the engine thread steps."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from engine import AsyncLLM, EngineConfig, LLMEngine, SamplingParams
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


@pytest.mark.timeout(300)
def test_snapshot_read_from_another_thread_while_the_engine_steps(tiny_model_dir):
    """A reader thread walks every snapshot as fast as it can while requests stream; the old
    worker code read the live queues this way and met dicts changing size under it."""
    errors: list[BaseException] = []
    done = threading.Event()
    seqs: list[int] = []
    busiest = [0]

    def read(llm: AsyncLLM) -> None:
        while not done.is_set():
            try:
                s = llm.snapshot()
                assert s.rt.running + s.be.running == len(s.running_ids)
                assert 0 <= s.kv_blocks_free <= s.kv_blocks_capacity
                assert sum(s.session_stats.values()) >= 0 and s.engine_stats["steps"] >= 0
                seqs.append(s.seq)
                busiest[0] = max(busiest[0], len(s.running_ids))
            except BaseException as exc:  # noqa: BLE001 (reported by the test thread)
                errors.append(exc)
                return

    async def main():
        llm = AsyncLLM(_config(tiny_model_dir("llama")))
        await llm.start()
        reader = threading.Thread(target=read, args=(llm,))
        reader.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

            async def one(i):
                return [d async for d in llm.generate(f"c{i}", _prompt(i, 30 + i), params, session_id=f"s{i % 3}")]

            results = await asyncio.gather(*(one(i) for i in range(10)))
            return results, llm.snapshot()
        finally:
            done.set()
            reader.join()
            await llm.shutdown()

    results, last = asyncio.run(main())
    assert not errors, errors
    assert all(sum(len(d.token_ids) for d in r) == 12 for r in results)
    assert len(seqs) > 10 and seqs == sorted(seqs) and busiest[0] > 1
    # the step that finished the last request published before its delta left the engine thread
    assert last.num_unfinished == 0 and last.engine_stats["generation_tokens"] == 120
    assert last.session_stats["turns"] == 10
