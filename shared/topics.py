"""The topic catalogue: every Kafka topic Tandem uses, its partitions and its key, in one place.

| topic                      | partitions | key          | producers → consumers                               |
|----------------------------|-----------:|--------------|-----------------------------------------------------|
| `<p>.requests.rt`          |          4 | request id   | gateway → scheduler, advisory                       |
| `<p>.requests.be`          |          4 | request id   | gateway, queue → scheduler, advisory                |
| `<p>.dispatch.<worker id>` |          1 | request id   | scheduler → that worker                             |
| `<p>.results`              |          8 | none         | workers, scheduler → the request's gateway or queue |
| `<p>.control`              |          1 | see below    | gateway, queue, advisory → workers, scheduler       |
| `<p>.telemetry`            |          1 | worker id    | workers → scheduler, advisory                       |
| `<p>.heartbeats`           |          1 | worker id    | workers → scheduler, gateways, queue, advisory      |
| `<p>.owners`               |          1 | gateway id   | gateways → workers (a dead gateway's requests end)  |
| `<p>.scheduler.state`      | 1, compact | request id   | scheduler → scheduler (restart recovery)            |
| `<p>.scheduler.fences`     | 1, compact | worker id    | scheduler → scheduler, queue, advisory (fences)     |
| `<p>.be.capacity`          |          1 | scheduler id | scheduler → queue (BE flow control)                 |
| `<p>.placement.grants`     |          1 | scheduler id | scheduler → gateways (RT slots, two-hop dispatch)   |
| `<p>.batches`              |          1 | batch id     | gateway → queue (a batch was created or cancelled)  |
| `<p>.advisory`             |          4 | session id   | gateway → advisory (typing hints)                   |
| `<p>.sessions.directory`   | 4, compact | session id   | workers → advisory, scheduler                       |
| `<p>.sessions.placement`   | 4, compact | session id   | advisory → scheduler, advisory (after a restart)    |
| `<p>.leases`               |          1 | role         | scheduler, queue, advisory → themselves, status     |

Results carry no key: they are produced to an explicit partition that the request names
(`reply_partition`, chosen by the gateway, or by the queue service for batch items), and each
gateway replica and the queue service read only their own partition, so a stream reaches the
process holding the client's connection. On `control`, the gateway and the queue service send
`Cancel` (keyed by request id; workers and the scheduler act on it) and the advisory service
`Prefetch` (keyed by session id; the named worker acts on it). `Drain` (keyed by worker id) is
sent by `tandem drain WORKER` (an operator taking a worker out of placement; a worker also drains
itself on SIGTERM). The advisory service reads the request topics only to see a session's turn arrive.

Dispatch is one topic per worker so a worker reads only its own work and a dead worker's backlog
is simply abandoned (the scheduler re-places it). The two session topics are compacted: a
restarted advisory service or scheduler reads them from the start and has the latest location
and placement of every session (docs/sessions.md). `leases` elects the active instance of each
doubled service (shared/lease.py); one partition, so all readers agree on the order of claims.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    key: str  # what the message key holds (documentation and tests)
    compacted: bool = False


@dataclass(frozen=True)
class Topics:
    prefix: str = "tandem"

    def _t(self, suffix: str, partitions: int, key: str, compacted: bool = False) -> TopicSpec:
        return TopicSpec(f"{self.prefix}.{suffix}", partitions, key, compacted)

    @property
    def rt_requests(self) -> TopicSpec:
        return self._t("requests.rt", 4, "request id")

    @property
    def be_requests(self) -> TopicSpec:
        return self._t("requests.be", 4, "request id")

    def dispatch(self, worker_id: str) -> TopicSpec:
        return self._t(f"dispatch.{worker_id}", 1, "request id")

    @property
    def results(self) -> TopicSpec:
        return self._t("results", 8, "none (produced to the reader's partition)")

    @property
    def control(self) -> TopicSpec:
        return self._t("control", 1, "request, session or worker id")

    @property
    def telemetry(self) -> TopicSpec:
        return self._t("telemetry", 1, "worker id")

    @property
    def heartbeats(self) -> TopicSpec:
        return self._t("heartbeats", 1, "worker id")

    @property
    def owners(self) -> TopicSpec:
        return self._t("owners", 1, "gateway id")

    @property
    def scheduler_state(self) -> TopicSpec:
        return self._t("scheduler.state", 1, "request id", compacted=True)

    @property
    def scheduler_fences(self) -> TopicSpec:
        return self._t("scheduler.fences", 1, "worker id", compacted=True)

    @property
    def be_capacity(self) -> TopicSpec:
        return self._t("be.capacity", 1, "scheduler id")

    @property
    def placement_grants(self) -> TopicSpec:
        return self._t("placement.grants", 1, "scheduler id")

    @property
    def batches(self) -> TopicSpec:
        return self._t("batches", 1, "batch id")

    @property
    def advisory(self) -> TopicSpec:
        return self._t("advisory", 4, "session id")

    @property
    def sessions_directory(self) -> TopicSpec:
        return self._t("sessions.directory", 4, "session id", compacted=True)

    @property
    def sessions_placement(self) -> TopicSpec:
        return self._t("sessions.placement", 4, "session id", compacted=True)

    @property
    def leases(self) -> TopicSpec:
        return self._t("leases", 1, "role (scheduler, queue, advisory)")

    def static(self) -> list[TopicSpec]:
        """Topics created at start-up by every service (per-worker dispatch topics are created by their worker)."""
        return [
            self.rt_requests,
            self.be_requests,
            self.results,
            self.control,
            self.telemetry,
            self.heartbeats,
            self.owners,
            self.scheduler_state,
            self.scheduler_fences,
            self.be_capacity,
            self.placement_grants,
            self.batches,
            self.advisory,
            self.sessions_directory,
            self.sessions_placement,
            self.leases,
        ]
