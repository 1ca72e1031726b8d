"""docker-compose.yml cannot run here (no Docker), so check what can be checked statically:
every Tandem service runs a real `tandem` subcommand and sets only variables its settings read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.advisory.settings import AdvisorySettings
from services.cli import build_parser
from services.gateway.settings import GatewaySettings
from services.queue.settings import QueueSettings
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings
from shared.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[1]


SETTINGS = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "worker": WorkerSettings,
    "topics": ServiceSettings,
    "queue": QueueSettings,
    "advisory": AdvisorySettings,
}
NOT_OURS = {"HF_HUB_OFFLINE"}  # read by libraries, not by our settings


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _tandem_services(compose: dict) -> dict:
    return {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("tandem")}


def test_topology(compose):
    services = compose["services"]
    assert services["kafka"]["image"].startswith("apache/kafka")
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert "kafka-data" in compose["volumes"]
    commands = [s["command"][0] for s in _tandem_services(compose).values()]
    assert commands.count("worker") == 2 and "gateway" in commands and "scheduler" in commands
    assert "queue" in commands and services["postgres"]["image"].startswith("postgres")
    assert "advisory" in commands  # typing hints -> session placement (docs/sessions.md)
    for name in ("gateway", "queue"):  # both reach the same batch store
        assert services[name]["environment"]["TANDEM_DATABASE_URL"].startswith("postgresql+asyncpg://")
    for s in _tandem_services(compose).values():
        if s["command"][0] == "worker":
            devices = s["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert any(v.endswith(":ro") for v in s["volumes"])  # model directory read-only
    assert (ROOT / "deploy/prometheus.yml").exists()


def test_every_command_is_a_real_subcommand(compose):
    parser = build_parser()
    for name, s in _tandem_services(compose).items():
        args = parser.parse_args(s["command"])  # exits (fails the test) on an unknown command or flag
        assert callable(args.func), name


def test_every_env_var_is_read_by_the_service_settings(compose):
    for name, s in _tandem_services(compose).items():
        accepted = SETTINGS[s["command"][0]].env_names() | NOT_OURS
        unknown = set(s.get("environment", {})) - accepted
        assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"


def test_prometheus_scrapes_every_service(compose):
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {n for n, s in _tandem_services(compose).items() if s["command"][0] != "topics"} <= targets
