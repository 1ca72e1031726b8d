"""The session directory and placement book every session reader keeps (pure logic)."""

from __future__ import annotations

import pytest

from shared.schemas.control import ControlEnvelope
from shared.schemas.sessions import (
    Prefetch,
    SessionLocation,
    SessionPlacement,
    TypingHint,
    check_session_id,
    session_kv_url,
)
from shared.session_state import PlacementBook, SessionDirectory


def _loc(worker: str, t: float, tokens: int = 32, sid: str = "s", **kw) -> SessionLocation:
    return SessionLocation(
        session_id=sid,
        worker_id=worker,
        kv_url=f"http://{worker}:1",
        tiers=["disk"],
        num_tokens=tokens,
        nbytes=tokens * 10,
        last_activity=t,
        **kw,
    )


def test_holder_is_the_newest_live_copy_and_drops_fall_back_to_older_copies():
    d = SessionDirectory()
    d.apply(_loc("a", 1.0, 32))
    d.apply(_loc("b", 2.0, 48))  # b served the next turn: its copy is newer
    assert d.holder("s").worker_id == "b" and d.holder("s", live={"a"}).worker_id == "a"
    d.apply(_loc("b", 1.5, 16))  # a reordered, older update from b is ignored
    assert d.holder("s").num_tokens == 48
    d.apply(_loc("b", 3.0, dropped=True))
    assert d.holder("s").worker_id == "a" and [c.worker_id for c in d.copies("s")] == ["a"]
    d.apply(_loc("a", 3.0, dropped=True))
    assert d.holder("s") is None and len(d) == 0 and d.holder(None) is None


def test_directory_forgets_the_least_recent_sessions_beyond_its_bound():
    d = SessionDirectory(max_sessions=2)
    for i, sid in enumerate(["s1", "s2", "s1", "s3"]):
        d.apply(_loc("a", float(i), sid=sid))
    assert d.holder("s2") is None and d.holder("s1") and d.holder("s3")


def test_placements_expire_and_tombstones_remove_them():
    b = PlacementBook()
    b.apply("s", SessionPlacement(session_id="s", worker_id="w", hint_id="h", expires_at=10.0))
    assert b.live("s", now=9.0).worker_id == "w" and b.live("s", now=10.0) is None
    assert [p.session_id for p in b.expired(now=11.0)] == ["s"]
    b.apply("s", None)
    assert b.live("s", now=0.0) is None and len(b) == 0


def test_wire_messages_round_trip_and_prefetch_is_a_control_message():
    hint = TypingHint(hint_id="h", session_id="s", sent_at=1.0, expected_arrival_s=2.5, source="websocket")
    assert TypingHint.decode(hint.encode()) == hint
    env = ControlEnvelope(message=Prefetch(worker_id="w", session_id="s", hint_id="h", source_url="http://x/kv"))
    assert isinstance(ControlEnvelope.decode(env.encode()).message, Prefetch)
    with pytest.raises(ValueError):
        TypingHint(hint_id="h", session_id="s", sent_at=1.0, expected_arrival_s=-1)


def test_session_ids_and_kv_urls():
    assert session_kv_url("http://h:1/", "a/b c") == "http://h:1/kv/v1/sessions/a%2Fb%20c"
    assert check_session_id("chat-1") == "chat-1"
    for bad in ("", "x" * 257, "a\nb"):
        with pytest.raises(ValueError, match="session id"):
            check_session_id(bad)
