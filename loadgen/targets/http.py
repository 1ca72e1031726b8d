"""The live gateway as a target: OpenAI-compatible streaming requests over HTTP (httpx).

Every request streams (`stream: true`, `stream_options.include_usage`), and each SSE chunk
that carries generated text is timestamped on arrival: the client-side token timeline,
transport included. RT/BE is sent as `X-Tandem-Class`, SLOs in the `tandem` extension field
(`ttft_ms`, `tpot_ms`), sessions as `X-Session-Id` with the conversation resent as chat
messages. Typing hints go to `POST /v1/sessions/{id}/typing` when a user starts typing; a
gateway without that endpoint (404) is tolerated and counted. Prompts are built from a
fixed list of common words (about one token each) to the spec's length.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from loadgen.driver import RunResult
from loadgen.metrics import RequestRecord
from loadgen.workloads.build import Workload
from loadgen.workloads.sources import Source
from loadgen.workloads.spec import RequestSpec, Submission

WORDS = (
    "the of and to in is was for on are with as at be this have from or by one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just "
    "where most know"
).split()


def prompt_text(spec: RequestSpec, seed: int) -> str:
    """About `spec.prompt_len` tokens of plain words, deterministic per request id."""
    if spec.prompt_text is not None:
        return spec.prompt_text
    rng = np.random.default_rng([seed, 3, zlib.crc32(spec.request_id.encode())])
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=spec.prompt_len))


@dataclass
class StreamResult:
    token_times: list[float] = field(default_factory=list)  # perf_counter per content chunk
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    worker: str | None = None


def parse_sse_line(line: str) -> dict | None | str:
    """One SSE line: the JSON object of a `data:` line, "[DONE]", or None for anything else."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return "[DONE]"
    return json.loads(payload) if payload else None


def apply_chunk(result: StreamResult, chunk: dict, now: float) -> None:
    """Fold one streamed chunk into `result`, timestamping chunks that carry a new token."""
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for choice in chunk.get("choices") or []:
        # the gateway sends one chunk per engine delta (one token per step): every chunk but the
        # chat role chunk carries a token, even when its text is held back ({} delta)
        if "delta" in choice:
            delta = choice.get("delta") or {}
            if "role" in delta:
                continue
            piece = delta.get("content") or ""
        elif "text" in choice:
            piece = choice.get("text") or ""
        else:
            continue
        result.token_times.append(now)
        result.text += piece
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


