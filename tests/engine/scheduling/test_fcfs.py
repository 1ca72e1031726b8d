"""FCFS policy on a real KV manager: budgets, caps, chunking, preemption order."""

from __future__ import annotations

from engine.kv import BlockPool, KVCacheManager
from engine.sampling import SamplingParams
from engine.scheduling import BatchLimits, Request, RequestStatus, Scheduler, make_policy


def _sched(num_blocks=64, block_size=4, max_seqs=8, budget=32, chunked=True) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(kv, BatchLimits(max_seqs, budget, chunked), make_policy("fcfs"))


def _add(s: Scheduler, rid: str, n: int) -> Request:
    r = Request(
        rid, list(range(1000 + len(s.requests) * 100, 1000 + len(s.requests) * 100 + n)), SamplingParams(max_tokens=100)
    )
    s.add(r)
    return r


def _run(s: Scheduler, batch) -> None:
    """Pretend the model ran: advance progress and sample a token where a row completes."""
    for it in batch.items:
        r = it.request
        r.num_computed_tokens += it.num_new_tokens
        s.kv.commit(r)
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7, None, 0.0)


def test_token_budget_and_chunked_prefill():
    s = _sched(budget=32)
    _a, _b = _add(s, "a", 20), _add(s, "b", 30)
    batch = s.schedule()
    assert [(it.request.request_id, it.num_new_tokens) for it in batch.items] == [("a", 20), ("b", 12)]
    _run(s, batch)
    batch = s.schedule()  # a decodes, b's prefill continues
    assert [(it.request.request_id, it.num_new_tokens) for it in batch.items] == [("a", 1), ("b", 18)]


def test_no_chunking_waits_for_room():
    s = _sched(budget=32, chunked=False)
    _add(s, "a", 20), _add(s, "b", 30)
    assert [it.request.request_id for it in s.schedule().items] == ["a"]


def test_max_num_seqs():
    s = _sched(max_seqs=2, budget=100)
    for i in range(4):
        _add(s, str(i), 5)
    assert len(s.schedule().items) == 2 and len(s.waiting) == 2


def test_preempts_latest_admitted_when_blocks_run_out():
    s = _sched(num_blocks=7, block_size=4, budget=64)  # 6 usable blocks = 24 tokens
    _a, b = _add(s, "a", 8), _add(s, "b", 12)
    _run(s, s.schedule())  # a: 3 blocks needed after its token? 8+1 -> grows below
    for _ in range(6):
        batch = s.schedule()
        _run(s, batch)
        if batch.preempted:
            break
    assert batch.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert not s.kv.holds(b)


def test_lone_request_never_deadlocks():
    s = _sched(num_blocks=5, block_size=4, budget=64)  # 16 tokens of room
    a = _add(s, "a", 6)
    for _ in range(9):
        batch = s.schedule()
        assert batch.items
        _run(s, batch)
    assert a.num_tokens == 15


def test_finish_and_abort_free_blocks():
    s = _sched()
    a, _b = _add(s, "a", 10), _add(s, "b", 10)
    _run(s, s.schedule())
    free_before = s.kv.pool.num_free
    s.abort("a")
    assert s.kv.pool.num_free > free_before and a.is_finished and "a" not in s.requests
    s.abort("b")
    assert s.kv.pool.num_free == s.kv.pool.capacity
    assert not s.has_work()
