"""compose.yaml agrees with the code: settings fields, Kafka listeners, ports, CLI commands.

No Docker needed: the file is parsed with PyYAML, its environment is fed to the real settings
classes, and its commands are run with ``--help`` through our typer apps.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from controlplane.cli import main as _registered  # noqa: F401  (registers the commands)
from controlplane.cli.common import app as controlplane_app
from controlplane.coordinator.service import ENV_PREFIX as COORDINATOR_PREFIX
from controlplane.coordinator.service import CoordinatorSettings
from workers.agent.settings import ENV_PREFIX as WORKER_PREFIX
from workers.agent.settings import WorkerSettings
from workers.cli import app as worker_app
from workers.runners.base import RUNNERS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"

#: Each entry point of pyproject's [project.scripts] and the typer app behind it.
CLI_APPS: dict[str, typer.Typer] = {"controlplane": controlplane_app, "fleet-worker": worker_app}
PYTHON_MODULES: dict[str, str] = {"controlplane": "controlplane", "workers": "fleet-worker"}

_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")

#: Services that run someone else's pinned image (not ours, built from the Dockerfile).
THIRD_PARTY: frozenset[str] = frozenset({"kafka", "prometheus", "grafana"})

#: What a user exports before `docker compose up` (docs/compose.md): the write token, required.
UP_ENV: dict[str, str] = {"FLEET_COORDINATOR_API_TOKEN": "token-given-at-up"}


class ComposeRefused(ValueError):
    """``${NAME:?message}`` with NAME unset or empty: `docker compose` stops with the message."""


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ``${NAME}``, ``${NAME:-default}``, ``${NAME:?error}`` (and their forms without
    the colon, which only look at whether NAME is set) and ``$$``, as ``docker compose``
    resolves them."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = env.get(name)
        missing = value is None or (op is not None and op.startswith(":") and not value)
        if op is not None and op.endswith("?") and missing:
            raise ComposeRefused(f"required variable {name} is missing a value: {arg}")
        if op is not None and op.endswith("-") and missing:
            return arg
        return value or ""

    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def environment(service: Mapping[str, Any], env: Mapping[str, str] = UP_ENV) -> dict[str, str]:
    """A service's environment as the container gets it (list or map form, interpolated with
    ``env``: by default what docs/compose.md tells a user to export)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {str(k): interpolate(str(v), env) for k, v in raw.items()}


