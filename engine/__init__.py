"""Tandem's inference engine: paged KV cache, continuous batching, pluggable scheduling.

from engine import LLM, EngineConfig, SamplingParams
llm = LLM(EngineConfig(model="default"))  # dtype "auto": bf16 with native bf16, else float32
out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0), chat=True)

The names below are imported on first use (PEP 562), not with the package: a service that needs
one pure-Python module of it (the scheduler's `engine.cost_model`) must not pay for torch and
transformers, which importing `engine.async_llm` loads. That import took 12 s of wall time at
load 20 and about 100 s at load 35, and a replacement scheduler spent it before it even looked
at the broker, so RT requests ran out of their clients' retry budget (`tandem chaos`, session 9,
docs/reliability.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Where each public name lives, imported on first use (module docstring); `from engine import
# LLMEngine` and `engine.LLMEngine` work as before.
_EXPORTS = {
    "AsyncLLM": "engine.async_llm",
    "RequestStream": "engine.async_llm",
    "EngineStats": "engine.bookkeeping",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "LLMEngine": "engine.engine",
    "LLM": "engine.llm",
    "GenerationOutput": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "StreamDelta": "engine.outputs",
    "ChatPrompt": "engine.prompts",
    "CheckedPrompt": "engine.prompts",
    "TextPrompt": "engine.prompts",
    "apply_chat_template": "engine.prompts",
    "SamplingParams": "engine.sampling",
    "SLO": "engine.scheduling",
    "RequestClass": "engine.scheduling",
    "ClassCounts": "engine.snapshot",
    "EngineInfo": "engine.snapshot",
    "EngineSnapshot": "engine.snapshot",
}

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM, RequestStream
    from engine.bookkeeping import EngineStats
    from engine.config import EngineConfig, ModelConfig
    from engine.engine import LLMEngine
    from engine.llm import LLM
    from engine.outputs import GenerationOutput, RequestMetrics, RequestOutput, StreamDelta
    from engine.prompts import ChatPrompt, CheckedPrompt, TextPrompt, apply_chat_template
    from engine.sampling import SamplingParams
    from engine.scheduling import SLO, RequestClass
    from engine.snapshot import ClassCounts, EngineInfo, EngineSnapshot


def __getattr__(name: str):
    """A public name, imported from its module on first use (then cached in this module)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "AsyncLLM",
    "ChatPrompt",
    "CheckedPrompt",
    "ClassCounts",
    "EngineConfig",
    "EngineInfo",
    "EngineSnapshot",
    "EngineStats",
    "GenerationOutput",
    "LLM",
    "LLMEngine",
    "ModelConfig",
    "RequestClass",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SLO",
    "SamplingParams",
    "StreamDelta",
    "TextPrompt",
    "apply_chat_template",
]
