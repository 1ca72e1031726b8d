"""Length-distribution fitting, arrival processes, determinism of workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.arrivals import ArrivalSpec, gamma_times, load_trace, poisson_times
from loadgen.workloads.build import WorkloadConfig, build_workload
from loadgen.workloads.datasets import PROFILES
from loadgen.workloads.jsonl import load_jsonl
from loadgen.workloads.lengths import lognormal_from_moments, uniform


@pytest.mark.parametrize("mean,std", [(222.76, 256.36), (234.51, 268.50), (90.50, 148.52), (784.14, 151.17)])
def test_lognormal_fit_reproduces_published_moments(mean, std):
    dist = lognormal_from_moments(mean, std)
    assert dist.mean() == pytest.approx(mean)
    x = np.random.default_rng(1).lognormal(dist.a, dist.b, size=400_000)  # before rounding and clipping
    assert x.mean() == pytest.approx(mean, rel=0.02)
    assert x.std() == pytest.approx(std, rel=0.06)


def test_clipping_and_scaling():
    dist = PROFILES["sharegpt"].prompt.clipped(512)
    s = dist.sample(np.random.default_rng(0), 50_000)
    assert s.min() >= 4 and s.max() <= 512
    half = PROFILES["sharegpt"].prompt.scaled(0.5)
    assert half.mean() == pytest.approx(PROFILES["sharegpt"].prompt.mean() / 2)
    be = uniform(512, 1024).scaled(0.25)
    sb = be.sample(np.random.default_rng(0), 10_000)
    assert sb.min() == 128 and sb.max() == 256


def test_poisson_and_gamma_rates_and_burstiness():
    rng = np.random.default_rng(3)
    t = poisson_times(5.0, 2000.0, rng)
    assert len(t) / 2000.0 == pytest.approx(5.0, rel=0.05)
    assert all(0 <= a < b < 2000.0 for a, b in zip(t, t[1:]))
    gaps = np.diff(gamma_times(5.0, 4.0, 4000.0, np.random.default_rng(4)))
    assert gaps.mean() == pytest.approx(0.2, rel=0.15)
    assert gaps.std() / gaps.mean() == pytest.approx(4.0, rel=0.2)


def test_trace_replay(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": v}) for v in (100.5, 100.0, 103.0, 200.0)))
    assert load_trace(p, duration_s=50.0) == [0.0, 0.5, 3.0]
    bad = tmp_path / "bad.txt"
    bad.write_text("1.0\nnot-a-number\n")
    with pytest.raises(ValueError, match="bad.txt:2"):
        load_trace(bad)


def _summary(cfg):
    w = build_workload(cfg)
    subs = list(w.open_loop) + [s for src in w.sources for s in src.start()]
    return [(round(s.at_s, 9), s.spec.request_id, s.spec.prompt_len, s.spec.max_tokens) for s in subs]


@pytest.mark.parametrize("name", ["sharegpt", "lmsys", "code", "summarisation", "rt-be", "sessions"])
def test_deterministic_given_seed(name):
    cfg = WorkloadConfig(name, ArrivalSpec("poisson", 2.0), 30.0, seed=7, max_len=2048)
    assert _summary(cfg) == _summary(cfg)
    other = _summary(WorkloadConfig(name, ArrivalSpec("poisson", 2.0), 30.0, seed=8, max_len=2048))
    assert _summary(cfg) != other


def test_context_limit_is_respected():
    w = build_workload(WorkloadConfig("summarisation", ArrivalSpec("poisson", 5.0), 60.0, max_len=2048))
    assert all(s.spec.prompt_len + s.spec.max_tokens <= 2048 for s in w.open_loop)


def test_sessions_turns_wait_for_reading_and_typing():
    w = build_workload(WorkloadConfig("sessions", ArrivalSpec("poisson", 1.0), 600.0, seed=1, turns_mean=3))
    src = next(s for s in w.sources if s.turns >= 2)
    first = src.start()[0]
    assert first.typing_at_s <= first.at_s
    nxt = src.on_finish(first.spec, first.at_s + 5.0, output_tokens=100)[0]
    reading = 100 * 0.75 / 250 * 60
    assert nxt.typing_at_s == pytest.approx(first.at_s + 5.0 + reading)
    assert nxt.at_s == pytest.approx(nxt.typing_at_s + nxt.spec.prompt_len * 0.75 / 40 * 60)
    assert nxt.spec.session_id == first.spec.session_id and nxt.spec.turn == 1


def _walk_user(user, n: int) -> list[tuple[str, int, int, float]]:
    """A user's first n requests, each answered 1 s after it is sent with 20 tokens."""
    sub, out = user.start()[0], []
    for _ in range(n):
        out.append((sub.spec.session_id, sub.spec.turn, sub.spec.prompt_len, sub.typing_at_s))
        sub = user.on_finish(sub.spec, sub.at_s + 1.0, output_tokens=20)[0]
    return out


def test_closed_session_users_start_a_new_session_after_the_last_turn():
    cfg = WorkloadConfig("sessions", ArrivalSpec("closed", users=3), 10_000.0, seed=4, turns_mean=2)
    users = build_workload(cfg).sources
    assert len(users) == 3
    first = users[0].start()[0]
    assert first.typing_at_s == 0.0 and first.at_s > 0.0  # typing starts at once, the request follows it
    seen = _walk_user(build_workload(cfg).sources[0], 12)
    firsts = [sid for sid, turn, _, _ in seen if turn == 0]
    assert firsts[:2] == ["u0-s0", "u0-s1"]
    assert all(t == pt + 1 for (s, t, _, _), (ps, pt, _, _) in zip(seen[1:], seen) if s == ps)
    assert seen == _walk_user(build_workload(cfg).sources[0], 12)  # deterministic given the seed


