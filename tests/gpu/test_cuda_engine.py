"""Checks that need a CUDA device (skipped elsewhere with the reason "no CUDA device").

Run them with `tests/gpu/run_gpu_checks.sh` on the device machine (docs/gpu.md). On such a
host the Triton kernel tests (tests/kernels/test_triton_attention.py) and the engine-through-
Triton tests (tests/engine/test_triton_engine.py) run on CUDA tensors as well.

- The whole engine on CUDA (attention auto -> Triton) gives transformers' greedy tokens on the
  GPU for a tiny model of every supported family, float32, with chunked prefill.
- bf16 on CUDA stays close to float32 on CUDA, step by step until a near-tie flips a token.
- The built-in dummy architectures run on the GPU (finite logits, the requested lengths).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

STEPS = 6


def _prompts(seed: int, lengths=(5, 37, 18, 1)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(n)] for n in lengths]


def _engine_run(path, dtype: str, prompts, steps: int = STEPS, **overrides):
    cfg = dict(model=str(path), device="cuda", dtype=dtype, num_blocks=64, block_size=16, max_num_batched_tokens=32)
    engine = LLMEngine(EngineConfig(**{**cfg, **overrides}))
    assert engine.runner.decode_kernel == "triton"
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    tokens = {str(i): [] for i in range(len(prompts))}
    logits = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.last_logits is not None:
            for r, row in zip(*engine.last_logits):
                logits[r.request_id].append(row.float().cpu())
            engine.last_logits = None
    return tokens, logits


def _hf_greedy(path, prompt, steps: int = STEPS):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to("cuda").eval()
    ids, logits = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):  # no KV cache: the most literal reference
            row = model(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu()
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_tokens_equal_transformers_on_gpu(bare_tiny_model_dir, name):
    path = bare_tiny_model_dir(name)
    prompts = _prompts(1)
    tokens, logits = _engine_run(path, "float32", prompts)
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = _hf_greedy(path, p)
        assert tokens[str(i)] == ref_tokens
        for mine, ref in zip(logits[str(i)], ref_logits, strict=True):
            torch.testing.assert_close(mine, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", ["llama", "qwen3", "opt"])
def test_bfloat16_close_to_float32_on_gpu(bare_tiny_model_dir, name):
    path = bare_tiny_model_dir(name)
    prompts = _prompts(2, (3, 40, 17, 66))
    _, fp32 = _engine_run(path, "float32", prompts, block_size=8)
    _, bf16 = _engine_run(path, "bfloat16", prompts, block_size=8)
    diverged = 0
    for rid in fp32:
        for a, b in zip(bf16[rid], fp32[rid]):
            torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
            if a.argmax() != b.argmax():  # a near-tie flipped: the sequences differ from here on
                diverged += 1
                break
    assert diverged < len(prompts)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3-8b", "opt-13b"])
def test_builtin_dummy_architectures_run_on_gpu(name):
    lengths = (1, 100, 700)
    tokens, logits = _engine_run(
        name, "bfloat16", _prompts(3, lengths), steps=8, load_format="dummy", num_blocks=None,
        kv_cache_gib=4.0, max_num_batched_tokens=512,
    )  # fmt: skip
    assert all(len(t) == 8 for t in tokens.values())
    assert all(torch.isfinite(row).all() for rows in logits.values() for row in rows)
