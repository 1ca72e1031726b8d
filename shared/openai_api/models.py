"""OpenAI request bodies as pydantic models, plus the vLLM-style extras and Tandem's extension.

Unknown fields are ignored (clients send new OpenAI fields all the time); fields we know but
cannot honour (n > 1, tools, penalties, top alternatives in logprobs) are rejected with a
400 that names them, never silently dropped. Each body knows its `kind` (what the worker
does with it: a chat template or a raw prompt), its token limit and whether it asks for
logprobs, so every service turns it into the same `GenerateRequest` (`translate.py`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.schemas.requests import ChatMessage, SamplingOptions, SLOTargets

RequestKind = Literal["chat", "completion"]


class TandemExtension(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    session_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    kind: ClassVar[RequestKind]

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    # OpenAI's own ranges, so /openapi.json states them; values we cannot honour inside them
    # (n > 1, non-zero penalties) get the 400 of `unsupported`, naming the field
    # maxItems in the schema only: the validator below gives one clear message for both forms
    stop: str | Annotated[list[str], Field(json_schema_extra={"maxItems": 4})] | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    service_tier: str | None = None
    user: str | None = None
    tandem: TandemExtension | None = None
    # vLLM-compatible extras
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    def unsupported(self) -> str | None:
        """The first field we know but cannot honour, or None."""
        if self.n != 1:
            return "n"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        return None

    @property
    @abstractmethod
    def token_limit(self) -> int | None:
        """The most tokens to generate (None: up to the model's context)."""

    @property
    @abstractmethod
    def wants_logprobs(self) -> bool:
        """Whether the sampled tokens' logprobs are asked for."""

    def sampling(self) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingOptions(
            max_tokens=self.token_limit,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.wants_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def slo(self) -> SLOTargets:
        t = self.tandem
        return SLOTargets(ttft_ms=t.ttft_ms if t else None, tpot_ms=t.tpot_ms if t else None)


class ChatCompletionRequest(_Common):
    kind = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None

    def unsupported(self) -> str | None:
        if self.top_logprobs:
            return "top_logprobs"
        if self.tools:
            return "tools"
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


class CompletionRequest(_Common):
    kind = "completion"

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's legacy default
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("prompt token list must be non-empty with ids >= 0")
        return v

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"  # >0 asks for top alternatives; 0 = the sampled tokens' logprobs
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None  # 0 asks for the sampled tokens' logprobs only


OpenAIRequest = ChatCompletionRequest | CompletionRequest

# The endpoints that take a generation request, and the body each one takes (also the batch
# API's allowed `endpoint` values and what a batch line's `url` must be).
ENDPOINTS: dict[str, type[OpenAIRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