def test_be_backlog_refills_by_batch():
    w = build_workload(WorkloadConfig("be", ArrivalSpec(), 100.0, be_batch=3))
    src = w.sources[0]
    batch = src.start()
    assert len(batch) == 3 and all(s.spec.req_class == "be" for s in batch)
    assert src.on_finish(batch[0].spec, 1.0, 10) == []
    assert src.on_finish(batch[1].spec, 2.0, 10) == []
    assert len(src.on_finish(batch[2].spec, 3.0, 10)) == 3
    assert src.on_finish(batch[0].spec, 200.0, 10) == []  # past the window: no refill


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        '{"prompt": "hello world, how are you", "max_tokens": 5}\n'
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}\n'
    )
    items = load_jsonl(p)
    assert [i.max_tokens for i in items] == [5, 7] and items[1].messages
    w = build_workload(WorkloadConfig("jsonl", ArrivalSpec("poisson", 2.0), 10.0, dataset_path=str(p)))
    assert {s.spec.max_tokens for s in w.open_loop} == {5, 7}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        load_jsonl(bad)


def test_the_warmup_prompt_shares_no_prefix_with_the_workload():
    """A bench's warm-up prompt starts with no token any workload prompt starts with (so no
    prefix cache, block or token granular, can serve the timed run from it) and uses a token of
    the workload (a valid, non-special id)."""
    from loadgen.workloads.random_tokens import random_token_prompts, warmup_prompt

    prompts = random_token_prompts(64, (1, 40), vocab_size=50, seed=3, exclude_ids=[0, 1])
    warm = warmup_prompt(prompts)
    assert len(warm) == 16 and len(set(warm)) == 1
    assert warm[0] not in {p[0] for p in prompts}
    assert any(warm[0] in p for p in prompts)
    # every workload token starts a prompt: it falls back to an id no prompt starts with
    assert warmup_prompt([[1, 2], [2, 1]], length=4) == [0] * 4


def test_unknown_workload_is_a_value_error():
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload(WorkloadConfig("nope"))


def test_sharegpt_as_vllm_sampled_it_for_opt():
    """`sharegpt-opt`: the vLLM paper's ShareGPT means for the OPT tokenizer (161.31 in, 337.99
    out), with `sharegpt`'s coefficients of variation."""
    opt, ours = PROFILES["sharegpt-opt"], PROFILES["sharegpt"]
    assert opt.prompt.mean() == pytest.approx(161.31) and opt.output.mean() == pytest.approx(337.99)
    # a log-normal's coefficient of variation is a function of its sigma alone
    assert opt.prompt.b == pytest.approx(ours.prompt.b, rel=1e-3)
    assert opt.output.b == pytest.approx(ours.output.b, rel=1e-3)


def test_requests_sets_the_window_per_rate():
    """`--requests N`: each rate gets a window of N expected arrivals (the papers' traces of N
    sampled requests), so a find-rate probe at 4 req/s lasts 250 s and one at 8 req/s 125 s."""
    import argparse

    from loadgen.cli import add_run_args
    from loadgen.factory import workload_config

    p = argparse.ArgumentParser()
    add_run_args(p, target_default="sim")
    args = p.parse_args(["--requests", "1000", "--duration", "60"])
    assert workload_config(args, max_len=2048, slo_scale=1.0, rate=4.0).duration_s == pytest.approx(250.0)
    assert workload_config(args, max_len=2048, slo_scale=1.0, rate=8.0).duration_s == pytest.approx(125.0)
    plain = p.parse_args(["--duration", "60"])
    assert workload_config(plain, max_len=2048, slo_scale=1.0, rate=8.0).duration_s == 60.0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_requests_window_is_the_same_requests_at_every_rate(seed):
    """`--requests 1000`: every rate of a search gets the same requests (lengths, order, count)
    with its arrival times scaled by 1/rate, as the paper replays one trace of sampled requests
    at several rates. 4.75, 9.5 and 19 req/s are rates where `rate * (1000 / rate)` falls just
    below 1000 in floating point; they drew a different set of requests before the fix."""
    import argparse

    from loadgen.cli import add_run_args
    from loadgen.factory import workload_config

    p = argparse.ArgumentParser()
    add_run_args(p, target_default="sim")
    args = p.parse_args(["--requests", "1000", "--seed", str(seed)])

    def trace(rate):
        wl = build_workload(workload_config(args, max_len=2048, slo_scale=1.0, rate=rate))
        return [(s.spec.prompt_len, s.spec.max_tokens) for s in wl.open_loop], [s.at_s * rate for s in wl.open_loop]

    lengths, times = trace(4.0)
    assert 4.75 * (1000 / 4.75) * 1.2 < 1200  # the floating-point case this guards
    for rate in (2.0, 3.125, 4.75, 9.5, 19.0):
        other_lengths, other_times = trace(rate)
        assert other_lengths == lengths
        assert other_times == pytest.approx(times, abs=1e-6)
