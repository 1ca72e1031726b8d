"""oneDNN pre-packed linear layers (bf16, and float32 where the start-up timing says it pays):
same numbers as `F.linear`, and the engine uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models import packed_linear
from engine.models.packed_linear import PackedLinear, pack_linear_layers, packing_pays, packing_supported

requires_packing = pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="oneDNN's packed bf16 GEMM does not run on this CPU (or this PyTorch)",
)
requires_fp32_packing = pytest.mark.skipif(
    not packing_supported(torch.float32, torch.device("cpu")),
    reason="oneDNN's packed float32 GEMM does not run on this CPU (or this PyTorch)",
)


@pytest.mark.skipif(packing_supported(torch.bfloat16, torch.device("cpu")), reason="packing works on this CPU")
def test_bf16_engine_without_packing_serves_unpacked(tiny_model_dir):
    """Where oneDNN refuses bf16 packing (AVX2-only CPUs, or emulated with ONEDNN_MAX_CPU_ISA=AVX2),
    an explicit bf16 engine keeps nn.Linear layers and still serves, instead of crashing."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16", num_blocks=32))
    assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
    tokens, _ = _greedy(engine, [list(range(200, 230))])
    assert len(tokens[0]) == 8


@requires_packing
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(layer.weight, layer.bias)(x), layer(x), atol=2e-2, rtol=1e-2)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logits: list[torch.Tensor] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        logits.append(engine.last_logits[1])
    return [tokens[str(i)] for i in range(len(prompts))], logits


@requires_packing
@pytest.mark.parametrize("name", ["llama", "qwen2", "opt"])  # untied head, tied head, OPT's tied head
def test_engine_packs_bf16_layers_and_keeps_outputs(name, tiny_model_dir):
    path = str(tiny_model_dir(name))
    prompts = [list(range(200, 230)), list(range(500, 517))]
    runs = {}
    for packed in (False, True):
        engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", num_blocks=32, packed_weights=packed))
        layers = [m for m in engine.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
        assert all(isinstance(m, PackedLinear) for m in layers) == packed
        assert (engine.model.lm_head is not None) or not packed  # a tied head gets its packed copy
        runs[packed] = _greedy(engine, prompts)
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)


@requires_fp32_packing
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 80, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(layer.weight, layer.bias)(x), layer(x), atol=1e-5, rtol=1e-5)


@requires_fp32_packing
@pytest.mark.parametrize("packed_s,plain_s,pays", [(1.0, 2.0, True), (2.0, 1.0, False), (0.95, 1.0, False)])
def test_float32_packs_only_where_the_timing_says_it_pays(monkeypatch, packed_s, plain_s, pays):
    """float32 packing is decided by timing oneDNN against F.linear (MKL) at start: it must be
    clearly faster (10%), since MKL wins on some CPUs and packing a tied head costs memory."""
    monkeypatch.setattr(packed_linear, "_time_packed_vs_plain", lambda weight: (packed_s, plain_s))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    assert packing_pays(model, torch.float32, torch.device("cpu")) is pays
    assert packing_pays(model, torch.float16, torch.device("cpu")) is False


@requires_fp32_packing
def test_float32_engine_packed_keeps_outputs(tiny_model_dir, monkeypatch):
    """A float32 engine with packed layers gives the unpacked engine's tokens and logits (to
    float32 summation order)."""
    monkeypatch.setattr(packed_linear, "_time_packed_vs_plain", lambda weight: (1.0, 2.0))
    path = str(tiny_model_dir("llama"))
    prompts = [list(range(200, 230)), list(range(500, 517))]
    runs = {}
    for packed in (False, True):
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_blocks=32, packed_weights=packed))
        assert any(isinstance(m, PackedLinear) for m in engine.model.modules()) == packed
        runs[packed] = _greedy(engine, prompts)
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@requires_packing
def test_pack_counts_every_linear_and_a_tied_head():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 8)
            self.proj = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False))
            self.lm_head = None

    model = Tiny().to(torch.bfloat16)
    assert pack_linear_layers(model) == 3
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(model.lm_head(x), F.linear(x, model.embed_tokens.weight), atol=2e-2, rtol=1e-2)
