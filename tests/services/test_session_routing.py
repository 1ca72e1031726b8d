"""Session routing logic without processes: hint debouncing, the advisory service's target choice
and advice, and the scheduler's session affinity policies."""

from __future__ import annotations

import pytest

from services.advisory.advisor import Advisor, AdvisorLimits
from services.advisory.targets import Candidate, LeastLoadedTarget, make_target_policy
from services.gateway.hints import HintDebouncer
from services.scheduler.affinity import AffinityLimits, make_affinity
from services.scheduler.placement import WorkerLoad
from shared.live_workers import WorkerState
from shared.schemas.sessions import SessionLocation, SessionPlacement, TypingHint
from shared.schemas.telemetry import ClassLoad, Heartbeat, Telemetry


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_debouncer_sends_one_hint_per_burst_per_session():
    clock = Clock()
    d = HintDebouncer(2.0, clock, max_sessions=2)
    assert d.admit("a") and not d.admit("a") and d.admit("b")
    clock.t += 1.9
    assert not d.admit("a")  # still the same burst
    clock.t += 0.2
    assert d.admit("a")  # 2.1 s after the first hint: a new one leaves
    assert d.admit("c") and d.admit("d")  # over the bound of 2: the oldest entry (a) is forgotten
    assert d.admit("a") and not d.admit("d")


def test_least_loaded_target_counts_pending_hints_and_keeps_the_holder_on_ties():
    p = LeastLoadedTarget()
    assert p.pick("a", [Candidate("a"), Candidate("b")]) == "a"  # tie: no move
    assert p.pick("a", [Candidate("a", running=1), Candidate("b")]) == "b"  # the holder is busier
    assert p.pick("a", [Candidate("a", running=1), Candidate("b", pending=2)]) == "a"  # b has advised turns coming
    assert p.pick("a", [Candidate("a", kv_usage=0.99), Candidate("b", running=5)]) == "b"  # a's KV is full
    assert p.pick("a", []) is None
    assert make_target_policy("holder").pick("a", [Candidate("a", running=9), Candidate("b")]) == "a"
    with pytest.raises(ValueError, match="unknown target policy"):
        make_target_policy("nope")


def _worker(wid: str, running: int = 0, model: str = "m") -> WorkerState:
    hb = Heartbeat(
        worker_id=wid,
        model=model,
        max_model_len=512,
        dispatch_topic="d",
        started_at=0,
        sent_at=0,
        kv_url=f"http://{wid}:1",
    )
    return WorkerState(hb, 0.0, Telemetry(worker_id=wid, sent_at=0, rt=ClassLoad(running=running), max_num_seqs=4))


def _hint(sid: str, t: float = 1000.0, hint_id: str = "h1") -> TypingHint:
    return TypingHint(hint_id=hint_id, session_id=sid, sent_at=t)


def _loc(sid: str, worker: str, t: float = 1.0, tokens: int = 32) -> SessionLocation:
    return SessionLocation(
        session_id=sid,
        worker_id=worker,
        kv_url=f"http://{worker}:1",
        tiers=["gpu", "disk"],
        num_tokens=tokens,
        last_activity=t,
    )


def test_advisor_moves_a_session_off_a_busy_holder_and_spreads_a_burst_of_hints():
    adv = Advisor(LeastLoadedTarget(), AdvisorLimits(placement_ttl_s=10, default_arrival_s=0))
    for sid in ("s1", "s2", "s3"):
        adv.on_location(_loc(sid, "a"))
    live = {"a": _worker("a", running=1), "b": _worker("b"), "c": _worker("c")}
    first = adv.on_hint(_hint("s1"), live, now=1000.0)
    assert first.placement.worker_id == "b" and first.placement.source_worker == "a"
    assert first.prefetch.source_url == "http://a:1/kv/v1/sessions/s1" and first.prefetch.ttl_s == 10
    assert first.placement.expires_at == 1010.0
    second = adv.on_hint(_hint("s2"), live, now=1000.0)
    assert second.placement.worker_id == "c"  # b has s1's turn pending
    third = adv.on_hint(_hint("s3"), live, now=1000.0)
    assert third.placement.worker_id == "a"  # all equal now (1 each): the holder wins, no pull
    assert third.prefetch.source_url is None and third.placement.source_worker is None
    again = adv.on_hint(_hint("s1", hint_id="h2"), live, now=1001.0)
    assert again.refreshed and again.placement.worker_id == "b" and again.placement.hint_id == "h2"
    adv.on_turn("s1")
    assert "s1" not in adv.pending
    assert adv.expire(now=1011.5) == ["s1", "s2", "s3"] and not adv.pending and len(adv.placements) == 0


