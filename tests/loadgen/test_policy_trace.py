"""`loadgen.sim.policy_trace`'s per-request preemption profile: who is preempted, how often,
and what became of them (docs/aptserve.md, "Preemption churn")."""

from __future__ import annotations

from engine.sampling import SamplingParams
from engine.scheduling import Request
from loadgen.metrics import RequestRecord
from loadgen.sim.policy_trace import preemption_profile, trace


def _request(rid: str, prompt: int, out: int, preemptions: int) -> Request:
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=out))
    r.num_preemptions = preemptions
    return r


def _record(rid: str, token_times: list[float], finished: bool) -> RequestRecord:
    rec = RequestRecord(rid, "rt", 0.0, 4, len(token_times), slo_ttft_s=1.0, slo_tpot_s=1.0)
    rec.token_times_s = token_times
    rec.finish_s = token_times[-1] if finished else None
    return rec


def test_profile_counts_who_was_preempted_and_how_they_ended():
    requests = [
        _request("small", 4, 4, 0),
        _request("mid", 8, 8, 1),
        _request("big", 64, 64, 3),
        _request("lost", 8, 8, 2),
    ]
    records = [
        _record("small", [0.1, 0.2, 0.3, 0.4], True),
        _record("mid", [0.1, 2.0, 2.1], True),  # one 1.9 s gap of two: its P99 is over 1 s
        _record("big", [0.1, 0.2, 0.3], True),
        _record("lost", [0.1], False),  # never finished
    ]
    p = preemption_profile(requests, records)
    assert p["requests"] == 4 and p["preempted_requests"] == 3
    assert p["max_preemptions_per_request"] == 3
    assert p["preemption_histogram"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert p["preemption_share_on_largest_quarter"] == 3 / 6  # "big" alone is the top quarter
    assert p["completed_share_preempted"] == 2 / 3 and p["completed_share_not_preempted"] == 1.0
    assert p["tbt_p99_met_of_completed_preempted"] == 1 / 2  # "big" met it, "mid" did not
    assert p["tbt_p99_met_of_completed_not_preempted"] == 1.0


def test_a_short_overloaded_trace_accounts_for_every_preemption():
    """At 12 req/s the OPT-13B/A100 pool binds within seconds: the per-request counts must add
    up to the worker's own preemption count."""
    run = trace("aptserve", 12.0, 0, 15.0, "opt-13b-a100-40gb", None)
    assert run["preemptions"] > 0
    hist = run["preemption_histogram"]
    assert sum(int(k) * v for k, v in hist.items()) == run["preemptions"]
    assert sum(hist.values()) == run["requests"]
