"""The scheduler's Prometheus metrics, registered once and handed around as one typed object."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import ServiceMetrics


@dataclass(frozen=True)
class SchedulerMetrics:
    placed: Counter
    rerouted: Counter
    pending: Gauge
    decisions: Counter
    lag: Gauge
    predicted: Histogram
    workers: Gauge
    active: Gauge
    worker_up: Gauge
    sessions: Counter
    housekeeping: Counter

    @classmethod
    def register(cls, m: ServiceMetrics) -> SchedulerMetrics:
        return cls(
            placed=m.counter("scheduler_placed_total", "requests placed", ("req_class",)),
            rerouted=m.counter("scheduler_rerouted_total", "requests re-placed after a worker loss"),
            pending=m.gauge("scheduler_pending", "requests waiting for capacity", ("req_class",)),
            decisions=m.counter(
                "scheduler_placement_decisions_total",
                "placements by outcome: meets_slo, over_slo_admitted, rejected, unpredicted (no SLO prediction), "
                "granted (a gateway placed it in this scheduler's RT grant)",
                ("req_class", "outcome"),
            ),
            lag=m.gauge("scheduler_consumer_lag", "request records not yet read by the scheduler", ("topic",)),
            predicted=m.histogram(
                "scheduler_predicted_ttft_seconds", "TTFT the SLO placement predicted on the chosen worker"
            ),
            workers=m.gauge("scheduler_live_workers", "workers heartbeating"),
            active=m.gauge("scheduler_active", "1: this instance holds the lease (active), 0: standby"),
            # Per worker: 1 while the scheduler places on it, 0 while it drains; removed once it
            # is lost. Set as each heartbeat is applied, so it shows exactly when a worker can get
            # work (the test stacks wait on it; docs/services.md, "Testing under load").
            worker_up=m.gauge(
                "scheduler_worker_up", "1: the scheduler places on this worker, 0: it drains", ("worker_id",)
            ),
            sessions=m.counter(
                "scheduler_session_turns_total",
                "session turns by route: placement, holder, moved (with a KV source), other",
                ("route",),
            ),
            # Moves once per housekeeping pass: one that stalls shows here (and tests wait on it).
            housekeeping=m.counter("scheduler_housekeeping_passes_total", "housekeeping passes completed"),
        )
