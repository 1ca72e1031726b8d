"""Decode-only steps through compiled decoder layers (models/decode_graph.py): the same logits
as the op-by-op path, every batch shape served by one graph, and the cases that keep the
op-by-op path."""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner import ModelRunner
from tests.conftest import requires_cxx

pytestmark = requires_cxx


def _engine(path, compile_layers=True, dtype="bfloat16", attention="cpp") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype=dtype,
            num_blocks=96,
            block_size=8,
            attention=attention,
            compile_layers=compile_layers,
        )
    )


@pytest.fixture
def graph_steps(monkeypatch) -> list[int]:
    """Batch sizes of the steps that went through the compiled layers (a spy that calls through)."""
    sizes: list[int] = []
    real = ModelRunner._execute_decode_graph

    def spy(self, items):
        sizes.append(len(items))
        return real(self, items)

    monkeypatch.setattr(ModelRunner, "_execute_decode_graph", spy)
    return sizes


def _run(engine: LLMEngine, prompts: list[list[int]], arrive: dict[int, int] | None = None) -> list[dict]:
    """Greedy decode; prompt i is added before step `arrive[i]` (default 0). Returns each
    step's {request id: logits}."""
    arrive = arrive or {}
    steps: list[dict] = []
    pending = dict(enumerate(prompts))
    while pending or engine.has_unfinished():
        for i in [i for i in pending if arrive.get(i, 0) <= len(steps)]:
            engine.add_request(str(i), pending.pop(i), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        engine.step()
        reqs, logits = engine.last_logits if engine.last_logits is not None else ([], [])
        steps.append(dict(zip((r.request_id for r in reqs), logits)))
        engine.last_logits = None
    return steps


@pytest.mark.parametrize("attention", ["cpp", "fused"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_same_logits_as_op_by_op(name, attention, tiny_model_dir, graph_steps):
    """bf16, staggered arrivals (decode batches of several sizes, contexts over several
    chunks): compared step by step until a near-tie flips a greedy token."""
    path = tiny_model_dir(name)
    rng = random.Random(3)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (70, 3, 150, 17, 9)]
    arrive = {1: 2, 3: 5, 4: 6}
    graph = _run(_engine(path, attention=attention), prompts, arrive)
    assert len(graph_steps) >= 5 and min(graph_steps) < max(graph_steps)
    eager = _run(_engine(path, compile_layers=False, attention=attention), prompts, arrive)
    diverged: set[str] = set()
    for g, e in zip(graph, eager, strict=True):
        for rid in e.keys() - diverged:
            torch.testing.assert_close(g[rid], e[rid], atol=0.1, rtol=0.05)
            if g[rid].argmax() != e[rid].argmax():
                diverged.add(rid)
    assert len(diverged) < len(prompts)


@pytest.mark.parametrize("attention", ["cpp", "fused"])
def test_float32_graph_matches_op_by_op_closely(tiny_model_dir, graph_steps, attention):
    """In float32 the only differences are float summation order."""
    path = tiny_model_dir("llama")
    prompts = [list(range(100, 170)), list(range(7, 40))]
    graph = _run(_engine(path, dtype="float32", attention=attention), prompts)
    assert graph_steps
    eager = _run(_engine(path, compile_layers=False, dtype="float32", attention=attention), prompts)
    for g, e in zip(graph, eager, strict=True):
        for rid in e:
            torch.testing.assert_close(g[rid], e[rid], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["cpp", "fused"])
def test_one_graph_for_every_batch(tiny_model_dir, graph_steps, attention):
    """After the engine's warm-up no step recompiles: one sequence alone, one chunk, many
    chunks, growing and shrinking batches. A 1-token prompt (no context yet) arriving in a
    decode batch takes the op-by-op path for that step."""
    engine = _engine(tiny_model_dir("llama"), attention=attention)
    prompts = [[5], list(range(200, 290)), list(range(3, 9)), [11], list(range(60, 80))]
    with torch._dynamo.config.patch(error_on_recompile=True):
        _run(engine, prompts, arrive={1: 4, 2: 6, 3: 8, 4: 30})
    assert 1 in graph_steps and max(graph_steps) >= 3


def test_cases_that_keep_the_op_by_op_path(tiny_model_dir):
    assert _engine(tiny_model_dir("opt")).runner.decode_graph is None  # no layer `decode` for OPT
    assert _engine(tiny_model_dir("llama"), compile_layers=False).runner.decode_graph is None
    reference = LLMEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), dtype="bfloat16", attention="reference", num_blocks=32)
    )
    assert reference.runner.decode_graph is None


def test_warm_up_leaves_nothing_to_compile(tiny_model_dir):
    """The engine's warm-up compiles the layer graph exactly as steps call it: the first
    decode-only steps reuse that one entry. The process-wide graph cache is cleared first, so
    a recompile that earlier tests' engines already paid for cannot hide here (the Inductor
    cache is hot, so compiling again costs little). Before the fix, the warm-up's block table
    was a normal tensor and a step's an inference tensor: one recompile at the first step."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from engine.models import decode_graph

    decode_graph._compiled_layer.cache_clear()
    engine = _engine(tiny_model_dir("llama"))
    code = engine.runner.decode_graph._layer._torchdynamo_orig_callable.__code__
    assert len(_debug_get_cache_entry_list(code)) == 1  # compiled once, at start
    with torch._dynamo.config.patch(error_on_recompile=True):
        _run(engine, [list(range(40, 75)), list(range(3, 12))])
    assert len(_debug_get_cache_entry_list(code)) == 1
