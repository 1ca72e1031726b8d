"""The advisory service's decisions, free of I/O: what a hint becomes.

On a hint for a session whose KV some live worker holds, pick the target by load (the target
policy, counting advised-but-not-arrived turns as pending load), record the placement, and say
what the target must do: promote its own copy (local) or pull the holder's (source set). A hint
for a session with a live placement on a live worker refreshes it (same target, new expiry), so
repeated hints never bounce a session between workers. A hint for a session nobody holds is
ignored: there is nothing to move, and the scheduler balances the turn like any request.

**How long a placement lives** (issue 20, session 10). A placement serves one turn: from the hint
until `placement_ttl_s` past the turn's expected arrival, and once the turn has arrived, only
`turn_grace_s` more (time for the scheduler, which reads the same request, to route it by the
placement). Before, a placement outlived its turn by up to its whole TTL, and the session's next
hint within that time only refreshed it (the same target whatever the loads then: the bench's
"hints are sticky" at 50x people). A hint that names no arrival (`expected_arrival_s` absent: a
one-shot POST, a front-end that cannot estimate typing) is taken to come `default_arrival_s` =
60 s after it; it used to be 0, so the placement lapsed 30 s after the hint while a person
typing a median ShareGPT prompt at 40 wpm takes ~2.5 minutes. 60 s is five times the paper's
mean hint lead (11.3 s); a front-end that streams typing events renews the placement with each
hint past the gateway's debounce anyway. What a too-long guess costs is bounded: only a hint
whose turn never comes keeps a placement (and its pending load on the target) for the whole
90 s; the target's prefetch pin lasts at most its engine's `session_prefetch_ttl_s` (30 s) and
is soft.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from services.advisory.targets import Candidate, TargetPolicy
from shared.live_workers import WorkerState
from shared.schemas.sessions import Prefetch, SessionLocation, SessionPlacement, TypingHint, session_kv_url
from shared.session_state import PlacementBook, SessionDirectory


@dataclass(frozen=True)
class AdvisorLimits:
    placement_ttl_s: float = 30.0
    max_placement_ttl_s: float = 300.0
    hint_max_age_s: float = 30.0
    default_arrival_s: float = 60.0  # a hint's expected arrival when it names none
    turn_grace_s: float = 2.0  # a placement's life once its turn has arrived


@dataclass(frozen=True)
class Advice:
    placement: SessionPlacement
    prefetch: Prefetch
    refreshed: bool  # the session already had this placement


class Advisor:
    def __init__(self, policy: TargetPolicy, limits: AdvisorLimits = AdvisorLimits()) -> None:
        self.policy = policy
        self.limits = limits
        self.directory = SessionDirectory()
        self.placements = PlacementBook()
        self.pending: dict[str, str] = {}  # session id -> target, for advised turns not arrived yet

    # -- inputs ------------------------------------------------------------------------------

    def on_location(self, loc: SessionLocation) -> None:
        self.directory.apply(loc)

    def restore_placement(self, session_id: str, placement: SessionPlacement | None, now: float) -> None:
        """A placement read back after a restart: live ones count as pending until they expire."""
        self.placements.apply(session_id, placement)
        if placement is not None and placement.expires_at > now:
            self.pending[session_id] = placement.worker_id
        else:
            self.pending.pop(session_id, None)

    def on_turn(self, session_id: str | None, now: float | None = None) -> None:
        """A request of the session arrived: its advised turn is no longer pending, and its
        placement ends `turn_grace_s` from now (module doc), so the next hint decides afresh."""
        if session_id is None:
            return
        self.pending.pop(session_id, None)
        placement = self.placements.live(session_id, now)
        if placement is not None:
            until = (time.time() if now is None else now) + self.limits.turn_grace_s
            if until < placement.expires_at:
                self.placements.apply(session_id, placement.model_copy(update={"expires_at": until}))

    def expire(self, now: float | None = None) -> list[str]:
        """Drop placements past their expiry; the session ids (to tombstone)."""
        gone = [p.session_id for p in self.placements.expired(now)]
        for sid in gone:
            self.placements.apply(sid, None)
            self.pending.pop(sid, None)
        return gone

    # -- hints -------------------------------------------------------------------------------

    def on_hint(self, hint: TypingHint, live: dict[str, WorkerState], now: float | None = None) -> Advice | str:
        """The advice for a hint, or why there is none ("stale" | "unknown")."""
        now = time.time() if now is None else now
        if now - hint.sent_at > self.limits.hint_max_age_s:
            return "stale"
        source = self.directory.holder(hint.session_id, live)
        if source is None:
            return "unknown"
        model = live[source.worker_id].heartbeat.model
        peers = {wid: s for wid, s in live.items() if s.heartbeat.model == model}
        current = self.placements.live(hint.session_id, now)
        refreshed = current is not None and current.worker_id in peers
        target = current.worker_id if refreshed else self._pick(hint.session_id, source, peers)
        return self._advise(hint, source, target, refreshed, now)

    def _pick(self, session_id: str, source: SessionLocation, peers: dict[str, WorkerState]) -> str:
        if source.kv_url is None:
            return source.worker_id  # the holder serves no peers: moving would mean recomputing
        pending = Counter(w for sid, w in self.pending.items() if sid != session_id)
        candidates = [_candidate(wid, s, pending[wid]) for wid, s in sorted(peers.items())]
        return self.policy.pick(source.worker_id, candidates) or source.worker_id

    def _advise(self, hint: TypingHint, source: SessionLocation, target: str, refreshed: bool, now: float) -> Advice:
        sid = hint.session_id
        local = next((c for c in self.directory.copies(sid) if c.worker_id == target), None)
        pull = source if local is None or local.num_tokens < source.num_tokens else None
        arrival = self.limits.default_arrival_s if hint.expected_arrival_s is None else hint.expected_arrival_s
        ttl = min(self.limits.max_placement_ttl_s, self.limits.placement_ttl_s + arrival)
        placement = SessionPlacement(
            session_id=sid,
            worker_id=target,
            hint_id=hint.hint_id,
            expires_at=now + ttl,
            source_worker=pull.worker_id if pull else None,
        )
        prefetch = Prefetch(
            worker_id=target,
            session_id=sid,
            hint_id=hint.hint_id,
            source_worker=pull.worker_id if pull else None,
            source_url=session_kv_url(pull.kv_url, sid) if pull else None,
            source_tokens=pull.num_tokens if pull else 0,
            ttl_s=ttl,
        )
        self.placements.apply(sid, placement)
        self.pending[sid] = target
        return Advice(placement, prefetch, refreshed)


def _candidate(worker_id: str, s: WorkerState, pending: int) -> Candidate:
    t = s.telemetry
    if t is None:
        return Candidate(worker_id, pending=pending)
    running = t.rt.running + t.rt.waiting + 0.25 * (t.be.running + t.be.waiting)
    return Candidate(
        worker_id, running=running, pending=pending, kv_usage=t.kv_usage, max_num_seqs=t.max_num_seqs or 128
    )
