"""The whole engine through the Triton attention kernels (decode and prefill/extend): greedy
tokens equal to the CPU reference engine's, float32, for a GQA Llama and an MHA OPT, with
chunked prefill, a prefix-cache hit (a first chunk that starts after a cached prefix), a
one-token prompt, and a BROS run with reversed blocks.

Without a GPU the Triton engine runs on CPU under Triton's interpreter, where the KV write
stays the reference's (the write dispatches by device; the Triton write kernel is checked
in tests/kernels/test_triton_attention.py); with one, on CUDA with every kernel compiled."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams


def _run(engine: LLMEngine, prompts, max_tokens: int):
    """Greedy tokens and every step's logits per request, requests added at once."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logits: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.last_logits is not None:
            for r, row in zip(*engine.last_logits):
                logits[r.request_id].append(row)
            engine.last_logits = None
    return tokens, logits


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_greedy_tokens_equal_the_reference_engine(kernel_device, bare_tiny_model_dir, name):
    path = bare_tiny_model_dir(name)
    rng = random.Random(4)
    shared = [rng.randrange(49152) for _ in range(20)]
    prompts = [
        [rng.randrange(49152) for _ in range(37)],  # chunked: 32 + 5 tokens
        [7],  # a one-token prompt
        shared + [rng.randrange(49152) for _ in range(6)],
    ]
    late = shared + [rng.randrange(49152) for _ in range(9)]  # hits the cached prefix of prompt 2
    runs = {}
    for attention in ("triton", "reference"):
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                device=kernel_device if attention == "triton" else "cpu",
                dtype="float32",
                num_blocks=48,
                block_size=8,
                max_num_batched_tokens=32,
                attention=attention,
            )
        )
        assert engine.runner.decode_kernel == attention
        first = _run(engine, prompts, 5)
        second = _run(engine, [late], 4)
        assert engine.stats.prompt_tokens_cached >= 16  # the late prompt's first chunk started after a prefix
        runs[attention] = (first, second)
    for (tri_tokens, tri_logits), (ref_tokens, ref_logits) in zip(runs["triton"], runs["reference"]):
        assert tri_tokens == ref_tokens
        for rid, rows in ref_logits.items():
            for mine, ref in zip(tri_logits[rid], rows, strict=True):
                torch.testing.assert_close(mine.cpu(), ref, atol=1e-4, rtol=1e-4)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        EngineConfig(attention="triton", dtype="float32").decode_kernel  # noqa: B018
    assert EngineConfig(device="cuda", dtype="bfloat16").decode_kernel == "triton"
    assert EngineConfig(device="cuda:1", dtype="bfloat16", attention="reference").decode_kernel == "reference"
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        EngineConfig(device="gpu", dtype="float32").decode_kernel  # noqa: B018


def test_bros_with_reversed_blocks_equals_ample_memory_run(kernel_device, bare_tiny_model_dir, tmp_path):
    """BE requests fill a tight cache, then RT requests take over their blocks' free ends
    (reversed blocks), with checkpoints, swaps and restores: tokens equal an ample-memory
    FCFS run on the reference kernel."""
    from engine.scheduling import RequestClass
    from tests.engine.test_bros_engine import COST, _engine, _ids, _reference, _run_bros

    path = bare_tiny_model_dir("llama")
    cost_file = tmp_path / "cost.json"
    COST.save(cost_file)
    bros = _engine(path, str(cost_file), attention="triton", device=kernel_device)
    reversed_steps = []
    directions = bros.runner._directions

    def spy(tables, width):
        bits = directions(tables, width)
        reversed_steps.append(bits is not None)
        return bits

    bros.runner._directions = spy
    ample = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=256, attention="reference"))
    rng = random.Random(0)
    jobs = [
        (f"be{next(_ids)}", [rng.randrange(49152) for _ in range(rng.randint(8, 14))], rng.randint(6, 12), 0,
         RequestClass.BE)
        for _ in range(3)
    ] + [
        (f"rt{next(_ids)}", [rng.randrange(49152) for _ in range(rng.randint(6, 14))], rng.randint(4, 10),
         rng.randint(2, 8), RequestClass.RT)
        for _ in range(5)
    ]  # fmt: skip
    expected = _reference(ample, jobs)
    got, copies = _run_bros(bros, jobs)
    assert got == expected
    assert any(reversed_steps), "no step attended a reversed block"
    assert copies["checkpoint"] and copies["restore"], copies
