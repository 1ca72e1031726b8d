"""The traffic `tandem chaos` keeps up while it kills services, and how each request is judged.

RT: a few clients, each streaming greedy chat completions one after another. A request that
fails (connection refused or reset, a 5xx, an error inside the stream) is sent again from the
start to the other gateway replica, as a client library with two endpoints would, until it
succeeds or `retry_budget_s` has passed (then it is lost). A successful answer's text must equal
the reference (the same prompt answered before any fault; greedy tokens are deterministic):
anything else is a stream gap or repeat. Probes measure recovery: after a kill, small requests
one after another until the first succeeds. Batch: jobs through the OpenAI batch API, whose
outputs are checked for every custom_id exactly once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import httpx

MODEL = "chaos"
PROMPTS = (
    "Tell me about the sea.",
    "Write a line about mountains.",
    "Describe a quiet morning.",
    "Say something about trains.",
)


def chat(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass
class RTRecord:
    prompt: int
    started: float
    finished: float = 0.0
    attempts: int = 0
    outcome: str = "lost"  # ok | mismatch | lost
    errors: list[str] = field(default_factory=list)


class Gateways:
    """The replicas' URLs; a failed attempt moves a client to the next one."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def url(self, attempt: int, preferred: int = 0) -> str:
        return self.urls[(preferred + attempt) % len(self.urls)]


async def stream_text(client: httpx.AsyncClient, url: str, body: dict) -> str:
    """One streamed attempt's text; raises on any failure (HTTP error, error event, cut-off)."""
    text, finished = [], False
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"in-band error {chunk['error'].get('code')}")
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
                finished = finished or choice.get("finish_reason") is not None
    if not finished:
        raise RuntimeError("stream ended without a finish reason")
    return "".join(text)


async def complete_text(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> str:
    r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}")
    return r.json()["choices"][0]["message"]["content"]


async def with_retries(
    client: httpx.AsyncClient, gateways: Gateways, body: dict, record: RTRecord, budget_s: float, preferred: int
) -> str | None:
    """The text of the first attempt that succeeds, or None once the budget is spent."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        url = gateways.url(record.attempts, preferred)
        record.attempts += 1
        try:
            return await stream_text(client, url, body)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            record.errors.append(f"{url}: {type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(0.2)
    return None


async def rt_client(
    index: int,
    gateways: Gateways,
    references: list[str],
    max_tokens: int,
    budget_s: float,
    stop: asyncio.Event,
    records: list[RTRecord],
) -> None:
    """Stream requests back to back until `stop`; each one judged against its reference."""
    timeout = httpx.Timeout(budget_s, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        n = 0
        while not stop.is_set():
            k = (index + n) % len(PROMPTS)
            n += 1
            record = RTRecord(prompt=k, started=time.time())
            records.append(record)
            text = await with_retries(client, gateways, chat(PROMPTS[k], max_tokens, True), record, budget_s, index)
            record.finished = time.time()
            if text is not None:
                record.outcome = "ok" if text == references[k] else "mismatch"


async def references(gateways: Gateways, max_tokens: int, budget_s: float = 600.0) -> list[str]:
    """Each prompt's greedy answer from the undisturbed stack. A failed attempt (a 503 from a
    stack that is ready but starved: at load 40 a reference request waited out the gateway's
    60 s first-event timeout and ended a `--ha` run before its first fault) is sent again, to
    each replica in turn, within `budget_s` per prompt."""
    async with httpx.AsyncClient(timeout=300) as client:
        out = []
        for p in PROMPTS:
            deadline, n = time.monotonic() + budget_s, 0
            while True:
                try:
                    out.append(await complete_text(client, gateways.url(n), chat(p, max_tokens, False)))
                    break
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError):
                    n += 1
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)
        return out


@dataclass
class ProbeAttempt:
    """One recovery probe request: which gateway, under which request id (the services log it, at
    INFO for a minute after a broker restart), when it was sent after the kill, how long it took
    and how it failed. A long recovery is then traced to the request that waited."""

    request_id: str
    gateway: str
    sent_s: float  # after the kill
    took_s: float
    error: str | None = None


async def recovery_s(
    gateways: Gateways, since: float, timeout_s: float, attempts: list[ProbeAttempt] | None = None, tag: str = ""
) -> float | None:
    """Seconds from `since` (the kill) until a small request, sent one after another to each
    replica in turn, first succeeds; None if none did within `timeout_s`. Each request is
    appended to `attempts` (its id: `<tag>-<n>`; request ids must be unique: the scheduler takes
    a known one for a redelivery)."""
    attempts = [] if attempts is None else attempts
    tag = tag or f"probe-{uuid.uuid4().hex[:12]}"
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=2.0)) as client:
        n = 0
        while time.time() - since < timeout_s:
            url, rid, sent = gateways.url(n), f"{tag}-{n}", time.time()
            n += 1
            try:
                await complete_text(client, url, chat(PROMPTS[0], 2, False), {"X-Request-Id": rid})
                attempts.append(ProbeAttempt(rid, url, sent - since, time.time() - sent))
                return time.time() - since
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:120]
                attempts.append(ProbeAttempt(rid, url, sent - since, time.time() - sent, error))
                await asyncio.sleep(0.1)
    return None
