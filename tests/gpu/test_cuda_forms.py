"""The cache forms whose K/V are not in the pool, on CUDA through the Triton kernels: the
hybrid cache's HIDDEN rows (kernels/triton/hidden.py) and eLLM's transient prefix merged
with the paged suffix (kernels/triton/resident.py). Skipped without a CUDA device ("no CUDA
device"); run by `tests/gpu/run_gpu_checks.sh tests` on the device machine (docs/gpu.md).

- float32 on the GPU gives the CPU reference engine's greedy tokens and logits (KV form,
  full residency) for GQA Llama, Qwen3 (k-norm) and OPT, with chunked prefill.
- bfloat16 on the GPU stays close to bfloat16 on the GPU in the KV form / fully resident,
  step by step until a near-tie flips a token.

`TANDEM_GPU_DRY_RUN=1` runs the same code on CPU tensors under Triton's interpreter (slow:
minutes; it checks this file and the dispatch, not the GPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

DRY_RUN = os.environ.get("TANDEM_GPU_DRY_RUN") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or DRY_RUN), reason="no CUDA device")
GPU = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = 6
FAMILIES = ["llama", "qwen3", "opt"]


def _prompts(seed: int, lengths=(5, 37, 18, 1)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(n)] for n in lengths]


def _run(path, where: str, dtype: str, prompts, **overrides):
    """Greedy tokens and per-step logits (float32, on the CPU) of each prompt; `where` is "gpu"
    (the Triton kernels) or "cpu" (the reference engine)."""
    cfg = dict(model=str(path), dtype=dtype, num_blocks=64, block_size=16, max_num_batched_tokens=32)
    cfg |= dict(device=GPU, attention="triton") if where == "gpu" else dict(device="cpu", attention="reference")
    engine = LLMEngine(EngineConfig(**{**cfg, **overrides}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    tokens = {str(i): [] for i in range(len(prompts))}
    logits = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.kv.check_invariants()
        if engine.last_logits is not None:
            for r, row in zip(*engine.last_logits):
                logits[r.request_id].append(row.float().cpu())
            engine.last_logits = None
    return tokens, logits


def _equal(got, expected) -> None:
    assert got[0] == expected[0]
    for rid, rows in expected[1].items():
        for mine, ref in zip(got[1][rid], rows, strict=True):
            torch.testing.assert_close(mine, ref, atol=1e-3, rtol=1e-3)


def _close_until_a_flip(got, expected, prompts) -> None:
    diverged = 0
    for rid in expected[1]:
        for a, b in zip(got[1][rid], expected[1][rid]):
            torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
            if a.argmax() != b.argmax():  # a near-tie flipped: the sequences differ from here on
                diverged += 1
                break
    assert diverged < len(prompts)


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_form_on_gpu_equals_cpu_reference(bare_tiny_model_dir, name):
    path, prompts = bare_tiny_model_dir(name), _prompts(1)
    expected = _run(path, "cpu", "float32", prompts, cache_form="kv")
    _equal(_run(path, "gpu", "float32", prompts, cache_form="hidden"), expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_partial_residency_on_gpu_equals_cpu_full_residency(bare_tiny_model_dir, name):
    path, prompts = bare_tiny_model_dir(name), _prompts(2)
    expected = _run(path, "cpu", "float32", prompts)
    for ratio in (0.5, 0.9):
        _equal(_run(path, "gpu", "float32", prompts, uncached_ratio=ratio), expected)


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_bfloat16_forms_close_to_the_kv_form_on_gpu(bare_tiny_model_dir, name):
    path, prompts = bare_tiny_model_dir(name), _prompts(3, (3, 40, 17, 66))
    kv = _run(path, "gpu", "bfloat16", prompts, block_size=8)
    _close_until_a_flip(_run(path, "gpu", "bfloat16", prompts, block_size=8, cache_form="hidden"), kv, prompts)
    _close_until_a_flip(_run(path, "gpu", "bfloat16", prompts, block_size=8, uncached_ratio=0.5), kv, prompts)