def test_a_hint_without_an_arrival_holds_its_placement_for_the_default_typing_time():
    """Issue 20: a hint that names no arrival got a 30 s placement, shorter than a person typing
    a ShareGPT prompt (~2.5 min at 40 wpm): the turn came to no placement. It is now taken to
    arrive `default_arrival_s` after the hint; a named arrival still counts as named, 0 too."""
    adv = Advisor(LeastLoadedTarget(), AdvisorLimits(placement_ttl_s=30, default_arrival_s=60))
    adv.on_location(_loc("s", "a"))
    adv.on_location(_loc("t", "a"))
    live = {"a": _worker("a"), "b": _worker("b")}
    blind = adv.on_hint(_hint("s"), live, now=1000.0)
    assert blind.placement.expires_at == 1090.0 and blind.prefetch.ttl_s == 90.0
    assert adv.placements.live("s", now=1089.0) is not None and adv.expire(now=1089.0) == []
    named = adv.on_hint(TypingHint(hint_id="h", session_id="t", sent_at=1000.0, expected_arrival_s=0.0), live, 1000.0)
    assert named.placement.expires_at == 1030.0  # named: its own arrival, not the default
    capped = Advisor(LeastLoadedTarget(), AdvisorLimits(max_placement_ttl_s=50, default_arrival_s=60))
    capped.on_location(_loc("s", "a"))
    assert capped.on_hint(_hint("s"), live, now=1000.0).placement.expires_at == 1050.0  # the cap still holds


def test_a_placement_serves_one_turn_and_the_next_hint_decides_afresh():
    """Issue 20: a placement outlived its turn by up to its TTL, and the session's next hint in
    that time only refreshed it (same target whatever the loads): hints became sticky. Once the
    turn arrives the placement lasts `turn_grace_s` (for the scheduler to route that turn), and
    a hint after it is a new decision on the loads of then."""
    adv = Advisor(LeastLoadedTarget(), AdvisorLimits(placement_ttl_s=30, turn_grace_s=2))
    adv.on_location(_loc("s", "a"))
    live = {"a": _worker("a", running=1), "b": _worker("b")}
    first = adv.on_hint(_hint("s", t=1000.0), live, now=1000.0)
    assert first.placement.worker_id == "b" and first.placement.expires_at == 1090.0
    during = adv.on_hint(_hint("s", t=1005.0, hint_id="h2"), live, now=1005.0)
    assert during.refreshed and during.placement.worker_id == "b"  # still typing: a refresh
    adv.on_turn("s", now=1010.0)
    assert "s" not in adv.pending
    assert adv.placements.live("s", now=1011.9) is not None  # the scheduler's moment to route the turn
    assert adv.expire(now=1012.0) == ["s"]  # then tombstoned, not at 1095
    adv.on_location(_loc("s", "b", t=2.0))  # the turn ran on b and grew the session there
    live = {"a": _worker("a"), "b": _worker("b", running=2)}
    after = adv.on_hint(_hint("s", t=1013.0, hint_id="h3"), live, now=1013.0)
    assert not after.refreshed and after.placement.worker_id == "a"  # b is busy now: moved back
    adv.on_turn("t", now=1013.0)  # a turn with no placement: nothing to end
    adv.on_turn(None, now=1013.0)
    assert adv.placements.live("s", now=1013.0).worker_id == "a"


def test_advisor_ignores_stale_hints_unknown_sessions_and_dead_holders():
    adv = Advisor(LeastLoadedTarget(), AdvisorLimits(hint_max_age_s=5))
    adv.on_location(_loc("s", "gone"))
    live = {"b": _worker("b")}
    assert adv.on_hint(_hint("s", t=0.0), live, now=100.0) == "stale"
    assert adv.on_hint(_hint("new"), live, now=1000.0) == "unknown"
    assert adv.on_hint(_hint("s"), live, now=1000.0) == "unknown"  # the only copy is on a dead worker
    adv.on_location(_loc("s", "x", t=0.5))  # an older copy on another worker of another model
    live["x"] = _worker("x", model="other")
    advice = adv.on_hint(_hint("s"), live, now=1000.0)
    assert advice.placement.worker_id == "x"  # only workers serving the holder's model are candidates


