"""Batch input validation, window parsing, item result assembly and the store's exactly-once record."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.batch_api import parse_window
from services.queue.items import ItemRun, item_request
from services.queue.validation import validate_input
from services.scheduler.placement import LeastLoaded, PlacementLimits, WorkerLoad
from shared.batchstore.api_store import BatchAPIStore
from shared.batchstore.db import BatchDatabase
from shared.batchstore.run_store import BatchLine, BatchRunStore, Finished
from shared.openai_api.translate import ReplyTo
from shared.schemas.results import Accepted, Delta, Failed

CHAT = "/v1/chat/completions"


def _line(cid, body=None, url=CHAT) -> str:
    body = body if body is not None else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _validate(*lines: str, **kw):
    return validate_input(("\n".join(lines) + "\n").encode(), CHAT, max_lines=kw.pop("max_lines", 100), **kw)


def test_valid_lines_keep_their_numbers_and_blank_lines_are_skipped():
    v = _validate(_line("a"), "", _line("b"))
    assert v.error_count == 0 and [(x.line, x.custom_id) for x in v.lines] == [(1, "a"), (3, "b")]


@pytest.mark.parametrize(
    "bad, code, param",
    [
        ("[1, 2]", "invalid_json_line", None),
        ('{"custom_id": ', "invalid_json_line", None),
        (json.dumps({"url": CHAT, "body": {}}), "missing_required_parameter", "custom_id"),
        (_line("x", url="/v1/completions"), "invalid_url", "url"),
        (_line("x", body={"model": "m", "messages": "hi"}), "invalid_request", "body.messages"),
        (
            _line("x", body={"model": "m", "messages": [{"role": "user", "content": "a"}], "n": 2}),
            "unsupported_parameter",
            "body.n",
        ),
        (
            _line("x", body={"model": "other", "messages": [{"role": "user", "content": "a"}]}),
            "model_not_found",
            "body.model",
        ),
        (json.dumps({"custom_id": "x", "method": "GET", "url": CHAT, "body": {}}), "invalid_value", "method"),
    ],
)
def test_each_bad_line_is_reported_with_its_line_number(bad, code, param):
    v = _validate(_line("a"), bad, models={"m"})
    assert v.error_count == 1 and v.errors == [
        {"code": code, "message": v.errors[0]["message"], "param": param, "line": 2}
    ]


def test_duplicates_limits_and_error_cap():
    assert _validate(_line("a"), _line("a")).errors[0]["code"] == "duplicate_custom_id"
    assert _validate(_line("a"), _line("b"), max_lines=1).errors[0]["code"] == "too_many_lines"
    assert validate_input(b"\n\n", CHAT, max_lines=5).errors[0]["code"] == "empty_file"
    assert validate_input(b"\xff\xfe", CHAT, max_lines=5).errors[0]["code"] == "invalid_file"
    many = _validate(*["nope"] * 30, max_errors=5)
    assert many.error_count == 30 and len(many.errors) == 5 and not many.lines


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.just("ok"), st.just("dup"), st.just("junk")), min_size=1, max_size=20))
def test_an_input_is_accepted_exactly_when_every_line_is_valid(kinds):
    lines = [_line(f"id-{i}") if k == "ok" else _line("id-0") if k == "dup" else "junk" for i, k in enumerate(kinds)]
    v = _validate(*lines)
    assert (v.error_count == 0) == all(k == "ok" or (k == "dup" and i == 0) for i, k in enumerate(kinds))
    assert v.error_count + len(v.lines) == len(kinds)


def test_completion_window():
    assert parse_window("24h") == 86400 and parse_window("90s") == 90 and parse_window("30m") == 1800
    for bad in ("25h", "0s", "1d", "", "h"):
        with pytest.raises(ValueError, match="completion_window"):
            parse_window(bad)


def test_be_slots_only_where_rt_has_headroom():
    p = LeastLoaded(PlacementLimits(be_per_worker=8, kv_high_water=0.9))
    idle, rt_waiting = WorkerLoad("a"), WorkerLoad("b", waiting_rt=1)
    full_kv, draining = WorkerLoad("c", kv_usage=0.95), WorkerLoad("d", draining=True)
    assert p.be_slots([idle]) == 8 and p.be_slots([idle, WorkerLoad("e")]) == 16
    assert p.be_slots([rt_waiting, full_kv, draining]) == 0 and p.be_slots([idle, rt_waiting]) == 8


def _run(kind: str = "chat") -> ItemRun:
    body = (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        if kind == "chat"
        else {"model": "m", "prompt": "hi", "max_tokens": 5}
    )
    endpoint = CHAT if kind == "chat" else "/v1/completions"
    req = item_request(
        endpoint, body, request_id="b-1", attempt=0, reply_to=ReplyTo("queue", 3), batch_id="b", custom_id="c1"
    )
    assert req.req_class == "be" and req.reply_partition == 3 and req.metadata == {"batch_id": "b", "custom_id": "c1"}
    return ItemRun("b", "c1", req)


def test_item_assembly_applies_deltas_once_in_order_and_shapes_like_the_sync_endpoint():
    run = _run()
    run.apply(Accepted(request_id="b-1", worker_id="w", prompt_tokens=7))
    run.apply(Delta(request_id="b-1", index=0, token_ids=[1, 2], text="ab"))
    run.apply(Delta(request_id="b-1", index=0, token_ids=[1, 2], text="ab"))  # a duplicate
    run.apply(Delta(request_id="b-1", index=5, token_ids=[9], text="z"))  # out of order
    assert not run.finished
    run.apply(Delta(request_id="b-1", index=2, token_ids=[3], text="c", finish_reason="length", cached_tokens=4))
    line = run.output_line()
    body = line["response"]["body"]
    assert line["custom_id"] == "c1" and line["response"]["status_code"] == 200 and line["error"] is None
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-b-1"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    failed = _run("completion")
    failed.apply(Failed(request_id="b-1", status=400, message="prompt too long"))
    assert failed.finished and failed.output_line()["response"]["status_code"] == 400


def test_store_records_each_item_once(tmp_path):
    async def go():
        db = BatchDatabase(f"sqlite+aiosqlite:///{tmp_path / 't.db'}")
        await db.start()
        api, store = BatchAPIStore(db), BatchRunStore(db)  # the gateway's part, the queue's part
        f = await api.add_file(b"x", "in.jsonl", "batch")
        b = await api.add_batch(f.id, CHAT, "24h", 60, None)
        assert await store.start_batch(b, [BatchLine(1, "a", {}), BatchLine(2, "b", {})], ["r1", "r2"])
        claimed = await store.claim(5)
        assert [c.item.custom_id for c in claimed] == ["a", "b"] and await store.claim(5) == []
        ok = Finished(b.id, "a", 0, True, {"custom_id": "a"})
        assert await store.record([ok]) == [ok] and await store.record([ok]) == []  # once only
        assert await store.bump_attempt(b.id, "b", 0)
        assert await store.record([Finished(b.id, "b", 0, True, {})]) == []  # a stale attempt
        assert await store.requeue_in_flight() == 1 and (await store.claim(1))[0].item.attempt == 2
        row = await api.get_batch(b.id)
        assert (row.total, row.completed, row.failed) == (2, 1, 0)
        await db.close()

    asyncio.run(go())
