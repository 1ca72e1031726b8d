"""Placement policy and the gateway's stream bookkeeping (pure logic, no processes)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.streams import StreamRegistry
from services.scheduler.placement import LeastLoaded, PlacementLimits, PlacementRequest, WorkerLoad, make_placement
from shared.schemas.requests import GenerateRequest
from shared.schemas.results import Accepted, Delta, Failed, Rerouted, ResultBatch

RT = PlacementRequest("r", "rt")
BE = PlacementRequest("b", "be")


def test_rt_goes_to_least_loaded_live_worker():
    p = make_placement("least-loaded")
    workers = [WorkerLoad("a", running_rt=10), WorkerLoad("b", running_rt=2), WorkerLoad("c", draining=True)]
    assert p.place(RT, workers) == "b"
    assert p.place(RT, []) is None
    assert p.place(RT, [WorkerLoad("c", draining=True)]) is None


def test_rt_keeps_the_session_holder_only_within_the_slack_of_the_least_loaded():
    p = LeastLoaded()  # holder_slack: 4 requests
    turn = PlacementRequest("r", "rt", preferred_worker="a")
    assert p.place(turn, [WorkerLoad("a", running_rt=4), WorkerLoad("b")]) == "a"  # 4 more: its KV is worth it
    assert p.place(turn, [WorkerLoad("a", running_rt=5), WorkerLoad("b")]) == "b"  # 5 more: it moves
    # not silently sticky: a holder far from full but 20 requests busier loses the turn
    assert p.place(turn, [WorkerLoad("a", running_rt=20), WorkerLoad("b")]) == "b"
    # the slack is load, so KV use and BE count too (BE at a quarter, as in the score)
    assert p.place(turn, [WorkerLoad("a", running_rt=4, kv_usage=0.1), WorkerLoad("b")]) == "b"
    assert p.place(turn, [WorkerLoad("a", running_rt=3, running_be=4), WorkerLoad("b")]) == "a"
    # a full holder loses even with nobody less loaded in reach
    assert p.place(turn, [WorkerLoad("a", running_rt=128, kv_usage=0.9), WorkerLoad("b", running_rt=127)]) == "b"
    # no slack: the holder wins exact ties only (the advisory target's rule)
    strict = LeastLoaded(PlacementLimits(holder_slack=0))
    assert strict.place(turn, [WorkerLoad("a", running_rt=1), WorkerLoad("b")]) == "b"
    assert strict.place(turn, [WorkerLoad("b"), WorkerLoad("a")]) == "a"


def test_be_only_where_rt_has_headroom():
    p = LeastLoaded(PlacementLimits(be_per_worker=4))
    assert p.place(BE, [WorkerLoad("a", waiting_rt=1)]) is None  # RT queueing: no BE
    assert p.place(BE, [WorkerLoad("a", kv_usage=0.95)]) is None  # KV nearly full
    assert p.place(BE, [WorkerLoad("a", running_be=4)]) is None  # BE cap reached
    assert p.place(BE, [WorkerLoad("a", running_rt=100)]) is None  # RT busy
    assert p.place(BE, [WorkerLoad("a", running_be=3), WorkerLoad("b", running_be=1)]) == "b"
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("nope")


def _req(attempt: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        attempt=attempt,
        gateway_id="g",
        reply_partition=0,
        model="m",
        kind="completion",
        prompt="x",
        created_at=0.0,
    )


def test_stream_applies_each_delta_once_in_order_and_resumes_with_delivered_tokens():
    resubmitted: list[GenerateRequest] = []

    async def resubmit(req):
        resubmitted.append(req)

    async def run():
        reg = StreamRegistry(resubmit)
        s = reg.open(_req())
        d0 = Delta(request_id="r", index=0, token_ids=[1, 2], text="ab")
        await reg.on_batch(
            ResultBatch(source="w", events=[Accepted(request_id="r", worker_id="w", prompt_tokens=4), d0, d0])
        )
        assert s.token_ids == [1, 2] and s.text == "ab"  # the duplicate was dropped
        await reg.on_batch(ResultBatch(source="s", events=[Rerouted(request_id="r", reason="lost")]))
        assert resubmitted[0].attempt == 1 and resubmitted[0].resume_token_ids == [1, 2]
        stale = Delta(request_id="r", attempt=0, index=2, token_ids=[9], text="Z")
        fresh = Delta(request_id="r", attempt=1, index=2, token_ids=[3], text="c", finish_reason="length")
        await reg.on_batch(ResultBatch(source="w", events=[stale, fresh]))
        assert s.token_ids == [1, 2, 3] and s.text == "abc" and s.finished and s.prompt_tokens == 4
        return [type(e).__name__ for e in _drain(s.events)]

    assert asyncio.run(run()) == ["Accepted", "Delta", "Delta"]


def _drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_delta_gap_resumes_from_the_delivered_tokens():
    """Deltas lost on their way (a broker restart loses records) leave a gap: the stream
    continues as a new attempt from what the client has, instead of waiting forever."""
    resubmitted: list[GenerateRequest] = []

    async def resubmit(req):
        resubmitted.append(req)

    async def run():
        reg = StreamRegistry(resubmit)
        s = reg.open(_req())
        await reg.on_batch(ResultBatch(source="w", events=[Delta(request_id="r", index=0, token_ids=[1], text="a")]))
        gap = Delta(request_id="r", index=3, token_ids=[4], text="d")
        after = Delta(request_id="r", index=4, token_ids=[5], text="e")
        await reg.on_batch(ResultBatch(source="w", events=[gap, after]))
        assert [r.attempt for r in resubmitted] == [1] and resubmitted[0].resume_token_ids == [1]
        assert s.token_ids == [1] and not s.finished  # nothing after the gap was applied
        cont = Delta(request_id="r", attempt=1, index=1, token_ids=[2], text="b", finish_reason="length")
        await reg.on_batch(ResultBatch(source="w", events=[cont]))
        assert s.token_ids == [1, 2] and s.text == "ab" and s.finished

    asyncio.run(run())


def test_fail_open_ends_every_unfinished_stream_once():
    async def resubmit(req):
        raise AssertionError("nothing is resubmitted")

    reg = StreamRegistry(resubmit)
    open_one, done = reg.open(_req()), reg.open(_req().model_copy(update={"request_id": "r2"}))
    done.finished = True
    ended = reg.fail_open(
        lambda s: Failed(request_id=s.request.request_id, status=503, code="broker_restarted", message="x")
    )
    assert ended == ["r"] and open_one.finished
    (event,) = _drain(open_one.events)
    assert (event.status, event.code) == (503, "broker_restarted")
    assert _drain(done.events) == [] and reg.fail_open(lambda s: None) == []
