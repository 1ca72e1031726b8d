"""Tandem's inference engine: paged KV cache, continuous batching, pluggable scheduling.

from engine import LLM, EngineConfig, SamplingParams
llm = LLM(EngineConfig(model="default"))  # dtype "auto": bf16 with native bf16, else float32
out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0), chat=True)
"""

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
