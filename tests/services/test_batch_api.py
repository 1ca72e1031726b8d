"""Batch jobs through the real stack and the official `openai` client: gateway (Files/Batches API)
→ database → queue service → Kafka → scheduler → workers → queue service → database."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.services.conftest import chat_body, openai_client, worker_heartbeat

pytestmark = pytest.mark.timeout(600)
BE_PER_WORKER = 8
# The queue service's safety poll, set past any test's length: every step of a job (validation,
# release, cancel, expiry, finalisation) must then be started by its event or deadline
# (services/queue/wakeup.py); a step that waited for the poll would hang its test.
IDLE_TICK_S = 3600


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(
        TANDEM_BE_PER_WORKER=BE_PER_WORKER,
        TANDEM_MAX_BATCH_LINES=300,
        TANDEM_MAX_FILE_BYTES=200_000,
        TANDEM_IDLE_TICK_S=IDLE_TICK_S,
    )
    return s.start(("w0", "w1"), queue=True)


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


def _db(stack) -> Path:
    return stack.log_dir / "data" / "tandem.db"


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def chat_lines(n: int, max_tokens: int = 8, prefix: str = "item") -> list[dict]:
    return [
        line(
            f"{prefix}-{i}",
            chat_body(f"{prefix} number {i}: tell me something", max_tokens=max_tokens, ignore_eos=True),
        )
        for i in range(n)
    ]


def submit(client, lines: list, endpoint: str = "/v1/chat/completions", window: str = "24h"):
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)


FINAL = ("completed", "failed", "expired", "cancelled")


def wait_final(client, batch_id: str, stack) -> object:
    """The batch once it reached a final status. Fails at once when a child of the stack died;
    the only cut-off is the stack's safety net: on a busy machine every step of a job is slower,
    and nothing here is a speed check."""
    latest = {}

    def final() -> bool:
        latest["batch"] = client.batches.retrieve(batch_id)
        return latest["batch"].status in FINAL

    stack.wait_until(f"batch {batch_id} final", final)
    return latest["batch"]


def wait_until(client, batch_id: str, done: int, stack) -> object:
    """The batch once at least `done` of its items completed (same waiting as `wait_final`)."""
    latest = {}

    def enough() -> bool:
        latest["batch"] = client.batches.retrieve(batch_id)
        return latest["batch"].request_counts.completed >= done

    stack.wait_until(f"batch {batch_id}: {done} items done", enough)
    return latest["batch"]


def read_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def comparable(body: dict) -> dict:
    """A response body without what differs between two runs of one request (ids, time, prefix-cache hits)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return out


class InFlightProbe:
    """Polls the database: the most items the queue service ever had in flight at once."""

    def __init__(self, db: Path) -> None:
        self.db, self.peak, self._stop = db, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        while not self._stop.is_set():
            n = conn.execute("SELECT count(*) FROM tandem_batch_items WHERE status = 'in_flight'").fetchone()[0]
            self.peak = max(self.peak, n)
            time.sleep(0.02)
        conn.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def attempts(stack, batch_id: str) -> dict[str, int]:
    with sqlite3.connect(_db(stack)) as conn:
        return dict(conn.execute("SELECT custom_id, attempt FROM tandem_batch_items WHERE batch_id = ?", (batch_id,)))


def in_flight(stack, batch_id: str) -> int:
    with sqlite3.connect(_db(stack)) as conn:
        return conn.execute(
            "SELECT COUNT(*) FROM tandem_batch_items WHERE batch_id = ? AND status = 'in_flight'", (batch_id,)
        ).fetchone()[0]


def test_200_line_job_completes_under_flow_control_with_bodies_equal_to_sync(stack, client):
    lines = chat_lines(200)
    with InFlightProbe(_db(stack)) as probe:
        batch = submit(client, lines)
        assert batch.status == "validating" and batch.request_counts.total == 0
        done = wait_final(client, batch.id, stack)
    assert done.status == "completed", done
    assert done.request_counts.total == 200 and done.request_counts.completed == 200
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at > done.created_at
    out = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(ln["custom_id"] for ln in lines)  # one line per input
    # The queue kept at most what the scheduler published as BE capacity (2 workers x 8) in flight.
    assert 1 <= probe.peak <= 2 * BE_PER_WORKER
    by_id = {o["custom_id"]: o for o in out}
    for ln in lines[:8]:  # greedy: the same body as the synchronous endpoint's, but for id and created
        sync = httpx.post(f"{stack.url}/v1/chat/completions", json=ln["body"], timeout=60).json()
        resp = by_id[ln["custom_id"]]["response"]
        assert resp["status_code"] == 200
        assert comparable(resp["body"]) == comparable(sync)
        assert resp["body"]["usage"]["completion_tokens"] == 8


