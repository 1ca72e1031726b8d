"""Offline API: `LLM(config).generate(prompts, params)` runs requests to completion."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import GenerationOutput, RequestMetrics
from engine.prompts import apply_chat_template
from engine.sampling import SamplingParams
from engine.scheduling import Request

Prompt = str | list[int]

__all__ = ["LLM", "apply_chat_template"]


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig()
        if overrides:
            config = EngineConfig(**{**config.__dict__, **overrides})
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): pass prompts as token ids")
        if chat:
            return apply_chat_template(self.tokenizer, [{"role": "user", "content": prompt}])
        return self.tokenizer(prompt).input_ids

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        progress: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params_list = _per_prompt(params, len(prompts))
        requests = [
            self.engine.add_request(f"offline-{next(self._ids)}", self.encode(p, chat), sp)
            for p, sp in zip(prompts, params_list)
        ]
        done = 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                done += out.finished
                if progress and out.finished:
                    print(f"\r{done}/{len(requests)} done", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        return [self._output(r) for r in requests]

    def _output(self, r: Request) -> GenerationOutput:
        ids = r.output_token_ids
        text_ids = ids[:-1] if isinstance(r.stop_reason, int) else ids  # drop the EOS/stop token
        return GenerationOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=ids,
            text=self._text(r, text_ids),
            finish_reason=r.finish_reason.value,
            logprobs=list(r.output_logprobs) if r.params.logprobs else None,
            metrics=RequestMetrics.of(r),
        )

    def _text(self, r: Request, ids: list[int]) -> str:
        if r.output_text is not None:
            return r.output_text
        if self.tokenizer is None:  # a tokenizer-free (dummy) model: token ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
