"""Round-robin baseline on a real KV manager: alternating classes, passing empty turns,
FCFS order inside a class, recompute preemption under memory pressure."""

from __future__ import annotations

from engine.kv import BlockPool, KVCacheManager
from engine.sampling import SamplingParams
from engine.scheduling import BatchLimits, Request, RequestClass, Scheduler, make_policy


def _sched(num_blocks=64, block_size=4, max_seqs=8, budget=64) -> Scheduler:
    return Scheduler(
        KVCacheManager(BlockPool(num_blocks), block_size), BatchLimits(max_seqs, budget), make_policy("rr")
    )


def _add(s: Scheduler, rid: str, n: int, cls: RequestClass) -> Request:
    base = 1000 + len(s.requests) * 100
    r = Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=100), req_class=cls)
    s.add(r)
    return r


def _run(s: Scheduler, batch) -> None:
    for it in batch.items:
        r = it.request
        r.num_computed_tokens += it.num_new_tokens
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7, None, 0.0)


def _ids(batch) -> list[str]:
    return [it.request.request_id for it in batch.items]


def test_alternates_between_classes():
    s = _sched()
    _add(s, "rt1", 5, RequestClass.RT), _add(s, "be1", 6, RequestClass.BE), _add(s, "rt2", 5, RequestClass.RT)
    seen = []
    for _ in range(4):
        batch = s.schedule()
        seen.append(_ids(batch))
        _run(s, batch)
    assert seen == [["rt1", "rt2"], ["be1"], ["rt1", "rt2"], ["be1"]]


def test_empty_class_passes_its_turn():
    s = _sched()
    _add(s, "be1", 6, RequestClass.BE)
    for _ in range(3):
        batch = s.schedule()
        assert _ids(batch) == ["be1"]
        _run(s, batch)


def test_preempts_latest_admitted_under_pressure():
    s = _sched(num_blocks=6, block_size=4)  # 5 usable blocks = 20 tokens
    _add(s, "be1", 12, RequestClass.BE)
    _run(s, s.schedule())  # BE turn (no RT yet): be1 holds 3 blocks, then has 13 tokens
    rt = _add(s, "rt1", 8, RequestClass.RT)
    batch = s.schedule()  # RT turn: rt1 takes the last 2 blocks
    assert _ids(batch) == ["rt1"]
    _run(s, batch)
    batch = s.schedule()  # BE turn: be1's 13th token needs a 4th block: rt1 (admitted last) is evicted
    assert _ids(batch) == ["be1"] and batch.preempted == [rt]
    assert not s.kv.holds(rt) and s.waiting[0] is rt and rt.num_computed_tokens == 0
    _run(s, batch)
