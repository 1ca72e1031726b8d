"""Batch jobs through the real stack and the official `openai` client: gateway (Files/Batches API)
→ database → queue service → Kafka → scheduler → workers → queue service → database."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.services.conftest import chat_body

pytestmark = pytest.mark.timeout(600)
BE_PER_WORKER = 8


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(TANDEM_BE_PER_WORKER=BE_PER_WORKER, TANDEM_MAX_BATCH_LINES=300, TANDEM_MAX_FILE_BYTES=200_000)
    s.scheduler()
    s.worker("w0")
    s.worker("w1")
    s.gateway()
    s.queue()
    s.wait_workers(2)
    return s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def _db(stack) -> Path:
    return stack.log_dir / "data" / "tandem.db"


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def chat_lines(n: int, max_tokens: int = 8, prefix: str = "item") -> list[dict]:
    return [line(f"{prefix}-{i}", chat_body(f"{prefix} number {i}: tell me something", max_tokens=max_tokens,
                                            ignore_eos=True)) for i in range(n)]


def submit(client, lines: list, endpoint: str = "/v1/chat/completions", window: str = "24h"):
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)


def wait_final(client, batch_id: str, timeout: float = 240, stack=None) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        if stack is not None:
            stack.check_alive()
        time.sleep(0.3)
    raise TimeoutError(f"batch {batch_id} not final: {b}\n{stack.logs() if stack else ''}")


def wait_until(client, batch_id: str, done: int, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.request_counts.completed >= done:
            return b
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id}: fewer than {done} done")


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


def test_200_line_job_completes_under_flow_control_with_bodies_equal_to_sync(stack, client):
    lines = chat_lines(200)
    with InFlightProbe(_db(stack)) as probe:
        batch = submit(client, lines)
        assert batch.status == "validating" and batch.request_counts.total == 0
        done = wait_final(client, batch.id, stack=stack)
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
