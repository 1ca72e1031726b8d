"""Prefill-first unchunked FCFS (the papers' vLLM) on a real KV manager: steps are never
mixed, prompts are never chunked, decodes wait for every admissible prefill."""

from __future__ import annotations

from engine.kv import BlockPool, KVCacheManager
from engine.sampling import SamplingParams
from engine.scheduling import BatchLimits, Request, RequestStatus, Scheduler, make_policy


def _sched(num_blocks=64, block_size=4, max_seqs=8, budget=32) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    # chunking "enabled" in the limits on purpose: the policy is the unchunked mode regardless
    return Scheduler(kv, BatchLimits(max_seqs, budget, True), make_policy("fcfs-prefill-first"))


def _add(s: Scheduler, rid: str, n: int) -> Request:
    base = 1000 + len(s.requests) * 100
    r = Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=100))
    s.add(r)
    return r


def _run(s: Scheduler, batch) -> None:
    for it in batch.items:
        r = it.request
        r.num_computed_tokens += it.num_new_tokens
        s.kv.commit(r)
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7, None, 0.0)


def _rows(batch) -> list[tuple[str, int]]:
    return [(it.request.request_id, it.num_new_tokens) for it in batch.items]


def test_whole_prompts_only_and_never_mixed():
    s = _sched(budget=32)
    _add(s, "a", 20), _add(s, "b", 30)
    batch = s.schedule()
    assert _rows(batch) == [("a", 20)]  # b does not fit the rest of the budget and is not chunked
    _run(s, batch)
    batch = s.schedule()
    assert _rows(batch) == [("b", 30)]  # a prefill step: a's decode waits for it
    _run(s, batch)
    assert _rows(s.schedule()) == [("a", 1), ("b", 1)]  # nothing admissible: a decode step


def test_new_arrival_stalls_decodes():
    s = _sched(budget=64)
    _add(s, "a", 10)
    _run(s, s.schedule())
    _run(s, s.schedule())  # a decodes
    _add(s, "late", 16)
    assert _rows(s.schedule()) == [("late", 16)]  # head-of-line blocking, as the papers' vLLM


def test_oversized_prompt_runs_alone():
    s = _sched(budget=16)
    _add(s, "big", 40)
    assert _rows(s.schedule()) == [("big", 40)]


def test_decode_preempts_newest_by_recompute():
    s = _sched(num_blocks=7, block_size=4, budget=64)  # 6 usable blocks = 24 tokens
    a, b = _add(s, "a", 12), _add(s, "b", 12)
    _run(s, s.schedule())  # both prefilled: 6 blocks, all full
    batch = s.schedule()  # a's decode needs a 7th block: b (newest) is preempted
    assert b in batch.preempted and b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert _rows(batch) == [("a", 1)]
    assert s.waiting[0] is b and a.status is RequestStatus.RUNNING
