"""Partial residency with the host source (eLLM's per-layer swap-in): the oldest tokens' K/V
leave the pool for host swap space and every layer reads them back from there; greedy tokens
equal full residency's on tiny Llama, OPT and Qwen3 (float32) and the default model, for any
ratio, a ratio changing mid-generation, chunked prefills mixed with host-read decodes, a pool
that binds (hypothesis), a host pool too small for every prefix (some tables fall back to
rebuilding, in the same steps as host-read ones) and the vLLM-Swap baseline around it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.kv import PartialResidency
from tests.conftest import requires_cxx
from tests.engine.test_partial_residency import _engine, _generate, _prompts

HOST = dict(uncached_source="host", num_host_blocks=256)


def _sources(engine) -> list[tuple[int, int]]:
    """Record, per step, (tokens read from host, tokens rebuilt) across the batch."""
    seen: list[tuple[int, int]] = []
    execute = type(engine.runner).execute
    bs = engine.kv.block_size

    def spy(items, wait_layer=None):
        tables = [engine.kv.table(it.request) for it in items]
        host = sum(len(t.host_prefix) for t in tables) * bs
        seen.append((host, sum(t.transient for t in tables) - host))
        return execute(engine.runner, items, wait_layer)

    engine.runner.execute = spy
    return seen


@pytest.mark.parametrize("name", ["llama", "opt", "qwen3"])
def test_greedy_tokens_equal_full_residency(name, tiny_model_dir):
    path = tiny_model_dir(name)
    full = _generate(_engine(path, 0.0), _prompts())
    for ratio in (0.25, 0.5, 0.9):
        engine = _engine(path, ratio, **HOST)
        seen = _sources(engine)
        assert _generate(engine, _prompts()) == full, ratio
        assert max(h for h, _ in seen) > 0 and not any(r for _, r in seen), ratio  # read, never rebuilt
        del engine.runner.execute


def test_ratio_changing_mid_generation(tiny_model_dir):
    """r moves 0.5 -> 0.9 -> 0.1 -> 0 -> 0.6 -> 0.25 while requests decode; without the prefix
    cache the entries coming back are copied back from host."""
    path = tiny_model_dir("llama")
    full = _generate(_engine(path, 0.0), _prompts(), max_tokens=24)
    schedule = {3: 0.9, 6: 0.1, 9: 0.0, 12: 0.6, 15: 0.25}

    def change(engine, step):
        if step in schedule:
            engine.kv.component(PartialResidency).set_ratio(schedule[step])

    for caching in (True, False):
        engine = _engine(path, 0.5, enable_prefix_caching=caching, **HOST)
        assert _generate(engine, _prompts(), max_tokens=24, on_step=change) == full, caching


def test_small_host_pool_mixes_host_and_rebuilt_prefixes(tiny_model_dir):
    """Two host blocks for four requests: the first prefixes go to host, the rest fall back to
    rebuilding, and steps carry both kinds next to chunked prefills."""
    path = tiny_model_dir("llama")
    full = _generate(_engine(path, 0.0), _prompts(), max_tokens=16)
    engine = _engine(path, 0.5, uncached_source="host", num_host_blocks=2)
    seen = _sources(engine)
    assert _generate(engine, _prompts(), max_tokens=16) == full
    assert any(h and r for h, r in seen)
    del engine.runner.execute


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.lists(st.tuples(st.integers(2, 80), st.integers(0, 12)), min_size=2, max_size=5),
    ratio=st.sampled_from([0.25, 0.5, 0.9]),
    host_blocks=st.sampled_from([4, 256]),
    seed=st.integers(0, 1000),
)
def test_memory_pressure_preemption(tiny_model_dir, requests, ratio, host_blocks, seed):
    """Prompts of any lengths arriving at any steps into a pool too small for the batch, host
    pools small and large: tokens equal full residency with a pool large enough for all."""
    path = tiny_model_dir("llama")
    prompts = _prompts(seed, [n for n, _ in requests])
    arrive_at = [step for _, step in requests]
    full = _generate(_engine(path, 0.0), prompts)
    tight = _engine(
        path, ratio, num_blocks=12, max_num_batched_tokens=48, uncached_source="host", num_host_blocks=host_blocks
    )
    assert _generate(tight, prompts, arrive_at=arrive_at) == full


def test_swap_policy_around_host_prefixes(tiny_model_dir):
    """vLLM-Swap's whole-request moves share the host pool with the host-kept prefixes."""
    path = tiny_model_dir("llama")
    prompts = _prompts(3, (70, 60, 50, 40))
    full = _generate(_engine(path, 0.0), prompts, max_tokens=20)
    engine = _engine(path, 0.5, policy="swap", num_blocks=12, max_num_batched_tokens=48, **HOST)
    seen = _sources(engine)
    swaps_before = engine.stats.swap_outs
    assert _generate(engine, prompts, max_tokens=20) == full
    assert engine.stats.swap_outs > swaps_before and max(h for h, _ in seen) > 0
    del engine.runner.execute


