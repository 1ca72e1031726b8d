"""The engine thread behind `AsyncLLM`: it builds the engine, owns it, and is the only thread
that touches it.

Work comes in through one queue (`EngineThread.submit`): requests to add (tokenized here, since
this thread owns the tokenizer), aborts, and calls (`fn(engine, *args)`, for validation and
session operations). The queue is drained between steps, so a call never runs in the middle of
one. Results go back to the event loop with `call_soon_threadsafe`: one call per step for all
of that step's deltas, one per answered call. Every step ends by publishing the engine's
snapshot (`LLMEngine.snapshot`), which the event loop reads without crossing over.

The hand-off is stamped (wall-clock ns, two clock reads per request and per step): when this
thread took a request from the queue and when the engine had it queued (`Admission`), when each
step started and when it ended, its deltas posted (`StreamDelta`). The worker splits its first-token
time into these stages (issue 21: the ~4 ms hand-off had no account of where it went).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestMetrics, RequestOutput, StreamDelta
from engine.prompts import CheckedPrompt, ParamsFor, Prompt, encode_prompt, params_for
from engine.sampling import SamplingParams
from engine.scheduling import SLO, RequestClass

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5  # an idle engine still steps (and publishes a snapshot) this often


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams | ParamsFor
    req_class: RequestClass
    slo: SLO
    arrival_time: float | None
    resumed_output_ids: tuple[int, ...]
    session_id: str | None
    accepted: asyncio.Future  # -> its `Admission`, or the ValueError that refused it
    cache_salt: str | None = None  # share cached KV only with same-salt requests (per API key)


@dataclass(frozen=True)
class Admission:
    """What an accepted request's future resolves to: its prompt's token count, and when this
    thread took it from the queue and when the engine had queued it (wall-clock ns)."""

    num_prompt_tokens: int
    picked_ns: int
    queued_ns: int


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    fn: Callable[..., Any]  # fn(engine, *args), run between steps
    args: tuple
    future: asyncio.Future


Deliver = Callable[[list[StreamDelta]], None]  # runs on the event loop


class EngineThread:
    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self.config = config
        self.engine: LLMEngine | None = None
        self._loop = loop
        self._deliver = deliver
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._built: asyncio.Future | None = None  # resolved by the thread once the engine exists
        self._thread = threading.Thread(target=self._main, name="tandem-engine", daemon=True)

    async def start(self) -> LLMEngine:
        """Start the thread and return once it has built the engine (or raise why it could not)."""
        self._built = self._loop.create_future()
        self._thread.start()
        return await self._built

    def submit(self, item: AddRequest | Abort | Call) -> None:
        self._inbox.put(item)

    async def stop(self) -> None:
        """Finish the current step, close the session store (flushing its writes), end the thread."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    # -- on the engine thread ---------------------------------------------------------

    def _main(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as exc:  # noqa: BLE001 (handed to start())
            self._reply(self._built, None, exc)
            return
        self._reply(self._built, self.engine, None)
        try:
            self._run(self.engine)
        finally:
            self.engine.sessions.close()  # queued session writes reach the disk before we exit

    def _run(self, engine: LLMEngine) -> None:
        while not self._stopping.is_set():
            self._drain_inbox(block=not engine.has_unfinished())
            if self._stopping.is_set():
                break
            started_ns = time.time_ns()
            outputs = engine.step()
            if outputs:
                ended_ns = time.time_ns()
                deltas = [self._delta(out, started_ns, ended_ns) for out in outputs]
                self._loop.call_soon_threadsafe(self._deliver, deltas)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: AddRequest | Abort | Call) -> None:
        if isinstance(item, Abort):
            self.engine.abort(item.request_id)
        elif isinstance(item, Call):
            self._run_call(item)
        else:
            self._add(item)

    def _add(self, item: AddRequest) -> None:
        picked_ns = time.time_ns()
        try:
            prompt_ids = encode_prompt(self.engine.tokenizer, item.prompt)
            self.engine.add_request(
                item.request_id,
                prompt_ids,
                params_for(item.params, len(prompt_ids)),
                req_class=item.req_class,
                slo=item.slo,
                arrival_time=item.arrival_time,
                stream_text=True,
                resumed_output_ids=item.resumed_output_ids,
                session_id=item.session_id,
                cache_salt=item.cache_salt,
            )
        except ValueError as exc:
            self._reply(item.accepted, None, exc)
            return
        self._reply(item.accepted, Admission(len(prompt_ids), picked_ns, time.time_ns()), None)

    def _run_call(self, call: Call) -> None:
        try:
            result, error = call.fn(self.engine, *call.args), None
        except Exception as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            result, error = None, exc
        self._reply(call.future, result, error)

    def _delta(self, out: RequestOutput, step_started_ns: int, posted_ns: int) -> StreamDelta:
        """The event loop's copy of one output: everything it needs, read here, where the
        request and the tokenizer live."""
        texts = None
        if out.new_logprobs is not None:
            tokenizer = self.engine.tokenizer  # None for a model without one: ids only, empty texts
            texts = [tokenizer.decode([t]) if tokenizer is not None else "" for t in out.new_token_ids]
        return StreamDelta(
            out.request_id,
            out.new_text,
            list(out.new_token_ids),
            out.new_logprobs,
            out.finished,
            out.finish_reason,
            RequestMetrics.of(out.request) if out.finished else None,
            texts,
            step_started_ns,
            posted_ns,
        )

    def _reply(self, future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        self._loop.call_soon_threadsafe(_resolve, future, result, error)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def check_prompt(
    engine: LLMEngine, prompt: Prompt, params: SamplingParams | ParamsFor, resumed_output_ids: Sequence[int]
) -> CheckedPrompt:
    """Tokenize and validate a prompt without adding it (run by `AsyncLLM.check`)."""
    prompt_ids = encode_prompt(engine.tokenizer, prompt)
    resolved = params_for(params, len(prompt_ids))
    engine.validate(prompt_ids + list(resumed_output_ids), resolved)
    return CheckedPrompt(prompt_ids, resolved)
