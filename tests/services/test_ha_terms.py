"""The term checks of HA pairs, alone: what a deposed scheduler or advisory service wrote after
its successor began is dropped by the readers (docs/reliability.md, "HA pairs")."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from services.scheduler.affinity import make_affinity
from services.scheduler.assignments import AssignmentTable
from shared.kafka import KafkaClient
from shared.schemas.scheduler import Assignment
from shared.schemas.sessions import SessionPlacement
from shared.settings import ServiceSettings
from shared.topics import Topics


def _assignment(request_id: str, worker_id: str, term: int) -> Assignment:
    return Assignment(
        request_id=request_id,
        attempt=0,
        worker_id=worker_id,
        gateway_id="g",
        reply_partition=0,
        req_class="rt",
        assigned_at=1.0,
        term=term,
    )


@contextlib.asynccontextmanager
async def _state_client(kafka_bootstrap: str, topics: Topics) -> AsyncIterator[KafkaClient]:
    """A Kafka client on the real broker with the scheduler's state topic created."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix), "ha-terms")
    await kafka.start([topics.scheduler_state])
    try:
        yield kafka
    finally:
        await kafka.stop()


def test_state_replay_drops_a_deposed_schedulers_later_records(kafka_bootstrap):
    """The state topic on the real broker, written in this order, replayed by `load()`."""
    topics = Topics("haterms")
    written = [("r1", "w0", 1), ("r2", "w1", 2), ("r1", "w1", 1), ("r3", "w0", 1)]  # the successor
    # begins at r2 (term 2); r1 -> w1 and r3 are the deposed scheduler's late records (term 1)

    async def run() -> AssignmentTable:
        async with _state_client(kafka_bootstrap, topics) as kafka:
            for request_id, worker_id, term in written:
                await kafka.send(topics.scheduler_state.name, _assignment(request_id, worker_id, term), key=request_id)
            table = AssignmentTable(kafka, topics.scheduler_state.name)
            await table.load()
            return table

    table = asyncio.run(run())
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


def test_state_replay_drops_a_deposed_schedulers_late_tombstone(kafka_bootstrap):
    """A tombstone carries its writer's term in a header: the deposed scheduler's late tombstone
    for a request its successor re-placed does not end the successor's assignment; the
    successor's own tombstone, and one written before terms existed (no header), still apply."""
    topics = Topics("haterms-tomb")

    async def run() -> AssignmentTable:
        async with _state_client(kafka_bootstrap, topics) as kafka:
            term = {"now": 1}
            writer = AssignmentTable(kafka, topics.scheduler_state.name, lambda: term["now"])
            for request_id in ("r1", "r2", "r3"):
                await (await writer.add_nowait(_assignment(request_id, "w0", 1)))
            await kafka.send(topics.scheduler_state.name, None, key="r3")  # no header: an old writer's
            await (await writer.add_nowait(_assignment("r1", "w1", 2)))  # the successor re-placed r1
            await (await writer.add_nowait(_assignment("r2", "w1", 2)))  # and r2
            term["now"] = 2
            await writer.remove("r2")  # the successor's own tombstone (term 2)
            term["now"] = 1
            writer.by_request["r1"] = _assignment("r1", "w0", 1)
            await writer.remove("r1")  # the deposed scheduler's late tombstone (term 1)
            table = AssignmentTable(kafka, topics.scheduler_state.name)
            await table.load()
            return table

    table = asyncio.run(run())
    assert {rid: a.worker_id for rid, a in table.by_request.items()} == {"r1": "w1"}
    assert table.term == 2 and table.stale == 1


def test_a_worker_drops_a_prefetch_of_an_older_advisory_term(make_stack):
    """A real worker reads `control`: a prefetch of term 3 addressed to another worker raises the
    advisory term it knows, so a later term-2 prefetch for itself (a deposed advisory service's)
    is dropped, while a term-3 one is acted on (here: an unknown session, logged as such)."""
    from shared.schemas.control import ControlEnvelope
    from shared.schemas.sessions import Prefetch

    stack = make_stack()
    stack.worker("w0")
    stack.wait_log("w0", "worker ready")
    control = Topics(stack.prefix).control.name

    def prefetch(worker: str, session: str, term: int) -> ControlEnvelope:
        return ControlEnvelope(message=Prefetch(worker_id=worker, session_id=session, hint_id="h", term=term))

    async def publish() -> None:
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "ha-terms-advisory")
        await kafka.start()
        try:
            for worker, session, term in (("w9", "s-other", 3), ("w0", "s-stale", 2), ("w0", "s-current", 3)):
                await kafka.send(control, prefetch(worker, session, term), key=session)
        finally:
            await kafka.stop()

    asyncio.run(publish())
    stack.wait_log("w0", "prefetch of unknown session s-current ignored")
    log = (stack.log_dir / "w0.log").read_text()
    assert "prefetch of session s-stale dropped: advisory term 2 < 3" in log
    assert "s-stale ignored" not in log and "s-other" not in log
