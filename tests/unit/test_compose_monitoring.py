"""compose.yaml's Prometheus and Grafana agree with the coordinator and with their own files:
the scrape target is the coordinator's service, port and metrics route; Grafana's data source
is the Prometheus service; the provisioned dashboards are docs/grafana/'s (issue 15, compose).

No Docker: the files are parsed. Which metrics the dashboard queries is checked against a real
/metrics page in tests/component/test_api_metrics.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.coordinator.service import CoordinatorSettings
from tests.unit.test_compose import (
    COMPOSE,
    ROOT,
    THIRD_PARTY,
    environment,
    settings_from,
)

DASHBOARDS = ROOT / "docs" / "grafana"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return found


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: container path -> file or directory of this repository."""
    out: dict[str, Path] = {}
    for spec in service.get("volumes") or []:
        source, target, *_ = str(spec).split(":")
        if source.startswith("."):
            out[target] = (ROOT / source).resolve()
    return out


def container_port(service: dict[str, Any]) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports") or []}


def test_third_party_images_are_pinned(services: dict[str, dict[str, Any]]) -> None:
    assert {"prometheus", "grafana"} <= set(services)
    for name in THIRD_PARTY:
        image = services[name]["image"]
        assert re.fullmatch(r"[a-z/-]+:v?\d+\.\d+\.\d+", image), (name, image)
        assert "build" not in services[name], name


def test_prometheus_scrapes_the_coordinators_metrics(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    prometheus = services["prometheus"]
    assert "command" not in prometheus  # the image's own flags: its default config path
    config_path = mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    assert config_path.is_file() and config_path.is_relative_to(ROOT / "deploy")
    config = yaml.safe_load(config_path.read_text())
    coordinator = settings_from(
        monkeypatch, environment(services["coordinator"]), CoordinatorSettings
    )
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job.get("scheme", "http") == "http"
    assert "authorization" not in job and "basic_auth" not in job  # /metrics is open
    (static,) = job["static_configs"]
    assert static["targets"] == [f"coordinator:{coordinator.port}"]
    # It is the port the coordinator listens on in its container, on every interface.
    assert coordinator.port in container_port(services["coordinator"])
    assert coordinator.host == "0.0.0.0"
    assert prometheus["depends_on"]["coordinator"]["condition"] == "service_started"


async def test_the_metrics_route_is_the_apis() -> None:
    from pydantic import SecretStr

    from controlplane.api.app import create_app
    from controlplane.coordinator.service import Coordinator
    from controlplane.kafka.settings import KafkaSettings

    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr("t")
    )
    coordinator = Coordinator(settings)  # never started
    try:
        routes = {getattr(route, "path", None) for route in create_app(coordinator).routes}
    finally:
        await coordinator.stop()
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["metrics_path"] in routes


def test_grafana_reads_prometheus_and_provisions_the_dashboards(
    services: dict[str, dict[str, Any]],
) -> None:
    grafana = services["grafana"]
    bound = mounts(grafana)
    provisioning = bound["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    port = container_port(services["prometheus"])
    assert source["url"] in {f"http://prometheus:{p}" for p in port} and port == {9090}
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "fleet.yml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    assert bound[folder] == DASHBOARDS.resolve()
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(folder + "/")
    assert (DASHBOARDS / home.removeprefix(folder + "/")).is_file()
    for name in ("prometheus-data", "grafana-data"):
        assert name in yaml.safe_load(COMPOSE.read_text())["volumes"]


def test_each_dashboard_uses_the_data_source_variable() -> None:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files
    uids = set()
    for path in files:
        dashboard = json.loads(path.read_text())
        uids.add(dashboard["uid"])
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        assert len(panels) >= 8
        for panel in panels:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]
                assert "controlplane_" in target["expr"], panel["title"]
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), path
    assert len(uids) == len(files)
