"""The term checks of HA pairs, alone: what a deposed scheduler or advisory service wrote after
its successor began is dropped by the readers (docs/reliability.md, "HA pairs")."""

from __future__ import annotations

import time
from types import SimpleNamespace

from services.scheduler.affinity import make_affinity
from services.scheduler.assignments import AssignmentTable
from shared.schemas.scheduler import Assignment
from shared.schemas.sessions import SessionPlacement


def _state_record(request_id: str, worker_id: str, term: int, offset: int) -> SimpleNamespace:
    a = Assignment(
        request_id=request_id,
        attempt=0,
        worker_id=worker_id,
        gateway_id="g",
        reply_partition=0,
        req_class="rt",
        assigned_at=1.0,
        term=term,
    )
    return SimpleNamespace(
        key=request_id.encode(), value=a.encode(), topic="p.scheduler.state", partition=0, offset=offset
    )


def test_state_replay_drops_a_deposed_schedulers_later_records():
    table = AssignmentTable(kafka=None, topic="p.scheduler.state")
    table._apply(_state_record("r1", "w0", term=1, offset=0))  # noqa: SLF001 (the replay's step)
    table._apply(_state_record("r2", "w1", term=2, offset=1))  # noqa: SLF001 (the successor begins)
    table._apply(_state_record("r1", "w1", term=1, offset=2))  # noqa: SLF001 (the deposed one, late)
    table._apply(_state_record("r3", "w0", term=1, offset=3))  # noqa: SLF001
    assert {rid: a.worker_id for rid, a in table.by_request.items()} == {"r1": "w0", "r2": "w1"}
    assert table.term == 2 and table.stale == 2


def test_affinity_drops_a_placement_of_an_older_advisory_term():
    affinity = make_affinity("advisory")
    expires = time.time() + 60

    def placement(worker: str, term: int) -> SessionPlacement:
        return SessionPlacement(session_id="s", worker_id=worker, hint_id="h", expires_at=expires, term=term)

    affinity.on_placement("s", placement("wa", 1))
    affinity.on_placement("s", placement("wb", 2))
    affinity.on_placement("s", placement("wa", 1))  # a deposed advisory service's late placement
    assert affinity.placements.live("s").worker_id == "wb"
    affinity.on_placement("s", None)  # a tombstone (expiry) still applies
    assert affinity.placements.live("s") is None
