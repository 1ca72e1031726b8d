"""Asyncio API, and the only way into a running engine from another thread.

The engine runs in one background thread (`engine_thread.py`: model steps are long,
GIL-releasing tensor ops); the event loop only moves messages. Everything a service needs goes
through `AsyncLLM`'s methods, each run where it is safe:

- requests: `add_request` (tokenized, validated and queued on the engine thread; answers with
  the prompt's token count, or the ValueError that refused it) and its `RequestStream`, or
  `generate`; `abort`;
- `check` (tokenize and validate without adding) and `encode`, on the engine thread;
- `sessions` (`session_door.py`): the session store's operations;
- `info` (facts fixed at start) and `snapshot()` (the engine's load as of its last step), which
  the engine thread publishes as immutable values: reading them never touches engine state.

The tokenizer belongs to the engine thread. Detokenization has to run there: stop strings
end a request inside the step that produced them, before the engine computes another token,
and incremental detokenization runs on every token. Hugging Face fast tokenizers are not
safe to call from two threads at once (the Rust side refuses a second borrow mid-call, or
worse), so tokenizing incoming prompts goes to the engine thread too, folded into the request's
one crossing (`add_request`): a prompt costs one hop, as it did when the event loop tokenized.
The event loop never holds the tokenizer; each delta carries its token texts when logprobs
were asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.engine_thread import Abort, AddRequest, Admission, Call, EngineThread, check_prompt
from engine.outputs import StreamDelta
from engine.prompts import CheckedPrompt, ParamsFor, Prompt, encode_prompt
from engine.sampling import SamplingParams
from engine.scheduling import SLO, RequestClass
from engine.session_door import SessionDoor
from engine.snapshot import EngineInfo, EngineSnapshot

__all__ = ["AsyncLLM", "RequestStream", "StreamDelta"]


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.info: EngineInfo | None = None  # set by start()
        # The engine thread's engine, for in-process tests and tools that know the thread rules;
        # services go through the methods below.
        self.engine: LLMEngine | None = None
        self.sessions = SessionDoor(self.call, lambda: self.engine.sessions)
        self._thread: EngineThread | None = None
        self._streams: dict[str, asyncio.Queue] = {}

    async def start(self) -> None:
        """Start the engine thread and wait until it has built the engine (raises why not)."""
        self._thread = EngineThread(self.config, asyncio.get_running_loop(), self._deliver)
        self.engine = await self._thread.start()
        self.info = self.engine.info

    async def shutdown(self) -> None:
        """Stop the engine thread; queued session writes are flushed first, so a restart finds them."""
        if self._thread is not None:
            await self._thread.stop()

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of the end of its last step (or its last idle wake-up, at
        most 0.5 s ago): immutable, safe to keep and read from any thread."""
        return self.engine.snapshot  # one reference read: the engine thread replaces, never mutates

    # -- requests ------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | ParamsFor,
        *,
        req_class: RequestClass = RequestClass.RT,
        slo: SLO = SLO(),
        arrival_time: float | None = None,
        resumed_output_ids: Sequence[int] = (),
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it, with its stream of deltas.
        Raises ValueError for a request the engine can never serve (nothing is left behind).

        `prompt`: token ids, or a `TextPrompt` / `ChatPrompt` that the engine thread tokenizes.
        `params`: `SamplingParams`, or a function of the prompt's token count that returns
        them (or raises ValueError), for callers whose limits depend on the prompt's length.
        `session_id`: a turn of that session (its kept KV is reused and the grown KV kept).
        `resumed_output_ids`: tokens an earlier attempt already delivered (`LLMEngine.add_request`).
        `cache_salt`: share cached KV only with requests of the same salt (per API key).
        """
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        deltas: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = deltas
        accepted = asyncio.get_running_loop().create_future()
        self._thread.submit(
            AddRequest(
                request_id,
                prompt,
                params,
                req_class,
                slo,
                arrival_time,
                tuple(resumed_output_ids),
                session_id,
                accepted,
                cache_salt,
            )
        )
        try:
            admission: Admission = await accepted
        except asyncio.CancelledError:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # it may be in the engine already: the abort follows it there
            raise
        except ValueError:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(request_id, admission, deltas, self._release)

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | ParamsFor,
        *,
        req_class: RequestClass = RequestClass.RT,
        slo: SLO = SLO(),
        arrival_time: float | None = None,
        resumed_output_ids: Sequence[int] | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream deltas until the request finishes. Leaving the loop early aborts the request;
        a request the engine refuses raises its ValueError here."""
        stream = await self.add_request(
            request_id,
            prompt,
            params,
            req_class=req_class,
            slo=slo,
            arrival_time=arrival_time,
            resumed_output_ids=resumed_output_ids or (),
            session_id=session_id,
            cache_salt=cache_salt,
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Cancel a request (a no-op for one the engine does not hold); its KV is freed."""
        self._thread.submit(Abort(request_id))

    async def check(
        self, prompt: Prompt, params: SamplingParams | ParamsFor, resumed_output_ids: Sequence[int] = ()
    ) -> CheckedPrompt:
        """Tokenize and validate without adding: the ValueError `add_request` would raise, or the
        token ids and parameters it would run with (for callers that must know them first)."""
        return await self.call(check_prompt, prompt, params, tuple(resumed_output_ids))

    async def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, from the engine thread's tokenizer."""
        return await self.call(lambda engine, p: encode_prompt(engine.tokenizer, p), prompt)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(engine, *args)` on the engine thread, between steps, and return its result
        (or raise its exception). The building block of the methods above; tests use it too."""
        future = asyncio.get_running_loop().create_future()
        self._thread.submit(Call(fn, args, future))
        return await future

    # -- event loop side -----------------------------------------------------------------

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)

    def _release(self, request_id: str, finished: bool) -> None:
        """A stream was closed: forget it, and abort its request unless it had finished."""
        self._streams.pop(request_id, None)
        if not finished:
            self.abort(request_id)


class RequestStream:
    """The deltas of one accepted request, until the one that finishes it. Closing the stream
    before that aborts the request and frees its KV."""

    def __init__(
        self,
        request_id: str,
        admission: Admission,
        deltas: asyncio.Queue,
        release: Callable[[str, bool], None],
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = admission.num_prompt_tokens  # the prompt as tokenized, resumed tokens not included
        # When the engine thread took the request and when the engine had queued it (wall-clock
        # ns; the worker's hand-off stages, services/worker/requests.py).
        self.picked_ns, self.queued_ns = admission.picked_ns, admission.queued_ns
        self._deltas = deltas
        self._release = release
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._finished or self._closed:
            raise StopAsyncIteration
        delta = await self._deltas.get()
        if delta.finished:
            self._finished = True
            self.close()
        return delta

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release(self.request_id, self._finished)
