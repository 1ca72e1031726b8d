"""Tandem's inference engine: paged KV cache, continuous batching, pluggable scheduling.

    from services.worker.engine import LLM, EngineConfig, SamplingParams
    llm = LLM(EngineConfig(model="default"))  # dtype "auto": bf16 with native bf16, else float32
    out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0), chat=True)
"""
from services.worker.engine.async_llm import AsyncLLM, StreamDelta
from services.worker.engine.config import EngineConfig, ModelConfig
from services.worker.engine.engine import EngineStats, LLMEngine
from services.worker.engine.llm import LLM, apply_chat_template
from services.worker.engine.outputs import GenerationOutput, RequestMetrics, RequestOutput
from services.worker.engine.sampling import SamplingParams
from services.worker.engine.scheduling import SLO, RequestClass

__all__ = [
    "AsyncLLM", "EngineConfig", "EngineStats", "GenerationOutput", "LLM", "LLMEngine", "ModelConfig",
    "RequestClass", "RequestMetrics", "RequestOutput", "SLO", "SamplingParams", "StreamDelta",
    "apply_chat_template",
]
