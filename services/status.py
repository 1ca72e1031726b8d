"""The live cluster as the broker shows it: what `tandem status` prints (issue 21, "Operate it").

Everything comes from Kafka, so the command needs no service to answer it and no metrics port:

- **broker**: reachable or not (a connection within `timeout_s`), and how many of the
  catalogue's topics exist.
- **workers**: the newest heartbeat and telemetry of each worker in the last `window` records of
  those topics; `live` when its heartbeat is younger than `worker_timeout_s`, `draining` when it
  says so, else `silent` (it stopped beating: crashed, or gone).
- **queues**: the backlog of `requests.rt` / `requests.be`, records the scheduler's consumer
  group has not committed (received but not yet placed, or not yet read); and the scheduler's
  last `be.capacity` report (BE it holds, BE in flight, BE slots).
- **sessions**: the session directory (compacted topic, read from its start): sessions with
  kept KV, copies, bytes.
- **pairs**: the doubled services (scheduler, queue, advisory) from the `leases` topic: each
  role's current term and every instance heard, `active` (the term's holder, renewing),
  `standby`, `stopped` (released its lease cleanly) or `silent` (its records stopped: dead or
  paused; `tandem up --ha` reports the death too).

Reading is group-less (no consumer group joins, nothing is committed), so running it never
disturbs the services.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import BaseModel

from shared.lease import LeaseLog
from shared.records import decode_record
from shared.schemas.capacity import BECapacity
from shared.schemas.lease import LeaseRecord
from shared.schemas.sessions import SessionLocation
from shared.schemas.telemetry import Heartbeat, Telemetry
from shared.session_state import SessionDirectory
from shared.settings import ServiceSettings
from shared.topics import Topics

SCHEDULER_GROUP = "tandem-scheduler"  # services/scheduler/service.py's request consumer group


class WorkerStatus(BaseModel):
    worker_id: str
    model: str
    device: str | None = None
    dtype: str | None = None
    state: str  # live | draining | silent
    heartbeat_age_s: float
    held: int = 0  # requests its engine holds (the heartbeat's running_ids)
    rt_running: int = 0
    rt_waiting: int = 0
    be_running: int = 0
    be_waiting: int = 0
    kv_usage: float | None = None  # None: no telemetry yet
    kv_blocks: int = 0
    tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    tpot_p50_s: float | None = None
    slo_attainment: float | None = None
    profiled: bool = False  # publishes a step-time profile (the SLO placement can predict it)


class QueueStatus(BaseModel):
    rt_backlog: int = 0  # records in requests.rt the scheduler has not committed
    be_backlog: int = 0
    scheduler_pending_be: int | None = None  # from the last be.capacity report (None: none seen)
    be_in_flight: int | None = None
    be_slots: int | None = None


class SessionStatus(BaseModel):
    sessions: int = 0
    copies: int = 0
    bytes: int = 0


class InstanceStatus(BaseModel):
    instance: str  # service id / pid-start (unique per process)
    state: str  # active | standby | stopped | silent
    age_s: float  # since its last lease record


class RoleStatus(BaseModel):
    role: str
    term: int
    instances: list[InstanceStatus] = []


class ClusterStatus(BaseModel):
    broker: str
    reachable: bool
    error: str | None = None
    topic_prefix: str
    topics_present: int = 0
    topics_expected: int = 0
    workers: list[WorkerStatus] = []
    queues: QueueStatus = QueueStatus()
    sessions: SessionStatus = SessionStatus()
    pairs: list[RoleStatus] = []


async def collect(settings: ServiceSettings, timeout_s: float = 5.0, window: int = 2000) -> ClusterStatus:
    """The cluster's status; an unreachable broker gives `reachable=False` and the error."""
    topics = Topics(settings.topic_prefix)
    status = ClusterStatus(broker=settings.kafka_bootstrap, reachable=False, topic_prefix=settings.topic_prefix)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id="tandem-status",
        enable_auto_commit=False,
        request_timeout_ms=int(timeout_s * 1000),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
    except Exception as exc:  # noqa: BLE001 (any failure to connect is the answer, not a crash)
        text = str(exc) or type(exc).__name__
        status.error = text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"
        await _quietly(consumer.stop())
        return status
    try:
        await consumer.topics()  # a metadata fetch for every topic
        catalogue = [t.name for t in topics.static()]
        # read every partition list now: assigning partitions narrows the consumer's later
        # metadata refreshes to the assigned topics, after which the others read as unknown
        existing = {t: sorted(consumer.partitions_for_topic(t) or ()) for t in catalogue}
        existing = {t: parts for t, parts in existing.items() if parts}
        status.reachable = True
        status.topics_expected = len(catalogue)
        status.topics_present = len(existing)
        beats = await _tail(consumer, topics.heartbeats.name, existing, window, Heartbeat)
        reports = await _tail(consumer, topics.telemetry.name, existing, window, Telemetry)
        capacity = await _tail(consumer, topics.be_capacity.name, existing, 50, BECapacity)
        status.workers = _workers(beats, reports, settings.worker_timeout_s)
        status.sessions = await _sessions(consumer, topics.sessions_directory.name, existing)
        leases = await _tail(consumer, topics.leases.name, existing, window, LeaseRecord)
        status.pairs = _pairs(leases, settings.lease_s)
        status.queues = await _queues(settings, consumer, topics, existing, capacity, timeout_s)
    finally:
        await _quietly(consumer.stop())
    return status


