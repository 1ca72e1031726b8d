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
    for name in ("gateway", "queue-a", "queue-b"):  # all reach the same batch store
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


PAIRED_IDS = {"scheduler": "TANDEM_SCHEDULER_ID", "queue": "TANDEM_QUEUE_ID", "advisory": "TANDEM_ADVISORY_ID"}


def test_the_scheduler_queue_and_advisory_run_in_pairs(compose):
    """Issue 22: no single point of failure. Each of the three runs twice (one active, one
    standby by their lease, docs/reliability.md "HA pairs"): two services with the same command,
    settings identical but for the instance id (the lease holder, distinct), restarted by Compose
    when they exit (a deposed active exits 75 and comes back as the standby)."""
    services = _tandem_services(compose)
    for role, id_var in PAIRED_IDS.items():
        pair = {name: s for name, s in services.items() if s["command"] == [role]}
        assert len(pair) == 2, f"{role}: {sorted(pair)}"
        envs = [dict(s["environment"]) for s in pair.values()]
        ids = [env.pop(id_var) for env in envs]
        assert len(set(ids)) == 2 and set(ids) == set(pair), f"{role} ids {ids} must differ and name the service"
        assert envs[0] == envs[1], f"{role}: the two instances must be configured alike"
        assert all(s["restart"] == "unless-stopped" for s in pair.values())
        assert all(s.get("depends_on") == next(iter(pair.values())).get("depends_on") for s in pair.values())
