"""Settings every service shares. Each service subclasses `ServiceSettings` once (its one settings
object); values come from `TANDEM_<FIELD>` environment variables, and the broker address from
`KAFKA_BOOTSTRAP`, the only thing that differs between the embedded broker and production Kafka."""

from __future__ import annotations

from pydantic import AliasChoices, Field
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
    kafka_fetch_wait_ms: int = 2
    kafka_awake_ms: int = 50
    kafka_idle_poll_ms: int = 1000
    # OTLP/HTTP traces endpoint (e.g. http://collector:4318/v1/traces); empty = no export. Per-hop
    # latency histograms are on /metrics either way (shared/tracing.py).
    otlp_endpoint: str = ""
    metrics_port: int = 0  # Prometheus exporter port for services without an HTTP API; 0 = off
    heartbeat_interval_s: float = 0.5
    # How often each service checks that the broker has not restarted (lost its topics) under
    # it: one metadata request per check (shared/broker_watch.py).
    broker_watch_interval_s: float = 1.0
    # How long a consumer sits at offsets the broker acknowledged but never serves (tansu after a
    # restart) before it reads on from the high watermark (shared/hole_guard.py). No request.
    broker_hole_wait_s: float = 3.0
    worker_timeout_s: float = 3.0  # a worker silent this long is declared lost
    # The doubled services (scheduler, queue, advisory): the active renews its lease every
    # lease_s / 3 and a standby claims after lease_s without a renewal (shared/lease.py), so a
    # takeover after a crash takes lease_s to 4/3 lease_s plus the new active's start.
    lease_s: float = 3.0

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
