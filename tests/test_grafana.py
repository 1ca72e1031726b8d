"""The Grafana dashboard and its provisioning, checked statically (no Docker, no Grafana here):
every panel's query names only metrics some service registers, the dashboard covers what an
operator needs, and Compose mounts provisioning that exists and points at its Prometheus."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "deploy/grafana/dashboards"
METRIC = re.compile(r"\btandem_[a-z0-9_]+")
# what prometheus_client exports for each kind of metric registered under a name
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def registered_metrics() -> set[str]:
    """Every series name the services export: each `<registry>.counter|gauge|histogram("name", ...)`
    call in services/ and shared/ (all go through `shared.metrics.ServiceMetrics`, which adds the
    `tandem_` prefix), with the suffixes prometheus_client adds."""
    names = set()
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("shared/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in SUFFIXES
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                base = "tandem_" + node.args[0].value.removesuffix("_total")
                names.update(base + s for s in SUFFIXES[node.func.attr])
    return names


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside collapsed rows
    return [p for p in out if p.get("type") != "row"]


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files, "no dashboards"
    return {f.name: json.loads(f.read_text()) for f in files}


def test_the_scan_finds_known_metrics():
    # guards the test below against a scan that finds nothing (then nothing would be checked)
    known = registered_metrics()
    assert {"tandem_worker_kv_usage", "tandem_scheduler_placed_total", "tandem_gateway_ttft_seconds_bucket"} <= known


def test_every_panel_query_names_exported_metrics(dashboards):
    exported = registered_metrics()
    for name, dash in dashboards.items():
        for p in panels(dash):
            assert p.get("targets"), f"{name}: panel {p['title']!r} has no query"
            for t in p["targets"]:
                used = set(METRIC.findall(t["expr"]))
                assert used, f"{name}: {p['title']!r} queries no tandem metric: {t['expr']}"
                missing = used - exported
                assert not missing, f"{name}: {p['title']!r} names metrics no service exports: {sorted(missing)}"
                assert t["datasource"]["uid"] == "prometheus"


def test_the_dashboard_covers_the_operators_questions(dashboards):
    used = {m for d in dashboards.values() for p in panels(d) for t in p["targets"] for m in METRIC.findall(t["expr"])}
    wanted = {
        "per-class TTFT": "tandem_worker_ttft_seconds_bucket",
        "per-class TPOT": "tandem_worker_tpot_seconds_bucket",
        "SLO attainment": "tandem_worker_slo_requests_total",
        "BE throughput": "tandem_worker_generated_tokens_total",
        "BE backlog": "tandem_scheduler_pending",
        "KV per worker": "tandem_worker_kv_usage",
        "placement decisions": "tandem_scheduler_placement_decisions_total",
        "per-hop latency": "tandem_gateway_ttft_seconds_bucket",
        "consumer lag": "tandem_scheduler_consumer_lag",
    }
    assert not {k: v for k, v in wanted.items() if v not in used}
    ids = [p["id"] for d in dashboards.values() for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_compose_provisions_grafana_from_the_repo():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana")
    assert "prometheus" in grafana["depends_on"]
    mounts = {}
    for v in grafana["volumes"]:
        host, container = v.split(":")[:2]
        if host.startswith("./"):
            assert (ROOT / host).exists(), f"{host} is mounted but missing"
            mounts[container] = ROOT / host
    provisioning = mounts["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] == "prometheus"
    assert ds["url"].split("//")[1].split(":")[0] in compose["services"]  # Compose's Prometheus service
    (provider,) = yaml.safe_load((provisioning / "dashboards/tandem.yml").read_text())["providers"]
    assert mounts[provider["options"]["path"]] == DASHBOARDS
