"""Batch jobs under faults: submitted through whichever gateway answers, then counted.

Each fault round submits one job (so every fault hits a running batch); at the end every job is
waited for and its output and error files read: an item is lost when its custom_id is in
neither, duplicated when it appears more than once, failed when it is in the error file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from loadgen.chaos.clients import Gateways, chat

FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchCount:
    batch_id: str
    status: str
    items: int
    ok: int
    failed: int
    lost: int
    duplicated: int


async def _call(gateways: Gateways, fn, what: str, budget_s: float = 120.0):
    """`fn(client, url)` against each replica in turn until one answers 2xx."""
    deadline = time.monotonic() + budget_s
    attempt = 0
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            try:
                r = await fn(client, gateways.url(attempt))
                if r.status_code < 300:
                    return r
                err = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                err = repr(exc)
            attempt += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: no gateway answered ({err})")
            await asyncio.sleep(0.3)


async def submit(gateways: Gateways, tag: str, items: int, max_tokens: int) -> tuple[str, list[str]]:
    ids = [f"{tag}-{i}" for i in range(items)]
    lines = [
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": _body(cid, max_tokens)})
        for cid in ids
    ]
    content = ("\n".join(lines) + "\n").encode()
    f = await _call(
        gateways,
        lambda c, u: c.post(f"{u}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}),
        "upload",
    )
    spec = {"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    b = await _call(gateways, lambda c, u: c.post(f"{u}/v1/batches", json=spec), "create batch")
    return b.json()["id"], ids


def _body(cid: str, max_tokens: int) -> dict:
    body = chat(f"Item {cid}: one line please.", max_tokens, False)
    body.pop("stream")
    return body


async def count(gateways: Gateways, batch_id: str, ids: list[str], deadline: float) -> BatchCount:
    """Wait (until the monotonic `deadline`, shared by all jobs) for the job to end, then count
    its items (a job not ended by then: its unfinished items count as lost)."""
    while True:
        b = (await _call(gateways, lambda c, u: c.get(f"{u}/v1/batches/{batch_id}"), "retrieve")).json()
        if b["status"] in FINAL or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    ok = await _lines(gateways, b.get("output_file_id"))
    failed = await _lines(gateways, b.get("error_file_id"))
    seen = Counter(line["custom_id"] for line in ok + failed)
    return BatchCount(
        batch_id=batch_id,
        status=b["status"],
        items=len(ids),
        ok=sum(1 for line in ok if line["response"]["status_code"] == 200),
        failed=len(failed),
        lost=sum(1 for cid in ids if cid not in seen),
        duplicated=sum(n - 1 for n in seen.values() if n > 1),
    )


async def _lines(gateways: Gateways, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    r = await _call(gateways, lambda c, u: c.get(f"{u}/v1/files/{file_id}/content"), "file content")
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]
