"""From a step's logits to the step's news: sample, append, stop, detokenize, emit.

`LLMEngine.step` runs the model; what happens to the rows that produced logits is here: one
batched sampler call (EOS and stop ids banned until `min_tokens`), each request's token
appended and its stop rules checked (`StepBookkeeping`), its text produced incrementally
when it is streamed or has stop strings (a stop string found by the detokenizer stops the
request in the same step), and one `RequestOutput` per row. It owns the requests'
detokenizers; the engine opens one when it adds a request and drops it on abort.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.bookkeeping import StepBookkeeping, Stop
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.scheduling import FinishReason, Request


class OutputEmitter:
    def __init__(self, sampler: Sampler, bookkeeping: StepBookkeeping, eos_token_ids: frozenset[int]) -> None:
        self.sampler = sampler
        self.bookkeeping = bookkeeping
        self.eos_token_ids = eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def open_text(
        self,
        request_id: str,
        tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        delivered_ids: Sequence[int] = (),
    ) -> None:
        """Detokenize this request's output as it comes; `delivered_ids` are outputs an earlier
        attempt already sent (consumed silently, so the text continues where the client's ends)."""
        detok = IncrementalDetokenizer(
            tokenizer,
            list(prompt_token_ids),
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        if delivered_ids:
            detok.push(list(delivered_ids))
        self._detokenizers[request_id] = detok

    def drop(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def sample_and_emit(self, logits: torch.Tensor, sampled: list[Request]) -> list[RequestOutput]:
        out = self.sampler.sample(
            logits, [r.params for r in sampled], [r.generator for r in sampled], self._banned_ids(sampled)
        )
        now = time.perf_counter()
        outputs = []
        for i, request in enumerate(sampled):
            logprob = out.logprobs[i] if request.params.logprobs and out.logprobs is not None else None
            stop = self.bookkeeping.append_token(request, out.token_ids[i], logprob, now)
            outputs.append(self._emit(request, out.token_ids[i], logprob, stop))
        return outputs

    def _emit(self, request: Request, token: int, logprob: float | None, stop: Stop | None) -> RequestOutput:
        """The step's news for one request; a stop string found by its detokenizer stops it too."""
        detok = self._detokenizers.get(request.request_id)
        text = ""
        if detok is not None:
            ends_on_token = stop is not None and stop[0] is FinishReason.STOP
            text = "" if ends_on_token else detok.push([token])
            if detok.stopped_by is not None:
                stop = (FinishReason.STOP, detok.stopped_by)
            elif stop is not None:
                text += detok.finish()
        if stop is not None:
            self.bookkeeping.finish(request, stop)
            if detok is not None:
                request.output_text = detok.text
            self._detokenizers.pop(request.request_id, None)
        return RequestOutput(
            request.request_id,
            [token],
            text,
            None if logprob is None else [logprob],
            stop is not None,
            None if stop is None else stop[0].value,
            request,
        )

    def _banned_ids(self, requests: list[Request]) -> list[list[int]] | None:
        """EOS and stop ids may not be sampled before min_tokens outputs."""
        bans = []
        for r in requests:
            if r.num_output_tokens < r.params.min_tokens:
                ids = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(self.eos_token_ids))
                bans.append(ids)
            else:
                bans.append([])
        return bans if any(bans) else None
