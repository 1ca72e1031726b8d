"""Tiny random-weight models of every supported family, loaded through the real loader:
our logits match transformers' at every prefill and decode position."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import TINY_MODELS, requires_cxx

STEPS = 6


def _hf_greedy_logits(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, logits = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):  # no KV cache: the most literal reference
            row = model(torch.tensor([ids])).logits[0, -1]
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    """Factory: (model name, prompts) -> transformers' greedy tokens and logits per prompt.
    Computed once per model and shared by the four kernel choices below, which all compare with
    the same reference: recomputing it per choice (a model load and 18 forward passes each) was
    most of this file's time."""
    from transformers import AutoModelForCausalLM

    made: dict[tuple[str, tuple[tuple[int, ...], ...]], list[tuple[list[int], list[torch.Tensor]]]] = {}

    def get(name: str, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
        key = (name, tuple(map(tuple, prompts)))
        if key not in made:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(name), dtype=torch.float32).eval()
            made[key] = [_hf_greedy_logits(model, p, STEPS) for p in prompts]
        return made[key]

    return get


@pytest.mark.parametrize(
    "attention,fused_ops",
    [
        ("reference", "off"),  # PyTorch end to end: the oracle path
        pytest.param("reference", "cpp", marks=requires_cxx),
        pytest.param("fused", "auto", marks=requires_cxx),
        pytest.param("cpp", "auto", marks=requires_cxx),
    ],
)
@pytest.mark.parametrize("name", TINY_MODELS)
def test_logits_match_transformers(name, attention, fused_ops, tiny_model_dir, hf_reference):
    """`fused_ops`: the layers' elementwise work by the C++ kernels (auto resolves to them here)
    or PyTorch op by op (off)."""
    path = tiny_model_dir(name)
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (5, 37, 18)]
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            num_blocks=64,
            block_size=16,
            max_num_batched_tokens=32,
            attention=attention,
            fused_ops=fused_ops,
        )
    )  # 37-token prompt is chunked
    assert engine.model.ops.name == ("torch" if fused_ops == "off" else "cpp")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    ours: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.last_logits is not None:
            reqs, logits = engine.last_logits
            for r, row in zip(reqs, logits):
                ours[r.request_id].append(row)
            engine.last_logits = None
    for i, (ref_tokens, ref_logits) in enumerate(hf_reference(name, prompts)):
        assert tokens[str(i)] == ref_tokens
        for mine, ref in zip(ours[str(i)], ref_logits, strict=True):
            torch.testing.assert_close(mine, ref, atol=2e-4, rtol=1e-4)


def test_bfloat16_close_to_float32(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = list(range(100, 140))
    outs = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, num_blocks=32))
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        engine.step()
        outs[dtype] = engine.last_logits[1][0]
    torch.testing.assert_close(outs["bfloat16"], outs["float32"], atol=0.1, rtol=0.05)


@requires_cxx
@pytest.mark.parametrize("kernel", ["cpp", "fused"])
def test_bfloat16_decode_kernel_close_to_reference(tiny_model_dir, kernel):
    """The bf16 CPU decode kernels (the C++ one is the serving default) against the
    gather+matmul reference, step by step over a batch whose contexts span several blocks."""
    _bfloat16_runs_close(tiny_model_dir("llama"), dict(attention=kernel), dict(attention="reference"))


@requires_cxx
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bfloat16_fused_layer_ops_close_to_pytorch(tiny_model_dir, name):
    """The fused C++ elementwise ops in bf16 (one rounding per op instead of PyTorch's one per
    elementary op) against PyTorch op by op, same decode kernel."""
    _bfloat16_runs_close(tiny_model_dir(name), dict(fused_ops="cpp"), dict(fused_ops="off"))


def _bfloat16_runs_close(path, candidate: dict, reference: dict) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (3, 40, 17, 66)]
    runs = []
    for overrides in (candidate, reference):
        cfg = EngineConfig(model=str(path), dtype="bfloat16", num_blocks=64, block_size=8, **overrides)
        if "attention" in overrides:
            assert cfg.decode_kernel == overrides["attention"]
        engine = LLMEngine(cfg)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        steps = []
        while engine.has_unfinished():
            engine.step()
            reqs, logits = engine.last_logits
            steps.append(dict(zip((r.request_id for r in reqs), logits)))
        runs.append(steps)
    # Compare while both runs have fed the same tokens: after a near-tie flips a greedy
    # token (bf16 rounding differs), the sequences differ and so do their logits.
    diverged: set[str] = set()
    for mine, ref in zip(*runs, strict=True):
        for rid in ref.keys() - diverged:
            torch.testing.assert_close(mine[rid], ref[rid], atol=0.1, rtol=0.05)
            if mine[rid].argmax() != ref[rid].argmax():
                diverged.add(rid)
    assert len(diverged) < len(prompts)  # not every sequence ran into a near-tie


def test_attention_choice_is_checked():
    from kernels.cpu.build import target_for

    native = "cpp" if target_for() is not None else "reference"  # no kernel target below AVX2
    assert EngineConfig(dtype="bfloat16").decode_kernel == native
    assert EngineConfig(dtype="float32").decode_kernel == native
    assert EngineConfig(dtype="float16").decode_kernel == "reference"
    # compiled decoder layers: auto per dtype (measured), an explicit choice is kept
    assert EngineConfig(dtype="bfloat16").layers_compiled and not EngineConfig(dtype="float32").layers_compiled
    assert EngineConfig(dtype="float32", compile_layers=True).layers_compiled
    assert not EngineConfig(dtype="bfloat16", compile_layers=False).layers_compiled
    assert EngineConfig(dtype="bfloat16", attention="cpp").decode_kernel == "cpp"
    assert EngineConfig(dtype="bfloat16", device="cuda").decode_kernel == "triton"
    with pytest.raises(ValueError, match="attention must be"):
        LLMEngine(EngineConfig(attention="flash"))
    for kernel in ("fused", "cpp"):
        with pytest.raises(ValueError, match="CPU kernel"):
            LLMEngine(EngineConfig(attention=kernel, device="cuda"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_attention_falls_back_when_the_kernel_cannot_be_built(tiny_model_dir, monkeypatch, caplog, dtype):
    """No C++ compiler (a slim image): `auto` warns and serves with the reference kernel;
    an explicit `cpp` or `fused` fails at start."""
    from kernels.compiled import decode as compiled_decode
    from kernels.cpu import decode as cpu_decode
    from kernels.cpu.build import KernelBuildError

    def no_compiler(*_args, **_kwargs):
        raise KernelBuildError("no C++ compiler found (set CXX or install g++)")

    def broken(*_args, **_kwargs):
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(cpu_decode, "ops", no_compiler)
    monkeypatch.setattr(compiled_decode, "warm_up", broken)
    path = tiny_model_dir("llama")
    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, num_blocks=32))
    assert engine.runner.decode_kernel == "reference" and engine.runner.decode_graph is None
    assert "decode attention unavailable" in caplog.text
    assert engine.model.ops.name == "torch" and "fused layer ops unavailable" in caplog.text  # same library
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        LLMEngine(EngineConfig(model=str(path), dtype=dtype, num_blocks=32, attention="cpp"))
    with pytest.raises(RuntimeError, match="cc is not found"):
        LLMEngine(EngineConfig(model=str(path), dtype=dtype, num_blocks=32, attention="fused"))


def test_incomplete_checkpoint_is_refused(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        LLMEngine(EngineConfig(model=str(dst), dtype="float32", num_blocks=8))
