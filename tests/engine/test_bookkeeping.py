"""The step bookkeeping the engine and the simulator share (engine/bookkeeping.py), on a real
scheduler, FCFS policy, KV manager and block pool, with no model: what a step does to its
requests once the batch ran."""

from __future__ import annotations

from engine.bookkeeping import EngineStats, StepBookkeeping, produces_token
from engine.kv import BlockPool, KVCacheManager
from engine.sampling import SamplingParams
from engine.scheduling import BatchLimits, FinishReason, Request, RequestClass, Scheduler
from engine.scheduling.fcfs import FCFSPolicy

BS = 4


class RecordingFCFS(FCFSPolicy):
    """FCFS that remembers what `on_step_end` was told."""

    def __init__(self) -> None:
        self.step_ends: list[float] = []

    def on_step_end(self, batch, elapsed_s: float) -> None:
        self.step_ends.append(elapsed_s)


def _setup(num_blocks=32, on_finish=None, budget=64):
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    policy = RecordingFCFS()
    scheduler = Scheduler(kv, BatchLimits(8, budget), policy)
    stats = EngineStats()
    return scheduler, kv, policy, stats, StepBookkeeping(scheduler, stats, on_finish)


def _request(rid: str, n_prompt: int, max_tokens: int = 3, **kw) -> Request:
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw), 0.0)


def _run_step(scheduler, book, now: float, token: int = 7):
    batch = scheduler.schedule(now)
    book.scheduled(batch)
    sampled = [it.request for it in batch.items if produces_token(it)]
    book.advance(batch.items)
    stops = {}
    for r in sampled:
        stop = book.append_token(r, token, None, now)
        if stop is not None:
            book.finish(r, stop, now)
            stops[r.request_id] = stop
    book.step_done(batch, 0.01)
    return batch, sampled, stops


def test_advance_moves_progress_commits_full_blocks_and_counts_prefill():
    scheduler, kv, _, stats, book = _setup(budget=6)
    r = _request("a", 10)
    scheduler.add(r)
    batch, sampled, _ = _run_step(scheduler, book, 1.0)  # chunked: 6 of 10 prompt tokens
    assert [it.num_new_tokens for it in batch.items] == [6] and sampled == []
    assert r.num_computed_tokens == 6
    assert kv.pool.lookup(kv.block_hashes(r, 1)[0]) is not None  # the one full block is in the prefix cache
    assert (stats.steps, stats.prompt_tokens_computed, stats.tokens_computed, stats.generation_tokens) == (1, 6, 6, 0)
    _, sampled, _ = _run_step(scheduler, book, 2.0)  # the rest of the prompt: one token sampled
    assert sampled == [r] and r.num_computed_tokens == 10 and r.output_token_ids == [7]
    assert (stats.steps, stats.prompt_tokens_computed, stats.tokens_computed, stats.generation_tokens) == (2, 10, 10, 1)
    assert r.first_token_time == 2.0


def test_advance_skips_failed_and_finished_rows():
    scheduler, kv, _, stats, book = _setup()
    a, b = _request("a", 5), _request("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule(0.0)
    scheduler.finish(b, FinishReason.ABORT, 0.0)  # aborted while the step ran (the simulator's case)
    assert book.advance(batch.items, failed={a}) == 0
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 0 and stats.tokens_computed == 0
    assert stats.steps == 1


def test_first_token_counts_the_prefix_hit_once_and_stops_at_max_tokens():
    finished = []
    scheduler, kv, _, stats, book = _setup(on_finish=lambda r: finished.append((r.request_id, kv.holds(r))))
    first = _request("first", 9, max_tokens=1)
    scheduler.add(first)
    _, _, stops = _run_step(scheduler, book, 1.0)
    assert stops == {"first": (FinishReason.LENGTH, None)} and finished == [("first", True)]  # KV still held
    assert first.is_finished and first.finish_reason is FinishReason.LENGTH and not kv.holds(first)
    second = _request("second", 9, max_tokens=2)  # same first 8 tokens: two cached blocks
    scheduler.add(second)
    _run_step(scheduler, book, 2.0)
    assert second.num_cached_tokens == 8 and stats.prompt_tokens_cached == 8
    _, _, stops = _run_step(scheduler, book, 3.0)  # a decode: not its first token, no double count
    assert stats.prompt_tokens_cached == 8 and stops["second"][0] is FinishReason.LENGTH
    assert stats.generation_tokens == 3


def test_stop_token_sets_stop_reason_and_eos_respects_ignore_eos():
    scheduler, _, _, _, book = _setup()
    r = Request("s", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=[9]), 0.0)
    e = Request("e", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), 0.0, RequestClass.BE, eos_token_ids={9})
    for req in (r, e):
        scheduler.add(req)
    _, _, stops = _run_step(scheduler, book, 1.0, token=9)
    assert stops == {"s": (FinishReason.STOP, 9)} and r.stop_reason == 9
    assert not e.is_finished  # EOS ignored


def test_scheduled_and_step_done_count_for_the_policy():
    scheduler, kv, policy, stats, book = _setup(num_blocks=5)  # 4 usable blocks: a preemption is coming
    for rid in ("a", "b"):
        scheduler.add(_request(rid, 7, max_tokens=8))
    _run_step(scheduler, book, 1.0)
    preempted = 0
    for t in range(2, 6):
        batch, _, _ = _run_step(scheduler, book, float(t))
        preempted += len(batch.preempted)
    assert preempted > 0 and stats.preemptions == preempted
    assert stats.schedule_calls == 5 and stats.schedule_time_s > 0
    assert policy.step_ends == [0.01] * 5 and abs(stats.step_time_s - 0.05) < 1e-12
