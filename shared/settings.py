"""Settings every service shares. Each service subclasses `ServiceSettings` once (its one settings
object); values come from `TANDEM_<FIELD>` environment variables, and the broker address from
`KAFKA_BOOTSTRAP`, the only thing that differs between the embedded broker and production Kafka."""

from __future__ import annotations

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", frozen=True)

    kafka_bootstrap: str = Field(
        "127.0.0.1:9092", validation_alias=AliasChoices("KAFKA_BOOTSTRAP", "TANDEM_KAFKA_BOOTSTRAP")
    )
    topic_prefix: str = "tandem"  # lets several deployments share one Kafka cluster
    log_level: str = "INFO"
    log_json: bool = False  # one JSON object per line (for log shippers) instead of text
    # Apache Kafka answers a waiting fetch as soon as data arrives (set this true there: consumers
    # long-poll for `kafka_long_poll_wait_ms`). The embedded tansu broker answers only at the
    # fetch deadline (measured, docs/services.md "Fetch waits"): there consumers fetch with
    # `kafka_fetch_wait_ms` (token path) while records flow, stop fetching after `kafka_awake_ms`
    # without any, and wake on a producer's doorbell or every `kafka_idle_poll_ms`.
    kafka_long_poll: bool = False
    kafka_long_poll_wait_ms: int = 500
    # At 1 ms (issue 21, sixth session) the fuzzing test got 503 "no worker accepted the request in
    # time": tansu answers with what it read by the deadline, a 1 ms fetch deep in a long
    # partition read nothing, and a reader behind slept with records unread. Readers now catch up
    # at any wait (shared/quiet_consumer.py, "Catching up"; at 0 tansu never answers). Still 2: 1
    # is safe now, but whether it helps the gateway figures is not measured yet (seventh session).
    # docs/services.md, "Fetch waits".
    kafka_fetch_wait_ms: int = 2
    kafka_awake_ms: int = 50
    # The per-hop wake-up on the request/token path (issue 21, eighth session; shared/fetch_policy.py):
    # a hot reader also sleeps as soon as it has read what it was rung for, so no fetch is in
    # flight when the next record is rung and the ring's fetch answers at once, instead of the
    # record waiting out a fetch that read the partition before it landed. On by default since
    # the ninth session: the same p50 in every interleaved probe and bench pair, 10-29% less CPU
    # in the reader and the broker (docs/services.md, "Issue 21, ninth session").
    kafka_hot_settle: bool = True
    # The safety look of a sleeping consumer, for a lost ring (only producers outside this package
    # lose one): up to this much latency for such a record, never a loss. Each look is 1-2 fetches
    # per consumer, ~20 consumers in a stack: at 1 s that was most of the idle fetches.
    kafka_idle_poll_ms: int = 5000
    # OTLP/HTTP traces endpoint (e.g. http://collector:4318/v1/traces); empty = no export. Per-hop
    # latency histograms are on /metrics either way (shared/tracing.py).
    otlp_endpoint: str = ""
    metrics_port: int = 0  # Prometheus exporter port for services without an HTTP API; 0 = off
    # Periodic liveness messages (worker heartbeats, gateway owner heartbeats, the scheduler's BE
    # capacity keepalive) go out every `heartbeat_interval_s`; unset, it is derived from the
    # silence their readers tolerate: `worker_timeout_s / 3`. Each beat wakes every reader
    # (2-3 fetches each on tansu), so the slowest safe period is the cheapest; a third of the
    # timeout leaves two periods for a late beat on a starved machine (the longest gap measured
    # between a live worker's beats at load 16 on 2 cores was a 0.25 s period plus 0.85 s).
    heartbeat_interval_s: float | None = None
    # The broker watch (shared/broker_watch.py) checks for a restart when its idle connection to
    # the broker drops; this is only its safety check without such a sign (one metadata request).
    broker_watch_interval_s: float = 30.0
    # How long a consumer sits at offsets the broker acknowledged but never serves (tansu after a
    # restart) before it reads on from the high watermark (shared/hole_guard.py). No request.
    broker_hole_wait_s: float = 3.0
    # For this long after a broker restart, per-request log lines (gateway submissions, scheduler
    # receipts and placements) are INFO instead of DEBUG (shared/broker_watch.py, RecoveryWindow).
    broker_recovery_log_s: float = 120.0
    worker_timeout_s: float = 3.0  # a worker silent this long is declared lost
    # The doubled services (scheduler, queue, advisory): the active renews its lease every
    # lease_s / 2 and a standby claims lease_s after the last renewal it read (shared/lease.py),
    # so a takeover after a crash takes lease_s / 2 to lease_s plus the new active's start.
    lease_s: float = 3.0

    @model_validator(mode="after")
    def _derive_heartbeat_interval(self) -> ServiceSettings:
        if self.heartbeat_interval_s is None:
            # frozen model: set once here, while it is being built
            object.__setattr__(self, "heartbeat_interval_s", self.worker_timeout_s / 3)
        return self

    @classmethod
    def env_names(cls) -> set[str]:
        """Every environment variable this settings class reads (used by the Compose check)."""
        names = set()
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                names.update(str(a) for a in alias.choices)
            else:
                names.add(f"TANDEM_{name.upper()}")
        return names