async def _tail(consumer: AIOKafkaConsumer, topic: str, existing: dict[str, list[int]], n: int, cls) -> list:
    """The last `n` records of each partition of `topic`, decoded (malformed ones skipped)."""
    tps = [TopicPartition(topic, p) for p in existing.get(topic, ())]
    records = await _read(consumer, tps, lambda start, end: max(start, end - n)) if tps else []
    decoded = (decode_record(cls, m) for m in records)
    return [msg for msg in decoded if msg is not None]


async def _read(consumer: AIOKafkaConsumer, tps: list[TopicPartition], first_offset) -> list:
    """Records of `tps` from `first_offset(begin, end)` to the end as of now."""
    consumer.assign(tps)
    begin, end = await consumer.beginning_offsets(tps), await consumer.end_offsets(tps)
    for tp in tps:
        consumer.seek(tp, first_offset(begin[tp], end[tp]))
    out = []
    while not await _caught_up(consumer, end):
        for msgs in (await consumer.getmany(*tps, timeout_ms=500)).values():
            out.extend(m for m in msgs if m.offset < end[TopicPartition(m.topic, m.partition)])
    return out


async def _caught_up(consumer: AIOKafkaConsumer, end: dict[TopicPartition, int]) -> bool:
    for tp, offset in end.items():
        if await consumer.position(tp) < offset:
            return False
    return True


def _workers(beats: list[Heartbeat], reports: list[Telemetry], timeout_s: float) -> list[WorkerStatus]:
    latest_hb: dict[str, Heartbeat] = {}
    for hb in beats:
        if hb.worker_id not in latest_hb or hb.sent_at >= latest_hb[hb.worker_id].sent_at:
            latest_hb[hb.worker_id] = hb
    latest_t: dict[str, Telemetry] = {}
    for t in reports:
        if t.worker_id not in latest_t or t.sent_at >= latest_t[t.worker_id].sent_at:
            latest_t[t.worker_id] = t
    now = time.time()
    out = []
    for wid, hb in sorted(latest_hb.items()):
        age = max(0.0, now - hb.sent_at)
        state = "silent" if age > timeout_s else "draining" if hb.draining else "live"
        t = latest_t.get(wid)
        row = WorkerStatus(
            worker_id=wid,
            model=hb.model,
            device=hb.device,
            dtype=hb.dtype,
            state=state,
            heartbeat_age_s=age,
            held=len(hb.running_ids),
        )
        if t is not None:
            row = row.model_copy(
                update={
                    "rt_running": t.rt.running,
                    "rt_waiting": t.rt.waiting,
                    "be_running": t.be.running,
                    "be_waiting": t.be.waiting,
                    "kv_usage": t.kv_usage,
                    "kv_blocks": t.kv_blocks,
                    "tokens_per_s": t.tokens_per_s,
                    "ttft_p50_s": t.ttft_p50_s,
                    "tpot_p50_s": t.tpot_p50_s,
                    "slo_attainment": t.slo_attainment,
                    "profiled": t.cost is not None,
                }
            )
        out.append(row)
    return out


