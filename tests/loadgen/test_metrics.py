"""Metric definitions on hand-made timelines."""

from __future__ import annotations

import pytest

from loadgen.metrics import (
    RequestRecord,
    gap_attainment,
    normalized_latency,
    slo_ok,
    summarize,
    tbt_p99,
    tokens_on_time,
    tpot,
    ttft,
)


def rec(times, arrival=0.0, max_tokens=None, finish=None, ttft_slo=1.0, tpot_slo=0.5, cls="rt", rid="r"):
    return RequestRecord(
        rid,
        cls,
        arrival,
        10,
        max_tokens or len(times),
        ttft_slo if cls == "rt" else None,
        tpot_slo if cls == "rt" else None,
        token_times_s=list(times),
        finish_s=(times[-1] if times else None) if finish is None else finish,
        finish_reason="length",
    )


def test_ttft_tpot_and_normalized_latency():
    r = rec([1.0, 1.5, 2.0, 3.0], arrival=0.5)
    assert ttft(r) == pytest.approx(0.5)
    assert tpot(r) == pytest.approx(2.0 / 3)
    assert normalized_latency(r) == pytest.approx(2.5 / 4)


def test_p99_tbt_interpolates_over_the_requests_own_gaps():
    # 101 tokens: 99 gaps of 0.1 s and one of 2.1 s -> sorted gaps, P99 at position 0.99*99 = 98.01
    times = [0.0]
    for i in range(100):
        times.append(times[-1] + (2.1 if i == 50 else 0.1))
    r = rec(times)
    assert tbt_p99(r) == pytest.approx(0.1 + 0.01 * (2.1 - 0.1))
    assert tpot(r) == pytest.approx((99 * 0.1 + 2.1) / 100)


def test_slo_needs_ttft_and_p99_tbt():
    assert slo_ok(rec([1.0, 1.4, 1.8]))  # TTFT 1.0 <= 1.0 (boundary met), gaps 0.4
    assert not slo_ok(rec([1.01, 1.4, 1.8]))  # TTFT misses
    assert not slo_ok(rec([0.2, 0.3, 0.4, 0.5, 1.6]))  # one 1.1 s gap of four -> P99 TBT misses
    assert slo_ok(rec([0.2]))  # a single token has no TBT samples


def test_unfinished_request_misses_and_counts_missing_tokens():
    r = RequestRecord("x", "rt", 0.0, 10, 5, 1.0, 0.5, token_times_s=[0.5, 0.7])  # 2 of 5 tokens, aborted
    r.finish_s, r.finish_reason = 3.0, "abort"
    assert not slo_ok(r)
    assert tokens_on_time(r) == (2, 5)
    assert gap_attainment(r) == pytest.approx(1 / 4)


def test_per_token_attainment_counts_each_late_gap():
    r = rec([0.5, 1.2, 1.4, 2.0])  # gaps 0.7 (late), 0.2, 0.6 (late)
    assert tokens_on_time(r) == (2, 4)
    assert gap_attainment(r) == pytest.approx(1 / 3)


def test_summary_classes_and_keys():
    recs = [rec([1.0, 1.2], rid="a"), rec([3.0, 3.1], rid="b"), rec([0.5, 0.6, 0.7], cls="be", rid="c")]
    s = summarize(recs, elapsed_s=10.0)
    for cls in ("rt", "be", "all"):
        for key in (
            "requests",
            "completed",
            "ttft_p50_s",
            "ttft_p99_s",
            "tpot_p50_s",
            "tbt_p99_s",
            "normalized_latency_s",
            "ttft_attainment",
            "tpot_attainment",
            "slo_attainment",
            "throughput_rps",
            "output_tokens_per_s",
        ):
            assert key in s[cls]
    assert s["rt"]["requests"] == 2 and s["be"]["requests"] == 1 and s["all"]["requests"] == 3
    assert s["rt"]["slo_attainment"] == pytest.approx(0.5)  # b's TTFT 3.0 > 1.0
    assert s["rt"]["ttft_attainment"] == pytest.approx(0.5)
    assert s["be"]["slo_attainment"] is None  # BE has no SLO
    assert s["all"]["slo_attainment"] == pytest.approx(0.5)  # over requests that have SLOs
    assert s["all"]["throughput_rps"] == pytest.approx(0.3)
    assert s["all"]["output_tokens_per_s"] == pytest.approx(0.7)
    assert s["rt"]["ttft_p50_s"] == pytest.approx(2.0)
