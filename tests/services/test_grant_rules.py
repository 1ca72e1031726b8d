"""The rules of RT dispatch by grant, without a broker: which requests a gateway may send
straight to a worker (services/gateway/grants.py), what the scheduler grants
(services/scheduler/grants.py, `GrantPublisher.workers`) and how it settles a gateway's flagged
copy (`GrantedCopies._verdict`). The real-stack behaviour is `test_rt_grants.py`."""

from __future__ import annotations

import time

from services.gateway.grants import GrantBook
from services.scheduler.dispatch import Pending
from services.scheduler.grants import GrantedCopies, GrantPublisher
from services.scheduler.placement import PlacementLimits, WorkerLoad, make_placement
from services.scheduler.registry import WorkerRegistry
from services.scheduler.settings import SchedulerSettings
from shared.live_workers import LiveWorkers
from shared.schemas.grants import PlacementGrant, WorkerGrant
from shared.schemas.requests import GenerateRequest
from shared.schemas.telemetry import Heartbeat


def _hb(worker_id: str, epoch: int = 1, draining: bool = False) -> Heartbeat:
    now = time.time()
    return Heartbeat(
        worker_id=worker_id,
        model="m",
        max_model_len=2048,
        dispatch_topic=f"t.dispatch.{worker_id}",
        started_at=now,
        sent_at=now,
        epoch=epoch,
        draining=draining,
    )


def _req(rid: str, **update) -> GenerateRequest:
    fields = {"gateway_id": "g", "reply_partition": 0, "model": "m", "kind": "chat", "created_at": time.time()}
    return GenerateRequest(request_id=rid, messages=[{"role": "user", "content": "hi"}], **{**fields, **update})


def _grant(term: int, seq: int, slots: dict[str, int], ttl_s: float = 60.0, epoch: int = 1) -> PlacementGrant:
    workers = [WorkerGrant(worker_id=w, epoch=epoch, model="m", slots=n) for w, n in slots.items()]
    return PlacementGrant(scheduler_id="s", term=term, sequence=seq, sent_at=time.time(), ttl_s=ttl_s, workers=workers)


def _book(*workers: Heartbeat) -> GrantBook:
    live = LiveWorkers(timeout_s=60)
    for hb in workers:
        live.on_heartbeat(hb)
    return GrantBook(live)


def test_a_gateway_fills_the_granted_slots_spread_and_releases_them():
    book = _book(_hb("w0"), _hb("w1"))
    assert book.take(_req("r0")) is None  # no grant yet: the scheduler's path
    book.on_grant(_grant(1, 1, {"w0": 2, "w1": 1}))
    slots = [book.take(_req(f"r{i}")) for i in range(4)]
    assert [s.worker_id if s else None for s in slots] == ["w0", "w1", "w0", None]  # 3 slots in all
    assert slots[0].term == 1 and slots[0].epoch == 1
    book.release("r1")
    assert book.take(_req("r9")).worker_id == "w1"


def test_only_first_attempts_of_plain_rt_requests_take_a_slot():
    book = _book(_hb("w0"))
    book.on_grant(_grant(1, 1, {"w0": 8}))
    assert book.take(_req("be", req_class="be")) is None
    assert book.take(_req("turn", session_id="s1")) is None  # affinity and KV pulls: the scheduler's
    assert book.take(_req("resumed", attempt=1)) is None  # a resume: the scheduler decides where
    assert book.take(_req("other-model", model="x")) is None
    assert book.take(_req("plain")) is not None


def test_a_worker_the_gateway_does_not_see_live_at_the_granted_epoch_gets_nothing():
    book = _book(_hb("w0", epoch=2), _hb("w1", draining=True))
    book.on_grant(_grant(1, 1, {"w0": 4, "w1": 4, "w2": 4}, epoch=1))  # w0 rejoined since; w2 unknown
    assert book.take(_req("r")) is None
    book.workers.on_fence("w0", 2)
    book.on_grant(_grant(1, 2, {"w0": 4}, epoch=2))
    assert book.take(_req("r")) is None  # fenced at the granted epoch


def test_grants_are_ordered_by_term_and_sequence_until_they_lapse():
    book = _book(_hb("w0"), _hb("w1"))
    assert book.on_grant(_grant(2, 5, {"w0": 1}))
    assert not book.on_grant(_grant(1, 9, {"w1": 1}))  # a deposed scheduler's
    assert not book.on_grant(_grant(2, 4, {"w1": 1}))  # an older one of the same term
    assert book.take(_req("r")).worker_id == "w0"
    assert book.on_grant(_grant(2, 6, {}))  # revoked: the scheduler's path again
    assert book.take(_req("r2")) is None and book.granted_workers() == 0
    book.on_grant(_grant(3, 1, {"w1": 1}, ttl_s=0.0))  # lapsed at once
    assert book.take(_req("r3")) is None
    assert book.on_grant(_grant(1, 1, {"w1": 1}))  # after a lapse anything goes (a broker restart resets terms)
    assert book.take(_req("r4")).worker_id == "w1"


def test_the_scheduler_grants_live_workers_with_room_only():
    settings = SchedulerSettings(rt_grants=True, grant_slots=4)
    publisher = GrantPublisher(None, settings, make_placement("least-loaded", PlacementLimits()), lambda: 1)
    live = [
        (WorkerLoad("w0", running_rt=1, max_num_seqs=8), "m", 11),
        (WorkerLoad("w1", running_rt=6, max_num_seqs=8), "m", 12),  # 2 sequence slots left
        (WorkerLoad("w2", running_rt=8, max_num_seqs=8), "m", 13),  # full
        (WorkerLoad("w3", draining=True), "m", 14),
    ]
    got = {g.worker_id: (g.slots, g.epoch) for g in publisher.workers(live)}
    assert got == {"w0": (4, 11), "w1": (2, 12)}


def test_a_granted_copy_is_adopted_rerouted_or_held_by_what_the_scheduler_knows():
    settings = SchedulerSettings(worker_timeout_s=3.0)
    registry = WorkerRegistry(timeout_s=3.0)
    registry.on_heartbeat(_hb("live", epoch=5))
    registry.on_heartbeat(_hb("rejoined", epoch=9))
    registry.remember_fence("lost", 4)
    copies = GrantedCopies(settings, registry, failures=None, metrics=None, term=lambda: 1)

    def verdict(worker: str, epoch: int, active_for_s: float) -> str | None:
        p = Pending(_req("r", granted_worker=worker, worker_epoch=epoch, scheduler_term=1), None, 0)
        return copies._verdict(p, time.monotonic() - active_for_s)  # noqa: SLF001

    assert verdict("live", 5, 100) == "adopt"
    assert verdict("lost", 4, 100) == "granted worker lost lost at epoch 4"
    assert verdict("rejoined", 8, 100).startswith("granted worker rejoined lost")  # its old epoch was fenced
    assert verdict("unknown", 1, 0.5) is None  # just active: its heartbeats may still come
    assert verdict("unknown", 1, 100) == "granted worker unknown unknown"
