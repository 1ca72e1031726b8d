"""`kv_heads_expand`: the GQA model with each KV head repeated is the same function (equal
logits and greedy tokens) with multi-head attention's KV memory shape."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import requires_cxx

STEPS = 6


def _run(config: EngineConfig, prompts: list[list[int]]) -> tuple[LLMEngine, dict, dict]:
    engine = LLMEngine(config)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logits: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.last_logits is not None:
            for r, row in zip(*engine.last_logits):
                logits[r.request_id].append(row)
            engine.last_logits = None
    return engine, tokens, logits


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_expanded_model_is_the_same_function(name, tiny_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (5, 37, 18)]
    base = dict(model=str(tiny_model_dir(name)), dtype="float32", num_blocks=64, max_num_batched_tokens=32)
    plain, tokens, logits = _run(EngineConfig(**base), prompts)
    expanded, tokens_x, logits_x = _run(EngineConfig(**base, kv_heads_expand=True), prompts)
    mc, mx = plain.model_config, expanded.model_config
    assert mc.num_kv_heads < mc.num_heads and mx.num_kv_heads == mx.num_heads == mc.num_heads
    assert expanded.storage.data.shape[2] == mc.num_heads  # the cache has MHA's shape
    assert expanded.storage.bytes_per_token == plain.storage.bytes_per_token * mc.num_heads // mc.num_kv_heads
    assert tokens_x == tokens
    for rid in logits:
        for a, b in zip(logits[rid], logits_x[rid], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_mha_model_is_left_alone(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir("opt")), dtype="float32", num_blocks=16, kv_heads_expand=True)
    )
    assert engine.model_config.num_kv_heads == engine.model_config.num_heads


def test_default_model_expanded_gives_the_same_tokens(smollm2_dir):
    prompts = [[1, 504, 3458, 282, 4649, 314, 253, 2272, 30], list(range(100, 160))]
    base = dict(model="default", dtype="float32", kv_cache_gib=0.05, attention="reference")
    plain, tokens, logits = _run(EngineConfig(**base), prompts)
    _, tokens_x, logits_x = _run(EngineConfig(**base, kv_heads_expand=True), prompts)
    assert plain.model_config.num_kv_heads == 3
    assert tokens_x == tokens
    for rid in logits:
        for a, b in zip(logits[rid], logits_x[rid], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)


@requires_cxx
def test_expanded_model_runs_the_compiled_decode_path(tiny_model_dir):
    """One query head per KV head: the fused kernel's output is a strided view, which the
    compiled decoder layer must reshape, not view (it failed to compile before)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")), dtype="bfloat16", num_blocks=32, attention="fused", kv_heads_expand=True
        )
    )
    assert engine.runner.decode_kernel == "fused" and engine.runner.decode_graph is not None
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