class HttpClient:
    def __init__(self, base_url: str, model: str | None = None, send_session_ids: bool = True) -> None:
        """`send_session_ids=False` still resends each session's history, but anonymously: the
        server cannot tie turns together (the recompute-every-turn baseline)."""
        import httpx

        self.send_session_ids = send_session_ids
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(600.0, connect=10.0))
        self.model = model
        self.typing_unsupported = 0

    async def resolve_model(self) -> str:
        if self.model is None:
            r = await self.client.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            if not data:
                raise ValueError(f"{self.base_url} serves no models")
            self.model = data[0]["id"]
        return self.model

    def body(self, spec: RequestSpec, messages: list[dict] | None, seed: int) -> tuple[str, dict, dict]:
        body = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.slo.ttft_s is not None or spec.slo.tpot_s is not None:
            body["tandem"] = {
                k: v * 1e3 for k, v in (("ttft_ms", spec.slo.ttft_s), ("tpot_ms", spec.slo.tpot_s)) if v is not None
            }
        headers = {"X-Tandem-Class": spec.req_class}
        if spec.session_id and self.send_session_ids:
            headers["X-Session-Id"] = spec.session_id
        if spec.prompt_text is not None and messages is None:
            return "/v1/completions", {**body, "prompt": spec.prompt_text}, headers
        return "/v1/chat/completions", {**body, "messages": messages}, headers

    async def stream(self, path: str, body: dict, headers: dict) -> StreamResult:
        res = StreamResult()
        async with self.client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {r.status_code}: {detail}")
            res.worker = r.headers.get("x-tandem-worker") or None
            async for line in r.aiter_lines():
                item = parse_sse_line(line)
                if item == "[DONE]":
                    break
                if isinstance(item, dict):
                    apply_chunk(res, item, time.perf_counter())
        return res

    async def typing(self, session_id: str, expected_arrival_s: float | None = None) -> None:
        """A typing hint; `expected_arrival_s`: in how many seconds the turn will be sent (the
        gateway takes 0..3600), or None to let the placement last its TTL from now."""
        body = {} if expected_arrival_s is None else {"expected_arrival_s": min(3600.0, max(0.0, expected_arrival_s))}
        try:
            r = await self.client.post(f"/v1/sessions/{session_id}/typing", json=body)
            if r.status_code == 404:
                self.typing_unsupported += 1
        except Exception:  # noqa: BLE001 (a hint is advisory: never fail a run for it)
            self.typing_unsupported += 1

    async def submit_batch(self, specs: list[RequestSpec], seed: int) -> str | None:
        """BE through the batch API (`/v1/files` + `/v1/batches`); None when the gateway lacks it."""
        lines = [
            json.dumps(
                {
                    "custom_id": s.request_id,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": self.model,
                        "max_tokens": s.max_tokens,
                        "ignore_eos": True,
                        "messages": [{"role": "user", "content": prompt_text(s, seed)}],
                    },
                }
            )
            for s in specs
        ]
        files = {"file": ("batch.jsonl", "\n".join(lines).encode(), "application/jsonl")}
        r = await self.client.post("/v1/files", files=files, data={"purpose": "batch"})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        b = await self.client.post(
            "/v1/batches",
            json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        if b.status_code == 404:
            return None
        b.raise_for_status()
        return b.json()["id"]

    async def wait_batch(self, batch_id: str, poll_s: float = 1.0) -> str:
        while True:
            r = await self.client.get(f"/v1/batches/{batch_id}")
            r.raise_for_status()
            status = r.json().get("status")
            if status in ("completed", "failed", "expired", "cancelled"):
                return status
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        await self.client.aclose()


class HttpRun:
    """The asyncio counterpart of `loadgen.driver.Driver` for a live gateway."""

    def __init__(
        self,
        client: HttpClient,
        workload: Workload,
        seed: int,
        drain_timeout_s: float | None,
        progress: bool,
        be_via_batch_api: bool = False,
        send_hints: bool = True,
        hint_arrival: bool = False,
    ) -> None:
        """`hint_arrival`: each typing hint carries the time until its turn (the user's typing
        time, which a front-end estimates from the typing speed and the loadgen knows), so the
        advisory's placement lasts until the turn plus its TTL; without it the TTL runs from the
        hint (`tandem bench sessions --hint-arrival`, docs/sessions.md)."""
        self.be_via_batch_api, self.send_hints, self.hint_arrival = be_via_batch_api, send_hints, hint_arrival
        self.client, self.workload, self.seed = client, workload, seed
        self.duration_s = workload.config.duration_s
        self.drain_timeout_s = max(30.0, self.duration_s) if drain_timeout_s is None else drain_timeout_s
        self.progress = progress
        self.records: dict[str, RequestRecord] = {}
        self.messages: dict[str, list[dict]] = {}  # session id -> conversation so far
        self.tasks: dict[str, asyncio.Task] = {}
        self.task_class: dict[str, str] = {}
        self._due: list[tuple[float, int, Submission, Source | None]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self.hints = 0

    async def run(self) -> RunResult:
        await self.client.resolve_model()
        self.t0 = time.perf_counter()
        for sub in self.workload.open_loop:
            self._push(sub, None)
        for src in self.workload.sources:
            for sub in src.start():
                self._push(sub, src)
        await self._submit_until_window_ends()
        await self._drain()
        elapsed = self.now()
        return RunResult(
            list(self.records.values()),
            elapsed,
            [],
            self.hints,
            {
                "target": self.client.base_url,
                "model": self.client.model,
                "typing_hints_unsupported": self.client.typing_unsupported,
            },
        )

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _submit_until_window_ends(self) -> None:
        while self.now() < self.duration_s and (self._due or self.tasks):
            if not self._due or self._due[0][0] > self.now():
                wait = min(self._due[0][0] if self._due else self.duration_s, self.duration_s) - self.now()
                self._wake.clear()
                try:
                    async with asyncio.timeout(max(0.0, wait)):  # not wait_for: see shared/aio.py
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            at, _, sub, src = heapq.heappop(self._due)
            if sub.at_s >= self.duration_s:
                continue
            self.task_class[sub.spec.request_id] = sub.spec.req_class
            if self.be_via_batch_api and sub.spec.req_class == "be":
                group = [sub] + self._pop_same_time_be(at)
                self.tasks[sub.spec.request_id] = asyncio.create_task(self._batch(group, src))
            else:
                self.tasks[sub.spec.request_id] = asyncio.create_task(self._one(sub, src))

    async def _drain(self) -> None:
        rt = [t for rid, t in self.tasks.items() if self.task_class.get(rid) == "rt"]
        if rt:
            await asyncio.wait(rt, timeout=self.drain_timeout_s)
        for task in list(self.tasks.values()):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=10)

    def _push(self, sub: Submission, src: Source | None) -> None:
        heapq.heappush(self._due, (sub.at_s, next(self._seq), sub, src))
        if sub.typing_at_s is not None and sub.spec.session_id and self.send_hints:
            ahead = max(0.0, sub.at_s - sub.typing_at_s) if self.hint_arrival else None
            asyncio.get_running_loop().call_later(
                max(0.0, sub.typing_at_s - self.now()), self._hint, sub.spec.session_id, ahead
            )
        self._wake.set()

    def _hint(self, session_id: str, expected_arrival_s: float | None = None) -> None:
        if self.now() < self.duration_s:
            self.hints += 1
            asyncio.ensure_future(self.client.typing(session_id, expected_arrival_s))

    async def _one(self, sub: Submission, src: Source | None) -> None:
        spec = sub.spec
        rec = RequestRecord(
            spec.request_id,
            spec.req_class,
            sub.at_s,
            spec.prompt_len,
            spec.max_tokens,
            spec.slo.ttft_s,
            spec.slo.tpot_s,
            spec.session_id,
            turn=spec.turn,
        )
        self.records[spec.request_id] = rec
        messages = self._messages(spec)
        path, body, headers = self.client.body(spec, messages, self.seed)
        try:
            res = await self.client.stream(path, body, headers)
            rec.token_times_s = [t - self.t0 for t in res.token_times]
            rec.finish_s, rec.finish_reason, rec.worker = self.now(), res.finish_reason or "length", res.worker
            rec.usage_prompt_tokens, rec.cached_tokens = res.prompt_tokens, res.cached_tokens
            if spec.session_id and messages is not None:
                self.messages[spec.session_id] = messages + [{"role": "assistant", "content": res.text}]
        except asyncio.CancelledError:
            rec.finish_s, rec.finish_reason = self.now(), "abort"
            raise
        except Exception as exc:  # noqa: BLE001 (a failed request is a data point, not a crash)
            rec.finish_s, rec.finish_reason, rec.error = self.now(), "error", str(exc)[:300]
        finally:
            self.tasks.pop(spec.request_id, None)
            self._wake.set()  # the submit loop ends once nothing is due or in flight
        if src is not None and rec.finish_reason not in ("abort",):
            for nxt in src.on_finish(spec, rec.finish_s, rec.output_tokens):
                self._push(nxt, src)

    def _pop_same_time_be(self, at: float) -> list[Submission]:
        out = []
        while self._due and self._due[0][0] == at and self._due[0][2].spec.req_class == "be":
            out.append(heapq.heappop(self._due)[2])
        return out

    async def _batch(self, group: list[Submission], src: Source | None) -> None:
        """A BE batch through the batch API; falls back to streaming when the gateway lacks it.
        Batch requests have no token timeline: only their completion time is recorded."""
        try:
            batch_id = await self.client.submit_batch([s.spec for s in group], self.seed)
        except Exception:  # noqa: BLE001 (no batch API there, or it failed: stream these instead)
            batch_id = None
        if batch_id is None:
            self.be_via_batch_api = False
            self.tasks.pop(group[0].spec.request_id, None)
            for sub in group:
                self.tasks[sub.spec.request_id] = asyncio.create_task(self._one(sub, src))
            return
        recs = [RequestRecord(s.spec.request_id, "be", s.at_s, s.spec.prompt_len, s.spec.max_tokens) for s in group]
        for r in recs:
            self.records[r.request_id] = r
        try:
            status = await self.client.wait_batch(batch_id)
        finally:
            self.tasks.pop(group[0].spec.request_id, None)
            self._wake.set()
        for sub, rec in zip(group, recs):
            rec.finish_s, rec.finish_reason = self.now(), "length" if status == "completed" else status
            if src is not None:
                for nxt in src.on_finish(sub.spec, rec.finish_s, sub.spec.max_tokens):
                    self._push(nxt, src)

    def _messages(self, spec: RequestSpec) -> list[dict] | None:
        if spec.messages is not None:
            return list(spec.messages)
        if spec.prompt_text is not None and not spec.session_id:
            return None
        history = self.messages.get(spec.session_id, []) if spec.session_id else []
        return history + [{"role": "user", "content": prompt_text(spec, self.seed)}]


def run_http(url: str, workload: Workload, args, progress: bool = False) -> RunResult:
    async def main() -> RunResult:
        client = HttpClient(url, getattr(args, "served_model", None))
        try:
            return await HttpRun(
                client,
                workload,
                workload.config.seed,
                getattr(args, "drain_timeout", None),
                progress,
                getattr(args, "be_via", "stream") == "batch-api",
            ).run()
        finally:
            await client.close()

    return asyncio.run(main())
