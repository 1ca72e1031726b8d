"""OpenAI response objects and SSE chunks, built from a request's stream state.

The gateway streams chunks and answers `final` bodies; the queue service writes `final` bodies
into batch output files. Both get their shaper from `shaper_for`, so ids and object names match.
"""

from __future__ import annotations

import json

from shared.openai_api.models import RequestKind
from shared.schemas.results import Delta


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    u = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def shaper_for(
    kind: RequestKind, request_id: str, created: int, model: str, service_tier: str | None
) -> ChatShaper | CompletionShaper:
    """The shaper of a request kind; response ids are `chatcmpl-<id>` / `cmpl-<id>`, as OpenAI's."""
    if kind == "chat":
        return ChatShaper(f"chatcmpl-{request_id}", created, model, service_tier)
    return CompletionShaper(f"cmpl-{request_id}", created, model, service_tier)


class ChatShaper:
    def __init__(self, rid: str, created: int, model: str, service_tier: str | None) -> None:
        self.base = {"id": rid, "created": created, "model": model}
        if service_tier:
            self.base["service_tier"] = service_tier

    def first_chunk(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def delta_chunk(self, d: Delta, token_texts: list[str] | None) -> dict:
        return self._chunk({"content": d.text} if d.text else {}, d.finish_reason, self._logprobs(d, token_texts))

    def _chunk(self, delta: dict, finish: str | None, logprobs: dict | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self.base, "object": "chat.completion.chunk", "choices": [choice]}

    def usage_chunk(self, u: dict) -> dict:
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": u}

    def final(self, text: str, finish: str, logprobs: list[float] | None, texts: list[str] | None, u: dict) -> dict:
        lp = None if logprobs is None else {"content": _content_logprobs(logprobs, texts)}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp,
            "finish_reason": finish,
        }
        return {**self.base, "object": "chat.completion", "choices": [choice], "usage": u}

    @staticmethod
    def _logprobs(d: Delta, texts: list[str] | None) -> dict | None:
        return None if d.logprobs is None else {"content": _content_logprobs(d.logprobs, texts)}


class CompletionShaper:
    def __init__(self, rid: str, created: int, model: str, service_tier: str | None) -> None:
        self.base = {"id": rid, "created": created, "model": model}
        if service_tier:
            self.base["service_tier"] = service_tier

    def first_chunk(self) -> dict | None:
        return None  # the legacy API has no role chunk

    def delta_chunk(self, d: Delta, token_texts: list[str] | None) -> dict:
        lp = None if d.logprobs is None else _legacy_logprobs(d.logprobs, token_texts)
        choice = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        return {**self.base, "object": "text_completion", "choices": [choice]}

    def usage_chunk(self, u: dict) -> dict:
        return {**self.base, "object": "text_completion", "choices": [], "usage": u}

    def final(self, text: str, finish: str, logprobs: list[float] | None, texts: list[str] | None, u: dict) -> dict:
        lp = None if logprobs is None else _legacy_logprobs(logprobs, texts)
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**self.base, "object": "text_completion", "choices": [choice], "usage": u}


def _content_logprobs(logprobs: list[float], texts: list[str] | None) -> list[dict]:
    texts = texts or [""] * len(logprobs)
    return [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(texts, logprobs)
    ]


def _legacy_logprobs(logprobs: list[float], texts: list[str] | None) -> dict:
    texts = texts or [""] * len(logprobs)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None}
