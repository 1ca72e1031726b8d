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
    # How long the broker may hold a fetch that finds no data, for consumers on the token path.
    # Apache Kafka answers a waiting fetch as soon as data arrives; the embedded tansu broker only
    # at this deadline, so there it bounds each hop's latency (at the cost of more idle fetches).
    kafka_fetch_wait_ms: int = 2
    metrics_port: int = 0  # Prometheus exporter port for services without an HTTP API; 0 = off
    heartbeat_interval_s: float = 0.5
    worker_timeout_s: float = 3.0  # a worker silent this long is declared lost

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