def test_every_validation_failure_fails_the_batch_with_line_numbers_and_runs_nothing(stack, client):
    lines = [
        line("ok-1", chat_body("fine")),
        "{not json",
        {"method": "POST", "url": "/v1/chat/completions", "body": chat_body("no id")},
        line("ok-1", chat_body("same id again")),
        line("wrong-url", {"model": "tiny", "prompt": "x"}, url="/v1/completions"),
        line("bad-body", {"model": "tiny", "messages": [], "max_tokens": 4}),
        line("bad-tokens", chat_body("x", max_tokens=-3)),
        line("unknown-model", {**chat_body("x"), "model": "nope"}),
        line("streaming", chat_body("x", stream=True)),
    ]
    done = wait_final(client, submit(client, lines).id, stack)
    assert done.status == "failed" and done.failed_at
    errors = [(e.line, e.code) for e in done.errors.data]
    assert errors == [
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
        (4, "duplicate_custom_id"),
        (5, "invalid_url"),
        (6, "invalid_request"),
        (7, "invalid_request"),
        (8, "model_not_found"),
        (9, "invalid_request"),
    ]
    assert "messages" in done.errors.data[4].message and done.errors.data[5].param == "body.max_tokens"
    assert done.request_counts.total == 0 and done.output_file_id is None
    with sqlite3.connect(_db(stack)) as conn:  # nothing was expanded, so nothing can have run
        assert conn.execute("SELECT count(*) FROM tandem_batch_items WHERE batch_id = ?", (done.id,)).fetchone()[0] == 0


def test_size_and_line_limits_and_bad_requests(stack, client):
    too_many = wait_final(client, submit(client, chat_lines(301)).id, stack)  # TANDEM_MAX_BATCH_LINES=300
    assert too_many.status == "failed" and too_many.errors.data[0].code == "too_many_lines"
    assert "at most 300" in too_many.errors.data[0].message
    with pytest.raises(openai.APIStatusError) as e:  # TANDEM_MAX_FILE_BYTES=200000
        client.files.create(file=("big.jsonl", b"x" * 250_000), purpose="batch")
    assert e.value.status_code == 413 and "200000" in e.value.message
    f = client.files.create(file=("in.jsonl", jsonl(chat_lines(2))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="48h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-missing")
    r = httpx.post(
        f"{stack.url}/v1/files", data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", b"{}")}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"


def test_files_api_and_batch_list_pagination(stack, client):
    content = jsonl(chat_lines(3, prefix="files"))
    f = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert f.object == "file" and f.bytes == len(content) and f.filename == "mine.jsonl" and f.purpose == "batch"
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == content
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    ids = [
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"n": str(i)}
        ).id
        for i in range(3)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more  # newest first
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0] and rest.data[0].metadata == {"n": "0"}
    assert [b.id for b in client.batches.list(limit=100).data][:3] == ids[::-1]  # auto-pagination agrees
    for b in ids:
        assert wait_final(client, b, stack).status == "completed"
    with pytest.raises(openai.APIStatusError) as e:
        client.batches.cancel(ids[0])
    assert e.value.status_code == 409
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def _running_batch_items(stack, prefix: str) -> set[str]:
    """Batch item ids the workers say they hold right now (from their heartbeats, via the broker)."""
    import asyncio

    running = set()
    for w in ("w0", "w1"):
        hb = asyncio.run(worker_heartbeat(stack, w))
        running |= {k for k in hb.running_ids if k.startswith(prefix)}
    return running


def test_cancel_stops_releasing_and_ends_in_flight_items(stack, client):
    lines = chat_lines(60, max_tokens=300, prefix="cancel")
    batch = submit(client, lines)
    wait_until(client, batch.id, 1, stack)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_final(client, batch.id, stack)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    c = done.request_counts
    assert c.total == 60 and 1 <= c.completed < 60 and c.completed + c.failed == 60
    out, err = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert len(out) == c.completed and len(err) == 60 - c.completed
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert {o["custom_id"] for o in out} | {e["custom_id"] for e in err} == {ln["custom_id"] for ln in lines}
    # In-flight items are ended on their workers (their KV freed): their heartbeats stop listing them.
    stack.wait_until("cancelled items gone from the workers", lambda: not _running_batch_items(stack, batch.id))
    assert client.batches.cancel(done.id).status == "cancelled"  # cancelling again changes nothing


def test_expiry_keeps_what_finished(stack, client):
    lines = chat_lines(4, max_tokens=4, prefix="exp-short") + chat_lines(60, max_tokens=400, prefix="exp-long")
    batch = submit(client, lines, window="4s")
    done = wait_final(client, batch.id, stack)
    assert done.status == "expired" and done.expired_at and done.expires_at == done.created_at + 4
    c = done.request_counts
    assert 4 <= c.completed < 64 and c.completed + c.failed == 64
    out, err = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert {o["custom_id"] for o in out} >= {f"exp-short-{i}" for i in range(4)}
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert len(err) == 64 - c.completed and {e["error"]["code"] for e in err} == {"batch_expired"}
