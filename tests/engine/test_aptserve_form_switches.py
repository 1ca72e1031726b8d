"""Greedy parity when `aptserve` switches a request's cache form mid-generation (float32).

`tests/engine/test_hybrid_cache.py` checks a forced form (`cache_form="hidden"`) and
conversions made by hand; this file checks the policy's own switches: under a pool that binds,
`aptserve` (with a rebuild priced near zero, so HIDDEN pays) admits requests in HIDDEN,
preempts and converts them, and re-prefills them in the form it then picks. Every request's
greedy tokens must be those of the same prompts run KV-only, and the test fails unless at
least one request really changed form after it had produced tokens (otherwise it would only
repeat the forced-form test). The Makefile runs this file a second time as an AVX2-only host
(`make test-avx2`): the rebuild's K/V projection and the partial attention of HIDDEN rows run
op by op through torch's GEMMs, whose kernels the ISA picks.
"""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cost_model import CostModel, PhaseFit
from engine.scheduling import CacheForm

STEPS = 10
REQUESTS = 6


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(49152) for _ in range(rng.randrange(10, 40))] for _ in range(REQUESTS)]


def _run(engine: LLMEngine) -> tuple[dict[str, list[int]], int]:
    """Greedy tokens per request and how many times a request that had already produced tokens
    was next seen in the other form; the KV manager's invariants are checked every step."""
    requests = [
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
        for i, p in enumerate(_prompts())
    ]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    form_with_tokens: dict[str, CacheForm] = {}
    switches = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.kv.check_invariants()
        for r in requests:
            if not r.num_output_tokens:
                continue
            seen = form_with_tokens.get(r.request_id)
            switches += seen is not None and seen is not r.cache_form
            form_with_tokens[r.request_id] = r.cache_form
    return tokens, switches


@pytest.mark.parametrize(
    ("name", "expand", "rho", "priced"),
    [
        ("opt", False, 1e-9, True),  # learned positions, biases; HIDDEN kept with conversions priced
        ("opt", False, 0.0, False),  # a free rebuild: the paper's rule keeps HIDDEN too
        ("llama", True, 1e-9, True),  # RoPE at each token's original position, MHA by expansion
    ],
)
def test_aptserve_form_switches_keep_the_kv_only_tokens(name, expand, rho, priced, tiny_model_dir, tmp_path):
    path = str(tiny_model_dir(name))
    base = dict(model=path, dtype="float32", block_size=16, max_num_batched_tokens=64, kv_heads_expand=expand)
    reference, _ = _run(LLMEngine(EngineConfig(**base, num_blocks=64, cache_form="kv")))
    cost = tmp_path / "cost.json"  # prices a re-prefill (0.1 ms a token) without profiling the tiny model
    CostModel(PhaseFit(1e-4, 1e-8, 1e-3), PhaseFit(1e-4, 1e-8, 1e-3), 1e9).save(cost)
    engine = LLMEngine(
        EngineConfig(
            **base,
            num_blocks=12,  # six requests of up to 50 tokens: the pool binds
            policy="aptserve",
            aptserve_rho=rho,
            aptserve_price_switches=priced,
            cost_model_path=str(cost),
        )
    )
    tokens, switches = _run(engine)
    assert engine.scheduler.policy.hidden_chosen > 0
    assert switches > 0, "no request changed form mid-generation: nothing was checked beyond a forced form"
    assert tokens == reference
