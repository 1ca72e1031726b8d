"""Prefill rows through the C++ paged kernel (`prefill_attention="auto"`: every decode and prefill
row of a step in one kernel call) against one SDPA call per prompt (`"sdpa"`, the oracle path):
the same schedule fed to two engines gives the same logits at every step, over chunked prefills
(a chunk attending its prompt's earlier chunks in the cache), prefix-cache hits (a first chunk
with cached context), steps mixing decode rows with prefill chunks. A recorder on the models'
attention call checks which path each step really took. BROS's reversed blocks under this path
(BE prefill rows in an RT block's far end) are covered by tests/engine/test_bros_engine.py,
whose engines run the default (`auto`) against an ample-memory run's tokens."""

from __future__ import annotations

import random

import pytest
import torch

import engine.models.llama as llama_model
from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import requires_cxx

pytestmark = requires_cxx


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(49152) for _ in range(24)]  # a cached prefix for the later prompts
    lens = (37, 5, 61, 18, 2, 44)
    return [
        shared + [rng.randrange(49152) for _ in range(n)] if i % 2 else [rng.randrange(49152) for _ in range(n)]
        for i, n in enumerate(lens)
    ]


class _Recorder:
    """Wraps `paged_attention` as the Llama layers call it: per call, (buckets, prefill spans, rows)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        inner = llama_model.paged_attention

        def record(q, k, v, cache, meta):
            self.calls.append((len(meta.decode_buckets), len(meta.prefills), q.shape[0]))
            return inner(q, k, v, cache, meta)

        monkeypatch.setattr(llama_model, "paged_attention", record)


def _run(path, dtype: str, prefill_attention: str, monkeypatch, **overrides):
    """Steps both engines alike: the first half of the prompts at once, the rest two steps
    later (so later steps mix decode rows and prefill chunks). Returns logits per step by
    request, the tokens by request and the recorder."""
    recorder = _Recorder(monkeypatch)
    cfg = dict(
        model=str(path),
        dtype=dtype,
        num_blocks=96,
        block_size=4,
        max_num_batched_tokens=48,
        enable_prefix_caching=True,
        attention="cpp",
        prefill_attention=prefill_attention,
    )
    cfg.update(overrides)
    engine = LLMEngine(EngineConfig(**cfg))
    assert engine.runner.decode_kernel == "cpp"
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    steps, step, tokens = [], 0, {}
    while step < 2 or engine.has_unfinished():
        if step == 0 or step == 2:
            for i in range(len(prompts))[: len(prompts) // 2] if step == 0 else range(len(prompts) // 2, len(prompts)):
                engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
        if engine.last_logits is not None:
            reqs, logits = engine.last_logits
            steps.append({r.request_id: row for r, row in zip(reqs, logits)})
            engine.last_logits = None
    monkeypatch.undo()
    return steps, tokens, recorder


def _assert_paths(kernel: _Recorder, sdpa: _Recorder) -> None:
    """The kernel engine never hands a prefill span to SDPA and attends each step's rows in one
    bucket; the SDPA engine did have prefill spans (so the comparison covers prefills)."""
    calls_kernel, calls_sdpa = kernel.calls, sdpa.calls
    assert all(buckets <= 1 and spans == 0 for buckets, spans, _ in calls_kernel)
    assert any(spans for _, spans, _ in calls_sdpa)
    assert any(rows > 1 and buckets == 1 for buckets, _, rows in calls_kernel)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_float32_kernel_prefill_matches_sdpa(tiny_model_dir, monkeypatch, name):
    path = tiny_model_dir(name)
    ours, tokens, calls = _run(path, "float32", "auto", monkeypatch)
    ref, ref_tokens, ref_calls = _run(path, "float32", "sdpa", monkeypatch)
    _assert_paths(calls, ref_calls)
    assert tokens == ref_tokens
    assert len(ours) == len(ref)
    for mine, theirs in zip(ours, ref, strict=True):
        assert mine.keys() == theirs.keys()
        for rid, row in mine.items():
            torch.testing.assert_close(row, theirs[rid], atol=2e-4, rtol=1e-4)


def test_bfloat16_kernel_prefill_close_to_sdpa(tiny_model_dir, monkeypatch):
    """bf16: the kernel accumulates in float32 where SDPA rounds differently; logits stay close
    while both runs have fed the same tokens (the first step's logits come from prefill alone)."""
    path = tiny_model_dir("llama")
    ours, _, calls = _run(path, "bfloat16", "auto", monkeypatch)
    ref, _, ref_calls = _run(path, "bfloat16", "sdpa", monkeypatch)
    _assert_paths(calls, ref_calls)
    for rid, row in ours[0].items():
        torch.testing.assert_close(row, ref[0][rid], atol=0.1, rtol=0.05)


def test_prefill_attention_setting_is_checked():
    with pytest.raises(ValueError, match="prefill_attention"):
        EngineConfig(prefill_attention="flash")
