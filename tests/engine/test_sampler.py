"""Tests for engine.sampling (SamplingParams) and engine.sampler."""

from __future__ import annotations

import math

import pytest
import torch

from engine import sampler as sampler_module
from engine.sampler import Sampler, SamplerOutput, make_generator
from engine.sampling import SamplingParams as SP  # noqa: N817

V = 1000


def rand_logits(n: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def draw(logits_row: torch.Tensor, params: SP, n: int, seed: int = 0, **kw) -> torch.Tensor:
    """n independent samples for one row: the row repeated n times in one batch."""
    out = Sampler(seed).sample(logits_row.expand(n, -1).contiguous(), [params] * n, [None] * n, **kw)
    return torch.tensor(out.token_ids)


def small_vocab(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SP(**kwargs)


def test_params_normalisation_and_greedy():
    p = SP(stop="###", stop_token_ids=[5, 6])
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6)
    assert SP(stop=["a", "b"]).stop == ("a", "b")
    assert hash(SP(stop=["a"])) == hash(SP(stop=("a",)))
    assert SP(temperature=0).is_greedy and SP(top_k=1).is_greedy
    assert not SP().is_greedy and not SP(top_k=-1).is_greedy
    with pytest.raises(AttributeError):
        SP().temperature = 0.5  # frozen


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = rand_logits(16)
    out = Sampler().sample(logits, [SP(temperature=0)] * 16, [None] * 16)
    assert isinstance(out, SamplerOutput) and out.logprobs is None
    assert out.token_ids == logits.argmax(1).tolist()


def test_top_k_1_is_greedy():
    logits = rand_logits(16, seed=1)
    out = Sampler().sample(logits, [SP(top_k=1, temperature=1.3)] * 16, [None] * 16)
    assert out.token_ids == logits.argmax(1).tolist()


def test_tiny_temperature_is_greedy():
    logits = rand_logits(4, seed=2) * 10
    out = Sampler().sample(logits, [SP(temperature=1e-30)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(1).tolist()


def test_logits_not_modified():
    logits = rand_logits(8)
    before = logits.clone()
    params = [
        SP(temperature=0),
        SP(temperature=0.5),
        SP(top_p=0.5),
        SP(top_k=5),
        SP(min_p=0.1),
        SP(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01),
        SP(),
        SP(temperature=2.0),
    ]
    Sampler().sample(logits, params, [None] * 8, banned_token_ids=[[1, 2]] * 8)
    assert torch.equal(logits, before)
    # All rows sampled (the no-copy path) with temperature 1 and bans.
    Sampler().sample(logits, [SP()] * 8, [None] * 8, banned_token_ids=[[int(logits[i].argmax())] for i in range(8)])
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- seeding


SEEDED_VARIANTS = [
    SP(seed=7),
    SP(seed=7, temperature=0.6),
    SP(seed=7, top_p=0.8),
    SP(seed=7, top_k=20),
    SP(seed=7, min_p=0.05),
    SP(seed=7, top_k=30, top_p=0.9, min_p=0.01, temperature=1.4),
]
OTHERS = [
    SP(temperature=0),
    SP(top_p=0.5),
    SP(seed=99, top_k=3),
    SP(),
    SP(min_p=0.2),
    SP(temperature=0.3, seed=1),
    SP(top_k=50, seed=3),
    SP(top_k=60, top_p=0.9),
]


@pytest.mark.parametrize("params", SEEDED_VARIANTS)
def test_seeded_independent_of_batch(params):
    steps = [rand_logits(len(OTHERS) + 1, seed=100 + s, scale=2.0) for s in range(20)]

    def run(batched: bool, position: int) -> list[int]:
        sampler = Sampler(seed=position)  # different shared generator too
        gen = make_generator(params)
        other_gens = [make_generator(p) for p in OTHERS]
        got = []
        for logits in steps:
            if not batched:
                got += sampler.sample(logits[:1], [params], [gen]).token_ids
                continue
            rows = [logits[1 + i] for i in range(len(OTHERS))]
            rows.insert(position, logits[0])
            ps = list(OTHERS)
            ps.insert(position, params)
            gs = list(other_gens)
            gs.insert(position, gen)
            got.append(sampler.sample(torch.stack(rows), ps, gs).token_ids[position])
        return got

    alone = run(False, 0)
    assert len(set(alone)) > 1  # actually random
    assert run(True, 0) == alone
    assert run(True, 3) == alone
    assert run(True, len(OTHERS)) == alone


def test_unseeded_sampler_reproducible_from_its_seed():
    logits = rand_logits(32, scale=1.0)
    a = Sampler(5).sample(logits, [SP()] * 32, [None] * 32).token_ids
    b = Sampler(5).sample(logits, [SP()] * 32, [None] * 32).token_ids
    c = Sampler(6).sample(logits, [SP()] * 32, [None] * 32).token_ids
    assert a == b and a != c


def test_top_p_rejection_equals_sort(monkeypatch):
    """The rejection path and the exact sort fallback pick the same token from the same noise."""
    logits = torch.cat([rand_logits(64, seed=3, scale=1.0), rand_logits(64, seed=4, scale=4.0)])
    params = [SP(top_p=p, seed=i) for i, p in enumerate([0.1, 0.5, 0.9, 0.99] * 32)]

    def run() -> list[int]:
        return Sampler(0).sample(logits, params, [make_generator(p) for p in params]).token_ids

    monkeypatch.setattr(sampler_module, "_NUCLEUS_CANDIDATES", 1)  # force the full-vocab path
    fast = run()
    monkeypatch.setattr(sampler_module, "_TOP_P_MAX_ROUNDS", 0)
    assert run() == fast


# ----------------------------------------------------------------------------- support


# (nucleus candidates, rejection rounds): candidate path, rejection path, sort fallback.
TOP_P_PATHS = [(256, 8), (1, 8), (1, 0)]


@pytest.fixture(params=TOP_P_PATHS, ids=["candidates", "rejection", "sort"])
def top_p_path(request, monkeypatch):
    candidates, rounds = request.param
    monkeypatch.setattr(sampler_module, "_NUCLEUS_CANDIDATES", candidates)
    monkeypatch.setattr(sampler_module, "_TOP_P_MAX_ROUNDS", rounds)


def test_top_p_restricts_support(top_p_path):
    row = small_vocab([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    toks = draw(row, SP(top_p=0.75), 4000)
    assert set(toks.tolist()) == {0, 1}
    frac0 = (toks == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.04


def test_top_p_after_top_k_renormalises():
    row = small_vocab([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    # top-3 renormalised: 0.556, 0.333, 0.111 -> mass before id 2 is 0.889 < 0.9: kept.
    assert set(draw(row, SP(top_k=3, top_p=0.9), 4000).tolist()) == {0, 1, 2}
    assert set(draw(row, SP(top_k=2), 4000).tolist()) == {0, 1}


def test_min_p_restricts_support(top_p_path):
    row = small_vocab([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    assert set(draw(row, SP(min_p=0.15), 4000).tolist()) == {0, 1, 2}  # p >= 0.075
    assert set(draw(row, SP(min_p=0.15, temperature=0.5), 4000).tolist()) <= {0, 1, 2}
    # Combined with top-p (min-p 0.25 -> p >= 0.125: ids 0, 1) and with top-k.
    assert set(draw(row, SP(min_p=0.25, top_p=0.95), 4000).tolist()) == {0, 1}
    assert set(draw(row, SP(min_p=0.15, top_k=5), 4000).tolist()) == {0, 1, 2}


@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95])
def test_top_p_distribution_matches_nucleus(top_p_path, top_p):
    probs = torch.softmax(torch.randn(40, generator=torch.Generator().manual_seed(3)) * 1.5, 0)
    order = probs.argsort(descending=True)
    sorted_p = probs[order]
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    target = torch.zeros(40, dtype=torch.float64)
    target[order[keep]] = sorted_p[keep].double() / sorted_p[keep].double().sum()
    n = 20000
    counts = torch.bincount(draw(probs.log().unsqueeze(0), SP(top_p=top_p), n, seed=4), minlength=40).double()
    assert set(counts.nonzero().flatten().tolist()) <= set(order[keep].tolist())
    assert (counts / n - target).abs().max() < 0.02


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20000
    toks = draw(logits, SP(temperature=temperature), n, seed=11)
    counts = torch.bincount(toks, minlength=5).double()
    expected = torch.softmax(logits[0].double() / temperature, 0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (chi2, counts.tolist(), expected.tolist())  # df=4: p(chi2>25) ~ 5e-5


def test_large_vocab_distribution():
    """Plain sampling over a realistic vocab size: the top token's frequency matches its prob."""
    logits = rand_logits(1, v=49152, seed=5, scale=4.0)
    p_top = torch.softmax(logits[0], 0).max().item()
    toks = draw(logits, SP(), 3000, seed=2)
    freq = (toks == int(logits.argmax())).float().mean().item()
    assert abs(freq - p_top) < 4 * math.sqrt(p_top * (1 - p_top) / 3000) + 1e-3


# ----------------------------------------------------------------------------- bans & logprobs


@pytest.mark.parametrize(
    "params",
    [SP(temperature=0), SP(), SP(top_p=0.9), SP(top_k=3), SP(min_p=0.1), SP(temperature=0.5, top_k=10, top_p=0.95)],
)
def test_banned_ids_never_sampled(params):
    row = small_vocab([0.6, 0.25, 0.1, 0.03, 0.02])
    n = 2000
    banned = [[0, 3]] * n
    toks = draw(row, params, n, banned_token_ids=banned)
    assert not set(toks.tolist()) & {0, 3}
    # Only the banned rows are affected.
    logits = row.expand(2, -1).contiguous()
    out = Sampler().sample(logits, [SP(temperature=0)] * 2, [None] * 2, banned_token_ids=[[0], []])
    assert out.token_ids == [1, 0]


def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(6, seed=9)
    params = [
        SP(temperature=0, logprobs=True),
        SP(temperature=0.5, logprobs=True),
        SP(top_p=0.5),
        SP(top_k=5, logprobs=True),
        SP(min_p=0.3, logprobs=True),
        SP(logprobs=True),
    ]
    out = Sampler().sample(logits, params, [None] * 6, banned_token_ids=[[], [], [], [], [], [0]])
    ref = torch.log_softmax(logits, dim=1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        if params[i].logprobs:
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
        else:
            assert math.isnan(lp)


def test_mixed_batch_and_dtype():
    logits = rand_logits(5).to(torch.bfloat16)
    params = [SP(temperature=0), SP(), SP(top_p=0.9), SP(top_k=2), SP(temperature=0)]
    out = Sampler().sample(logits, params, [None] * 5)
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert out.token_ids[4] == int(logits[4].float().argmax())
    assert out.token_ids[3] in logits[3].float().topk(2).indices.tolist()


def test_row_count_mismatch_rejected():
    with pytest.raises(ValueError):
        Sampler().sample(rand_logits(2), [SP()], [None])