def test_advisor_restores_live_placements_as_pending_load():
    adv = Advisor(LeastLoadedTarget())
    p = SessionPlacement(session_id="s", worker_id="b", hint_id="h", expires_at=50.0)
    adv.restore_placement("s", p, now=40.0)
    assert adv.pending == {"s": "b"}
    adv.restore_placement("s", None, now=40.0)
    assert adv.pending == {} and adv.placements.live("s", now=40.0) is None


def _loads(**rt) -> list[WorkerLoad]:
    return [WorkerLoad(wid, running_rt=n, max_num_seqs=4) for wid, n in rt.items()]


def test_advisory_affinity_placement_then_holder_with_room_then_least_loaded_with_kv_source():
    aff = make_affinity("advisory", AffinityLimits(holder_room=0.5))
    aff.on_location(_loc("s", "a", t=1.0, tokens=64))
    assert aff.route("s", _loads(a=1, b=0)) == "a"  # holder has room (1 < 0.5 * 4)
    assert aff.route("s", _loads(a=2, b=0)) is None  # holder busy: the placement policy decides
    src = aff.kv_source("s", "b", {"a", "b"})
    assert src.worker_id == "a" and src.url == "http://a:1/kv/v1/sessions/s" and src.num_tokens == 64
    assert aff.kv_source("s", "a", {"a", "b"}) is None and aff.kv_source("s", "b", {"b"}) is None
    aff.on_placement("s", SessionPlacement(session_id="s", worker_id="b", hint_id="h", expires_at=2e10))
    assert aff.route("s", _loads(a=0, b=3)) == "b"  # the placement wins while b has a slot
    assert aff.route("s", _loads(a=0, b=4)) == "a"  # b full: back to the holder
    aff.on_placement("s", None)
    assert aff.route(None, _loads(a=0)) is None and aff.route("other", _loads(a=0)) is None


def test_advisory_affinity_keeps_the_holder_only_within_the_slack_of_the_least_loaded():
    """An unhinted turn is not sticky while the holder merely has room: 20 more requests in
    flight than an idle peer sends it by load (the peer pulls or recomputes the history)."""
    aff = make_affinity("advisory")  # holder_room 0.75, holder_slack 4 requests
    aff.on_location(_loc("s", "a", t=1.0, tokens=64))

    def loads(a: int, b: int) -> list[WorkerLoad]:
        return [WorkerLoad("a", running_rt=a), WorkerLoad("b", running_rt=b)]

    assert aff.route("s", loads(4, 0)) == "a"  # 4 more: the KV is worth it
    assert aff.route("s", loads(5, 0)) is None  # 5 more: least-loaded decides
    assert aff.route("s", loads(20, 0)) is None  # room left (20 < 96), but far busier
    assert aff.route("s", loads(24, 20)) == "a"  # busy alike: the holder keeps it
    strict = make_affinity("advisory", AffinityLimits(holder_slack=0))
    strict.on_location(_loc("s", "a", t=1.0, tokens=64))
    assert strict.route("s", loads(1, 0)) is None and strict.route("s", loads(0, 0)) == "a"


def test_holder_follows_our_own_later_dispatch_until_the_directory_catches_up():
    aff = make_affinity("advisory")
    aff.on_location(_loc("s", "a", t=1.0))
    aff.placed("s", "b")  # turn 2 went to b; b has not published its grown copy yet
    assert aff.holder("s", {"a", "b"}) == "b" and aff.route("s", _loads(a=0, b=0)) == "b"
    aff.on_location(_loc("s", "a", t=2e10))  # a newer copy on a (say, a later turn ran there)
    assert aff.holder("s", {"a", "b"}) == "a"


def test_sticky_and_none_affinities():
    sticky = make_affinity("sticky")
    sticky.on_location(_loc("s", "a"))
    assert sticky.route("s", _loads(a=4, b=0)) == "a"  # busy or not
    assert sticky.route("s", _loads(b=0)) is None and sticky.kv_source("s", "b", {"a", "b"}).worker_id == "a"
    none = make_affinity("none")
    none.on_location(_loc("s", "a"))
    assert none.route("s", _loads(a=0)) is None and none.kv_source("s", "b", {"a", "b"}) is None
    with pytest.raises(ValueError, match="unknown session affinity"):
        make_affinity("nope")
