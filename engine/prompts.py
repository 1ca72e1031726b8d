"""Prompts as the engine takes them, and their token ids.

A prompt is token ids, a `TextPrompt` or a `ChatPrompt`. Text and chats become token ids with
the engine's tokenizer, on the thread that owns it: the caller's for `LLM`, the engine thread
for `AsyncLLM` (see `engine/async_llm.py` for why).

Sampling parameters may depend on the prompt's length (an OpenAI request without `max_tokens`
gets the rest of the context; its errors name the prompt's length), which is known only once
the owner of the tokenizer has encoded it; such callers pass a `ParamsFor`, a function of the
prompt's token count, instead of `SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.sampling import SamplingParams


@dataclass(frozen=True)
class TextPrompt:
    text: str  # encoded as is, with the tokenizer's special tokens (BOS)


@dataclass(frozen=True)
class ChatPrompt:
    messages: Sequence[dict]  # OpenAI-style {"role", "content"}, rendered by the model's chat template


Prompt = Sequence[int] | TextPrompt | ChatPrompt
ParamsFor = Callable[[int], SamplingParams]  # the prompt's token count -> its sampling parameters
_NO_TOKENIZER = "this model has no tokenizer (dummy weights): send the prompt as token ids"


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt the engine tokenized and validated, with the parameters it will run with."""

    prompt_token_ids: list[int]
    params: SamplingParams


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of `prompt`. Any failure of the tokenizer or the chat template (a template may
    refuse a conversation: roles out of order, unknown roles) is a ValueError: bad input, as
    is text for a model without a tokenizer (`load_format="dummy"` takes token ids only)."""
    if isinstance(prompt, (TextPrompt, ChatPrompt)) and tokenizer is None:
        raise ValueError(_NO_TOKENIZER)
    if isinstance(prompt, TextPrompt):
        return _guarded(lambda: tokenizer(prompt.text).input_ids)
    if isinstance(prompt, ChatPrompt):
        return _guarded(lambda: apply_chat_template(tokenizer, list(prompt.messages)))
    return list(prompt)


def params_for(params: SamplingParams | ParamsFor, num_prompt_tokens: int) -> SamplingParams:
    return params if isinstance(params, SamplingParams) else params(num_prompt_tokens)


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's own template, ready for the reply."""
    if tokenizer is None:
        raise ValueError(_NO_TOKENIZER)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _guarded(encode: Callable[[], list[int]]) -> list[int]:
    try:
        return encode()
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 (jinja's TemplateError and friends: the input's fault)
        raise ValueError(f"the prompt could not be tokenized: {exc}") from exc
