"""The HTTP target: SSE parsing on hand-made lines, and token timing against the real gateway stack."""

from __future__ import annotations

import argparse

import pytest

from loadgen.arrivals import ArrivalSpec
from loadgen.metrics import summarize, tbt_samples
from loadgen.targets.http import StreamResult, apply_chunk, parse_sse_line, run_http
from loadgen.workloads.build import WorkloadConfig, build_workload
from tests.services.conftest import make_stack  # noqa: F401  (fixture)


def test_sse_lines_and_chunks():
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    res = StreamResult()
    role = parse_sse_line('data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}')
    apply_chunk(res, role, 1.0)  # the role chunk carries no token
    apply_chunk(res, parse_sse_line('data: {"choices": [{"delta": {"content": "Hel"}}]}'), 1.5)
    apply_chunk(res, parse_sse_line('data: {"choices": [{"delta": {"content": "lo"}}]}'), 1.7)
    apply_chunk(res, parse_sse_line('data: {"choices": [{"delta": {}, "finish_reason": "length"}]}'), 1.8)
    apply_chunk(res, parse_sse_line('data: {"choices": [], "usage": {"completion_tokens": 3}}'), 1.9)
    assert res.token_times == [1.5, 1.7, 1.8] and res.text == "Hello"  # a held-back token still counts
    assert res.finish_reason == "length" and res.completion_tokens == 3
    comp = StreamResult()
    apply_chunk(comp, {"choices": [{"text": "a"}]}, 2.0)  # /v1/completions chunks
    assert comp.token_times == [2.0]


@pytest.mark.timeout(600)  # the stack starts inside the test: its start counts
def test_token_timing_against_the_real_gateway(make_stack):  # noqa: F811
    stack = make_stack()
    stack.scheduler()
    stack.worker("w0")
    stack.gateway()
    stack.wait_workers(1)
    cfg = WorkloadConfig(
        "rt-be",
        ArrivalSpec("poisson", 2.0),
        4.0,
        seed=1,
        length_scale=0.05,
        be_batch=2,
        max_len=512,
        slo_ttft_s=5.0,
        slo_tpot_s=5.0,
    )
    args = argparse.Namespace(served_model=None, drain_timeout=60.0, be_via="stream")
    res = run_http(stack.url, build_workload(cfg), args)
    rt = [r for r in res.records if r.req_class == "rt"]
    assert rt and all(r.completed for r in rt), [r.error for r in rt]
    for r in rt:
        assert r.output_tokens == r.max_tokens  # one SSE chunk per token (ignore_eos forces the length)
        assert r.token_times_s == sorted(r.token_times_s)
        assert r.token_times_s[0] > r.arrival_s
        assert all(g >= 0 for g in tbt_samples(r))
        assert r.worker == "w0"
    s = summarize(res.records, res.elapsed_s)
    assert s["rt"]["slo_attainment"] is not None and s["rt"]["ttft_p50_s"] > 0
    assert any(r.req_class == "be" for r in res.records)
