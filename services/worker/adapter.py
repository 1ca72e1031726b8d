"""Turns a wire `GenerateRequest` into what the engine takes: a prompt, sampling, class, SLO.

The prompt stays text or a chat here: the engine thread owns the tokenizer and encodes it
(`AsyncLLM.add_request`). The OpenAI rules that need the prompt's length (`max_tokens`
defaults to the rest of the context; context errors name both lengths) are a function of
that length, run by the engine thread once it knows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from engine.prompts import ChatPrompt, ParamsFor, Prompt, TextPrompt
from engine.sampling import SamplingParams
from engine.scheduling import SLO, RequestClass
from shared.schemas.requests import GenerateRequest


@dataclass(frozen=True)
class EngineRequest:
    key: str  # "request_id:attempt", the engine's request id
    prompt: Prompt  # the client's prompt (resumed tokens not included)
    resumed_output_ids: list[int]
    params: SamplingParams | ParamsFor
    req_class: RequestClass
    slo: SLO


def to_engine_request(req: GenerateRequest, max_model_len: int) -> EngineRequest:
    """Raises ValueError for an empty prompt; the engine raises it for anything else it cannot
    serve (reported to the client as a 400)."""
    resumed = list(req.resume_token_ids)
    return EngineRequest(
        key=f"{req.request_id}:{req.attempt}",
        prompt=_prompt(req),
        resumed_output_ids=resumed,
        params=partial(_sampling, req, n_resumed=len(resumed), max_model_len=max_model_len),
        req_class=RequestClass(req.req_class),
        slo=SLO(_ms_to_s(req.slo.ttft_ms), _ms_to_s(req.slo.tpot_ms)),
    )


def _prompt(req: GenerateRequest) -> Prompt:
    if req.kind == "chat":
        if not req.messages:
            raise ValueError("messages must be a non-empty list")
        return ChatPrompt([m.model_dump() for m in req.messages])
    if isinstance(req.prompt, list):
        return list(req.prompt)
    if not req.prompt:
        raise ValueError("prompt must be a non-empty string or list of token ids")
    return TextPrompt(req.prompt)


def _sampling(req: GenerateRequest, n_prompt: int, *, n_resumed: int, max_model_len: int) -> SamplingParams:
    s = req.sampling
    if n_prompt >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{n_prompt} tokens. Please shorten the prompt."
        )
    if s.max_tokens is not None and n_prompt + s.max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + s.max_tokens} tokens ({n_prompt} in the prompt, {s.max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens."
        )
    total = s.max_tokens if s.max_tokens is not None else max_model_len - n_prompt
    fields = s.model_dump()
    fields.update(max_tokens=max(1, total - n_resumed), min_tokens=max(0, s.min_tokens - n_resumed))
    return SamplingParams(**fields)


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0
