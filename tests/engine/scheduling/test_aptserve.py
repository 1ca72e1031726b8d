"""The aptserve policy in the engine (float32, tiny models): whatever it packs, preempts and
converts, every request's greedy tokens are FCFS's; it picks HIDDEN under memory pressure
on an MHA model when the penalty is small, never on a GQA model where HIDDEN saves nothing,
and the KV manager's invariants hold after every step."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.scheduling import CacheForm

STEPS = 10


def _run(path, policy: str, **config) -> tuple[dict, LLMEngine, set]:
    config = dict(dtype="float32", num_blocks=12, block_size=16, max_num_batched_tokens=64) | config
    engine = LLMEngine(EngineConfig(model=str(path), policy=policy, **config))
    rng = random.Random(7)
    for i in range(6):
        prompt = [rng.randrange(49152) for _ in range(rng.randrange(10, 40))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(6)}
    forms: set = set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        forms |= {r.cache_form for r in engine.scheduler.running}
        engine.kv.check_invariants()
    return tokens, engine, forms


@pytest.mark.parametrize("rho", [1e-9, 1e3])
def test_aptserve_keeps_fcfs_tokens_and_picks_hidden_on_mha(rho, tiny_model_dir):
    """12 blocks for six requests: the packing preempts and converts; a tiny penalty makes
    HIDDEN pay on MHA (OPT), a huge one never does."""
    path = tiny_model_dir("opt")
    reference, _, _ = _run(path, "fcfs", num_blocks=64)
    tokens, engine, forms = _run(path, "aptserve", aptserve_rho=rho)
    assert tokens == reference
    assert engine.stats.preemptions > 0  # the pool really was the bottleneck
    if rho < 1:
        assert CacheForm.HIDDEN in forms and engine.scheduler.policy.hidden_chosen > 0
    else:
        assert forms == {CacheForm.KV} and engine.scheduler.policy.hidden_chosen == 0


def test_aptserve_never_picks_hidden_where_it_saves_nothing(tiny_model_dir):
    path = tiny_model_dir("llama")  # GQA: a hidden row is as large as K+V
    reference, _, _ = _run(path, "fcfs", num_blocks=64)
    tokens, engine, forms = _run(path, "aptserve", aptserve_rho=1e-9)
    assert tokens == reference
    assert forms == {CacheForm.KV} and engine.scheduler.policy.hidden_chosen == 0


def test_aptserve_refuses_a_forced_form(tiny_model_dir):
    with pytest.raises(ValueError, match="cache_form='auto'"):
        LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir("opt")), dtype="float32", num_blocks=12, policy="aptserve", cache_form="kv"
            )
        )