def _pairs(records: list[LeaseRecord], lease_s: float) -> list[RoleStatus]:
    """Each role's term and instances, by the lease rules (shared/lease.py) on the records read.
    A standby announces itself every `lease_s`, the active renews every `lease_s / 2`: silent
    means no record for twice the lease."""
    now = time.time()
    out = []
    for role in sorted({r.role for r in records}):
        book = LeaseLog(role)
        last: dict[str, LeaseRecord] = {}
        for r in (r for r in records if r.role == role):
            book.apply(r, r.sent_at)
            last[r.holder] = r
        cur = book.current
        rows = []
        for holder, r in sorted(last.items()):
            age = max(0.0, now - r.sent_at)
            if r.state == "released":
                state = "stopped"
            elif age > 2 * lease_s:
                state = "silent"
            elif cur is not None and holder == cur.holder and not cur.released:
                state = "active"
            else:
                state = "standby"
            rows.append(InstanceStatus(instance=holder, state=state, age_s=age))
        out.append(RoleStatus(role=role, term=cur.term if cur else 0, instances=rows))
    return out


async def _sessions(consumer: AIOKafkaConsumer, topic: str, existing: dict[str, list[int]]) -> SessionStatus:
    tps = [TopicPartition(topic, p) for p in existing.get(topic, ())]
    if not tps:
        return SessionStatus()
    directory = SessionDirectory()
    for m in await _read(consumer, tps, lambda start, end: start):
        loc = decode_record(SessionLocation, m, tombstone_ok=True)
        if loc is not None:
            directory.apply(loc)
    copies = [c for sid in directory.session_ids() for c in directory.copies(sid)]
    return SessionStatus(sessions=len(directory), copies=len(copies), bytes=sum(c.nbytes for c in copies))


async def _queues(
    settings: ServiceSettings,
    consumer: AIOKafkaConsumer,
    topics: Topics,
    existing: dict[str, list[int]],
    capacity: list[BECapacity],
    timeout_s: float,
) -> QueueStatus:
    tps = [
        TopicPartition(t.name, p) for t in (topics.rt_requests, topics.be_requests) for p in existing.get(t.name, ())
    ]
    end = await consumer.end_offsets(tps) if tps else {}
    committed = await _committed(settings, tps, timeout_s)
    backlog = {t: 0 for t in (topics.rt_requests.name, topics.be_requests.name)}
    for tp in tps:
        backlog[tp.topic] += max(0, end[tp] - committed.get(tp, 0))
    last = max(capacity, key=lambda c: c.sent_at) if capacity else None
    return QueueStatus(
        rt_backlog=backlog[topics.rt_requests.name],
        be_backlog=backlog[topics.be_requests.name],
        scheduler_pending_be=last.pending if last else None,
        be_in_flight=last.in_flight if last else None,
        be_slots=last.slots if last else None,
    )


async def _committed(settings: ServiceSettings, tps: list[TopicPartition], timeout_s: float) -> dict:
    """The scheduler group's committed offsets (an admin request: no group is joined)."""
    if not tps:
        return {}
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, client_id="tandem-status-admin")
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
        async with asyncio.timeout(timeout_s):
            offsets = await admin.list_consumer_group_offsets(SCHEDULER_GROUP, partitions=tps)
        return {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}
    finally:
        await _quietly(admin.close())


async def _quietly(aw) -> None:
    try:
        await aw
    except Exception:  # noqa: BLE001 (closing after a failure: nothing more to report)
        pass
