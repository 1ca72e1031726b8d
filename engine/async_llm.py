"""Asyncio API: `add_request`/`generate` give an async stream of token deltas; `abort` cancels.

The engine runs in one background thread (model steps are long, GIL-releasing tensor ops);
the event loop only moves messages. Requests and aborts cross into the thread through a
queue; each step's outputs cross back in one `call_soon_threadsafe` call, not one per token.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import apply_chat_template
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling import SamplingParams
from engine.scheduling import SLO, RequestClass


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics | None  # set on the final delta


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    req_class: RequestClass
    slo: SLO
    arrival_time: float | None
    resumed_output_ids: list[int]
    session_id: str | None = None
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple
    future: asyncio.Future


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.engine: LLMEngine | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine = await self._loop.run_in_executor(None, LLMEngine, self.config)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self.engine is not None:  # flush queued session writes so a restart finds them
            await asyncio.get_running_loop().run_in_executor(None, self.engine.sessions.close)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.engine.tokenizer, messages)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        req_class: RequestClass = RequestClass.RT,
        slo: SLO = SLO(),
        arrival_time: float | None = None,
        resumed_output_ids: list[int] | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream deltas until the request finishes. Leaving the loop early aborts the request.

        `session_id`: a turn of that session (its kept KV is reused and the grown KV kept).
        `cache_salt`: share cached KV only with requests of the same salt (per API key).
        """
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._inbox.put(
            _Add(
                request_id,
                list(prompt_token_ids),
                params,
                req_class,
                slo,
                arrival_time,
                list(resumed_output_ids or ()),
                session_id,
                cache_salt,
            )
        )
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(engine, *args)` in the engine thread, between steps, and return its result
        (or raise its exception): how services reach `engine.sessions` safely."""
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(fn, args, future))
        return await future

    # -- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._drain_inbox(block=not engine.has_unfinished())
            if self._stopping.is_set():
                break
            outputs = engine.step()
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if isinstance(item, _Abort):
            self.engine.abort(item.request_id)
            return
        if isinstance(item, _Call):
            self._run_call(item)
            return
        try:
            self.engine.add_request(
                item.request_id,
                item.prompt_token_ids,
                item.params,
                req_class=item.req_class,
                slo=item.slo,
                arrival_time=item.arrival_time,
                stream_text=True,
                resumed_output_ids=item.resumed_output_ids,
                session_id=item.session_id,
                cache_salt=item.cache_salt,
            )
        except ValueError as exc:
            self._loop.call_soon_threadsafe(self._fail, item.request_id, exc)

    def _run_call(self, call: _Call) -> None:
        try:
            result, error = call.fn(self.engine, *call.args), None
        except Exception as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            result, error = None, exc
        self._loop.call_soon_threadsafe(_resolve, call.future, result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            metrics = RequestMetrics.of(out.request) if out.finished else None
            stream.put_nowait(
                StreamDelta(
                    out.request_id,
                    out.new_text,
                    out.new_token_ids,
                    out.new_logprobs,
                    out.finished,
                    out.finish_reason,
                    metrics,
                )
            )

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