def test_copy_path_without_in_place_reads(tiny_model_dir):
    """`host_prefix_in_place=False` (what a GPU does): the swap space is its own tensor and each
    layer copies the prefixes into the scratch, attended apart and merged; tokens still equal."""
    path = tiny_model_dir("llama")
    full = _generate(_engine(path, 0.0), _prompts())
    for ratio in (0.5, 0.9):
        engine = _engine(path, ratio, host_prefix_in_place=False, **HOST)
        assert engine.storage.host_offset is None
        seen = _sources(engine)
        assert _generate(engine, _prompts()) == full, ratio
        assert max(h for h, _ in seen) > 0, ratio
        del engine.runner.execute


def _logits_per_step(engine, prompts, max_tokens: int, graph_steps: list[int]) -> list[dict]:
    """Each step's logits by request; `graph_steps` gets, per step run through the compiled
    decode layers, the tokens its rows read from host."""
    run = engine.runner._execute_decode_graph

    def spy(items):
        graph_steps.append(sum(len(engine.kv.table(it.request).host_prefix) for it in items))
        return run(items)

    engine.runner._execute_decode_graph = spy
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{id(engine)}-{i}", p, params)
    steps = []
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
        if engine.last_logits is not None:
            reqs, logits = engine.last_logits
            steps.append({r.request_id.split("-")[-1]: row.clone() for r, row in zip(reqs, logits)})
    del engine.runner._execute_decode_graph
    return steps


@requires_cxx
@pytest.mark.parametrize("kernel", ["cpp", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_read_steps_stay_on_the_compiled_decode_path(tiny_model_dir, kernel, dtype):
    """The serving kernels with compiled decoder layers: the host swap space is the pool
    tensor's tail and a host-kept prefix is read in place through the block table, so a
    decode-only step whose rows read prefixes from host runs through the compiled layers (as a
    fully resident one does), and its logits are *bitwise* those of full residency, bf16
    included: the same kernel reads the same K/V bytes in the same order, only from other
    block ids (the pool does not bind here, so both runs schedule the same batches)."""
    path = tiny_model_dir("llama")
    options = dict(attention=kernel, compile_layers=True, dtype=dtype)
    full_graph: list[int] = []
    full = _logits_per_step(_engine(path, 0.0, **options), _prompts(), 16, full_graph)
    engine = _engine(path, 0.5, **options, **HOST)
    assert engine.runner.decode_kernel == kernel and engine.runner.decode_graph is not None
    assert engine.storage.host_offset == engine.kv.pool.num_blocks
    graph: list[int] = []
    partial = _logits_per_step(engine, _prompts(), 16, graph)
    assert len(partial) == len(full)
    for step, (a, b) in enumerate(zip(partial, full, strict=True)):
        assert a.keys() == b.keys(), step
        for rid in a:
            assert torch.equal(a[rid], b[rid]), (step, rid)
    assert len(graph) == len(full_graph) and max(graph) > 0  # host-read steps took the compiled path


def test_default_model_float32():
    prompts = [[1000 + 37 * i for i in range(n)] for n in (40, 75)]
    full = _generate(_engine("default", 0.0), prompts, max_tokens=16)
    assert _generate(_engine("default", 0.5, **HOST), prompts, max_tokens=16) == full


def test_unknown_source_is_refused(tiny_model_dir):
    from tests.engine.test_partial_residency import _build

    with pytest.raises(ValueError, match="uncached source"):
        _build(tiny_model_dir("llama"), 0.5, uncached_source="disk")


def test_triton_kernels_read_host_prefixes(bare_tiny_model_dir, kernel_device, monkeypatch):
    """attention="triton": the host-kept prefix rows are attended by the Triton prefix kernel
    (appended after the step's own K/V), merged with the paged rest; greedy tokens equal the
    reference engine's with full residency. Under the interpreter one short case."""
    import kernels.triton

    calls = []
    attend = kernels.triton.attend_transient
    monkeypatch.setattr(kernels.triton, "attend_transient", lambda *a: calls.append(1) or attend(*a))
    path = bare_tiny_model_dir("llama")
    prompts = _prompts(lengths=(5, 37))
    full = _generate(_engine(path, 0.0), prompts, max_tokens=6)
    engine = _engine(path, 0.5, attention="triton", device=kernel_device, **HOST)
    seen = _sources(engine)
    assert _generate(engine, prompts, max_tokens=6) == full
    assert max(h for h, _ in seen) > 0 and calls
    del engine.runner.execute