def fleet_services(
    services: Mapping[str, Mapping[str, Any]], program: str
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for name, service in services.items():
        if command(service)[:1] == [program]:
            yield name, service


def command(service: Mapping[str, Any]) -> list[str]:
    raw = service.get("command") or []
    return [str(part) for part in (raw.split() if isinstance(raw, str) else raw)]


def option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
        for name in names:
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
    return None


def listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` -> {NAME: (host, port)}."""
    out: dict[str, tuple[str, int]] = {}
    for item in value.split(","):
        name, _, address = item.strip().partition("://")
        host, _, port = address.rpartition(":")
        out[name] = (host, int(port))
    return out


def field_path(model: type[BaseModel], name: str) -> list[str]:
    """The settings field an env var (prefix stripped) sets, following nested models with "__"."""
    path: list[str] = []
    current: type[BaseModel] | None = model
    for part in name.lower().split("__"):
        assert current is not None, f"{name}: {path} is not a nested model"
        assert part in current.model_fields, (
            f"{name}: {part!r} is not a field of {current.__name__} "
            f"(fields: {sorted(current.model_fields)})"
        )
        path.append(part)
        annotation = current.model_fields[part].annotation
        current = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return path


def settings_from(
    monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str], settings_cls: type[BaseModel]
) -> Any:
    with monkeypatch.context() as patch:
        for key in list(os.environ):
            if key.startswith("FLEET_"):
                patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        return settings_cls()


def value_at(settings: BaseModel, path: list[str]) -> Any:
    value: Any = settings
    for part in path:
        value = getattr(value, part)
    return value


# --------------------------------------------------------------------------- kafka


def test_kafka_is_the_official_image_in_kraft_single_node_mode(
    services: dict[str, dict[str, Any]],
) -> None:
    kafka = services["kafka"]
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", kafka["image"]), kafka["image"]
    env = environment(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node_id = env["KAFKA_NODE_ID"]
    bound = listeners(env["KAFKA_LISTENERS"])
    advertised = listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(
        item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert set(bound) <= set(protocols) and set(advertised) <= set(protocols)
    assert controller in bound and controller not in advertised
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    # The single voter is this node, on its controller listener.
    voter_id, _, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].partition("@")
    host, _, port = voter.rpartition(":")
    assert voter_id == node_id
    assert host in (kafka.get("hostname"), "kafka", "localhost")
    assert int(port) == bound[controller][1]
    # Every advertised listener is bound on the same port.
    for name, (_, port_) in advertised.items():
        assert bound[name][1] == port_, name
    # One broker: internal topics must not ask for more replicas than there are brokers.
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == "1", key
    assert env["CLUSTER_ID"]
    # Data survives `docker compose down` (not -v): the log is the coordinator's source of truth.
    data_dir = env["KAFKA_LOG_DIRS"]
    assert any(str(v).split(":")[1] == data_dir for v in kafka["volumes"])
    assert kafka["healthcheck"]["test"]


def internal_bootstrap(services: dict[str, dict[str, Any]]) -> str:
    """The advertised listener other containers reach: host is the kafka service's name."""
    kafka = services["kafka"]
    names = {"kafka", kafka.get("hostname")}
    inside = [
        f"{host}:{port}"
        for host, port in listeners(environment(kafka)["KAFKA_ADVERTISED_LISTENERS"]).values()
        if host in names
    ]
    assert len(inside) == 1, inside
    return inside[0]


def test_the_host_listener_is_published(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    advertised = listeners(environment(kafka)["KAFKA_ADVERTISED_LISTENERS"])
    host_ports = {port for host, port in advertised.values() if host == "localhost"}
    published = {int(str(p).split(":")[0]) for p in kafka["ports"]}
    assert host_ports and host_ports <= published


# --------------------------------------------------------------------------- settings


def test_coordinator_environment_is_real_settings(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = services["coordinator"]
    env = environment(coordinator)
    ours = {k: v for k, v in env.items() if k.startswith(COORDINATOR_PREFIX)}
    # The other FLEET_* variables are exactly the CLI's (test_the_cli_in_the_coordinator_...).
    others = {k for k in env if k.startswith("FLEET_") and k not in ours}
    assert ours and others <= set(cli_envvars().values()), sorted(others)
    settings = settings_from(monkeypatch, env, CoordinatorSettings)
    for key, raw in ours.items():
        path = field_path(CoordinatorSettings, key.removeprefix(COORDINATOR_PREFIX))
        landed = value_at(settings, path)
        if hasattr(landed, "get_secret_value"):
            landed = landed.get_secret_value()
        assert str(landed) == raw, (key, landed, raw)
    assert settings.kafka.bootstrap_servers == internal_bootstrap(services)
    assert settings.host == "0.0.0.0"  # reachable from the host through the published port
    assert settings.api_token is not None and settings.api_token.get_secret_value()
    # A token given at `docker compose up` replaces the placeholder.
    given = environment(coordinator, {"FLEET_COORDINATOR_API_TOKEN": "s3cret"})
    assert given["FLEET_COORDINATOR_API_TOKEN"] == "s3cret"
    # Reads stay open unless a read token is given (an empty one is none).
    assert settings.api_read_token is None or not settings.api_read_token.get_secret_value()
    # The published port is the port it serves on, and the one its healthcheck asks.
    targets = {int(str(p).rsplit(":", 1)[-1]) for p in coordinator["ports"]}
    assert targets == {settings.port}
    probe = " ".join(coordinator["healthcheck"]["test"])
    assert f"127.0.0.1:{settings.port}/readyz" in probe


def cli_envvars() -> dict[str, str]:
    """Each option of the controlplane CLI that an environment variable sets -> the variable,
    read from the typer app (the same name in every command, checked)."""
    found: dict[str, str] = {}

    def walk(cmd: Any) -> None:  # typer's own click (typer._click), not the click package
        for param in cmd.params:
            if param.param_type_name == "option" and isinstance(param.envvar, str):
                name = max(param.opts, key=len)
                assert found.setdefault(name, param.envvar) == param.envvar, (name, param.envvar)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(controlplane_app))
    return found


def test_the_cli_in_the_coordinator_container_needs_no_flag(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`docker compose exec coordinator controlplane status`: the CLI's variables point it at
    the broker and the topics the coordinator itself uses."""
    env = environment(services["coordinator"])
    names = cli_envvars()
    settings = settings_from(monkeypatch, env, CoordinatorSettings)
    assert env[names["--bootstrap"]] == settings.kafka.bootstrap_servers
    assert env[names["--topic-prefix"]] == settings.kafka.topic_prefix
    assert (names["--bootstrap"], names["--topic-prefix"]) == (
        "FLEET_KAFKA_BOOTSTRAP",
        "FLEET_TOPIC_PREFIX",
    )
    # The documented `docker compose exec coordinator controlplane ...` lines (with their
    # continuation lines) pass no --bootstrap; neither does this file's own example.
    for text in ((ROOT / "docs" / "compose.md").read_text(), COMPOSE.read_text()):
        calls = re.findall(r"exec coordinator controlplane (?:[^\n]*\\\n)*[^\n]*", text)
        assert calls and not [c for c in calls if "--bootstrap" in c], calls


@pytest.mark.parametrize("env", [{}, {"FLEET_COORDINATOR_API_TOKEN": ""}])
def test_compose_refuses_to_start_without_a_write_token(
    services: dict[str, dict[str, Any]], env: dict[str, str]
) -> None:
    """No default token (it was "change-me", the same in every deployment): `docker compose
    up` stops, naming the variable, unless one is exported."""
    with pytest.raises(ComposeRefused, match="FLEET_COORDINATOR_API_TOKEN"):
        environment(services["coordinator"], env)


def test_a_read_token_reaches_the_coordinator_and_the_workers_healthcheck(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers' healthcheck asks the coordinator's API, whose reads then need the token."""
    up = {**UP_ENV, "FLEET_COORDINATOR_API_READ_TOKEN": "r3ad"}
    settings = settings_from(
        monkeypatch, environment(services["coordinator"], up), CoordinatorSettings
    )
    assert settings.api_read_token is not None
    assert settings.api_read_token.get_secret_value() == "r3ad"
    for name, service in fleet_services(services, "fleet-worker"):
        if command(service)[:2] != ["fleet-worker", "run"]:
            continue
        env = environment(service, up)
        probe = " ".join(service["healthcheck"]["test"])
        (variable,) = re.findall(r"os\.environ\.get\('([A-Z_]+)'\)", probe)
        assert env[variable] == "r3ad" and "'Authorization': 'Bearer ' +" in probe, name
        assert not variable.startswith(WORKER_PREFIX), "not a worker setting"


def test_worker_environment_is_real_settings(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = dict(fleet_services(services, "fleet-worker"))
    runs = {n: s for n, s in workers.items() if command(s)[:2] == ["fleet-worker", "run"]}
    assert len(runs) >= 2, sorted(workers)
    ids: set[str] = set()
    for name, service in runs.items():
        env = environment(service)
        ours = {k: v for k, v in env.items() if k.startswith("FLEET_")}
        assert all(k.startswith(WORKER_PREFIX) for k in ours), sorted(ours)
        settings = settings_from(monkeypatch, env, WorkerSettings)
        for key in ours:
            field_path(WorkerSettings, key.removeprefix(WORKER_PREFIX))
        assert settings.worker_id == env["FLEET_WORKER_WORKER_ID"]
        ids.add(settings.worker_id)
        assert settings.labels == json.loads(env["FLEET_WORKER_LABELS"]) and settings.labels
        assert settings.kafka.bootstrap_servers == internal_bootstrap(services)
        assert settings.runner in RUNNERS
        assert settings.runner_options == json.loads(env["FLEET_WORKER_RUNNER_OPTIONS"])
        assert settings.allowed_roots == [
            Path(p) for p in json.loads(env["FLEET_WORKER_ALLOWED_ROOTS"])
        ]
        assert str(settings.state_dir) == env["FLEET_WORKER_STATE_DIR"]
        assert settings.heartbeat_interval_s == float(env["FLEET_WORKER_HEARTBEAT_INTERVAL_S"])
        # Every allowed root is a mounted volume; the state directory is the worker's own volume.
        mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in service["volumes"]}
        for root in settings.allowed_roots:
            assert str(root) in mounts, (name, root)
        assert str(settings.state_dir) in mounts, name
        # The drain gets its time before Docker's SIGKILL.
        grace = float(str(service["stop_grace_period"]).removesuffix("s"))
        assert grace > settings.drain_timeout_s, name
    assert len(ids) == len(runs), "worker ids must be unique"
    state_volumes = [
        next(v for v in s["volumes"] if str(v).endswith(":/var/lib/fleet")) for s in runs.values()
    ]
    assert len(set(state_volumes)) == len(state_volumes), "each worker keeps its own state"


def test_every_kafka_client_uses_one_topic_prefix(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefixes = {
        settings_from(
            monkeypatch, environment(services["coordinator"]), CoordinatorSettings
        ).kafka.topic_prefix
    }
    for _, service in fleet_services(services, "fleet-worker"):
        if command(service)[:2] == ["fleet-worker", "run"]:
            prefixes.add(
                settings_from(monkeypatch, environment(service), WorkerSettings).kafka.topic_prefix
            )
    topics = command(services["topics"])
    prefixes.add(option(topics, "--topic-prefix") or "fleet")
    assert len(prefixes) == 1, prefixes
    assert option(topics, "--bootstrap", "-b") == internal_bootstrap(services)


def test_checkpoints_are_shared_between_the_writer_and_the_workers(
    compose: dict[str, Any], services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = command(services["checkpoints"])
    assert writer[:3] == ["fleet-worker", "checkpoint", "write"]
    out = Path(writer[3])
    mounts = {
        str(v).split(":")[1]: str(v).split(":")[0] for v in services["checkpoints"]["volumes"]
    }
    (volume,) = [vol for target, vol in mounts.items() if out.is_relative_to(target)]
    assert volume in compose["volumes"]
    for name, service in fleet_services(services, "fleet-worker"):
        if command(service)[:2] != ["fleet-worker", "run"]:
            continue
        settings = settings_from(monkeypatch, environment(service), WorkerSettings)
        theirs = {str(v).split(":")[0]: str(v) for v in service["volumes"]}
        assert volume in theirs, name
        assert theirs[volume].endswith(":ro"), f"{name}: workers only read checkpoints"
        assert any(out.is_relative_to(root) for root in settings.allowed_roots), name
    for service in services.values():
        for spec in service.get("volumes") or []:
            source = str(spec).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose["volumes"], source


# --------------------------------------------------------------------------- dependencies


def test_kafka_clients_wait_for_a_healthy_broker_and_the_topics(
    services: dict[str, dict[str, Any]],
) -> None:
    clients = [
        name
        for name, service in services.items()
        if name != "kafka"
        and (
            any(k.endswith("KAFKA__BOOTSTRAP_SERVERS") for k in environment(service))
            or option(command(service), "--bootstrap", "-b")
        )
    ]
    assert {"topics", "coordinator", "worker-1", "worker-2"} <= set(clients)
    for name in clients:
        depends = services[name]["depends_on"]
        assert depends["kafka"]["condition"] == "service_healthy", name
        if name != "topics":
            assert depends["topics"]["condition"] == "service_completed_successfully", name
    for name in ("kafka", "coordinator", "worker-1", "worker-2"):
        assert services[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name


# --------------------------------------------------------------------------- commands and image


def test_commands_are_real_cli_commands(services: dict[str, dict[str, Any]]) -> None:
    """Each command, with ``--help`` appended, parses: the command path and every option exist."""
    runner = CliRunner()
    checked = 0
    for name, service in services.items():
        argv = command(service)
        if not argv:
            continue
        if argv[:2] == ["python", "-m"]:
            program, args = PYTHON_MODULES[argv[2]], argv[3:]
        else:
            program, args = argv[0], argv[1:]
        assert program in CLI_APPS, f"{name}: {argv[0]} is not one of our commands"
        result = runner.invoke(CLI_APPS[program], [*args, "--help"])
        assert result.exit_code == 0, f"{name}: {argv}: {result.output}"
        assert "Usage:" in result.output
        checked += 1
    assert checked >= 5


def test_fleet_services_run_the_image_built_from_the_dockerfile(
    services: dict[str, dict[str, Any]],
) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(CLI_APPS) <= set(scripts)
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"pip install .*\.\[torch,verify\]", dockerfile)
    for name, service in services.items():
        if name in THIRD_PARTY:
            continue
        build = service["build"]
        assert (
            ROOT / build["context"] / build.get("dockerfile", "Dockerfile")
        ).resolve() == DOCKERFILE
