"""compose.secure.yaml on a real broker, without Docker: the deployment its services make,
step by step, with the project's own Kafka 4.1 jars in place of the apache/kafka image.

- ``kafka-secrets``: its ``controlplane broker secure-files`` command, then each user's CA and
  password file copied into a directory of its own (mode 0600), as its script does;
- ``kafka``: its KAFKA_* environment rendered into server.properties by the image's rules
  (tests/unit/test_compose_secure.py: ``image_properties``, plus what it writes to the image's
  file input), its KAFKA_OPTS given to the broker's JVM (JAVA_TOOL_OPTIONS), storage formatted
  with every user's SCRAM credentials, started by :class:`LocalBroker`;
- ``topics``: its command, as admin with its environment;
- ``kafka-acls``: the ``grant-acls.sh`` the secrets command wrote, with Kafka's AclCommand;
- ``worker-1``, ``coordinator``, ``ci``: their environments read by their own settings classes.

What differs from Docker, and only that: the host names and ports (``kafka`` is ``localhost``,
free ports replace 19092, 9092 and 9093, listeners bind 127.0.0.1) and the directories the
volumes are mounted at. LocalBroker's own sizing properties (threads, partitions) and the
node's secure properties are there too, under the compose ones (which win); the broker's
SCRAM login comes only from the JAAS file (the node's property names a listener, SASL_SSL,
that this configuration does not have).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from controlplane.cli.admin import ACL_SCRIPT
from controlplane.cli.common import app as controlplane_app
from controlplane.cli.render import Output
from controlplane.cli.rollout import _publish_and_maybe_wait
from controlplane.coordinator.follower import Follower
from controlplane.coordinator.publisher import RolloutRequest
from controlplane.kafka.broker import BrokerConfig, LocalBroker
from controlplane.kafka.secure import PRINCIPALS, SECURE_DIR
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.exits import CliExit
from controlplane.wire.protocol import ReloadWeightsSpec, Selector
from tests.factories import free_port, running_agent, weights_dir
from tests.fleet import make_command, publish
from tests.integration.conftest import RecordingRunner
from tests.integration.test_verdicts import coordinator_on, until
from tests.unit.test_compose import COMPOSE, command, environment, option
from tests.unit.test_compose_secure import (
    SECURE,
    command_secrets,
    image_properties,
    kafka_file_input,
    kafka_settings_of,
    merge,
    script,
)

pytestmark = [pytest.mark.kafka]

#: Where compose.secure.yaml mounts each user's volume, and the broker's.
CLIENT_SECRETS = "/run/secrets/kafka"
BROKER_SECRETS = "/secure"


@dataclass
class Deployment:
    services: dict[str, dict[str, Any]]
    broker: LocalBroker
    #: (value, user) -> the value on this machine (paths, host names, ports)
    relocate: Callable[..., str]


def _services() -> dict[str, dict[str, Any]]:
    merged = merge(yaml.safe_load(COMPOSE.read_text()), yaml.safe_load(SECURE.read_text()))
    found: dict[str, dict[str, Any]] = merged["services"]
    return found


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    services = _services()
    root = tmp_path_factory.mktemp("compose-secure")
    data_dir = root / "broker"
    secure = data_dir / SECURE_DIR  # where LocalBroker keeps (and reuses) a broker's secrets
    ports = {19092: free_port(), 9092: free_port(), 9093: free_port()}

    def relocate(value: str, user: str | None = None) -> str:
        if value == BROKER_SECRETS:
            return str(secure)
        value = value.replace(f"{BROKER_SECRETS}/", f"{secure}/")
        if user is not None:
            value = value.replace(f"{CLIENT_SECRETS}/", f"{root / 'users' / user}/")
        value = value.replace("/var/lib/kafka/data", str(data_dir / "kraft-logs"))

        def address(match: re.Match[str]) -> str:
            host = {"": "127.0.0.1", "kafka": "localhost"}.get(match.group(1), match.group(1))
            return f"{host}:{ports[int(match.group(2))]}"

        return re.sub(r"(?<![\w.])(kafka|localhost|)(?<!\d):(19092|9092|9093)\b", address, value)

    # kafka-secrets: its command, then its copies (install -m 0600 into each user's volume).
    init = script(services["kafka-secrets"])
    (line,) = [ln.strip() for ln in init.splitlines() if ln.strip().startswith("controlplane ")]
    argv = [relocate(arg) for arg in line.split()[1:]]
    made = CliRunner().invoke(controlplane_app, argv)
    assert made.exit_code == 0, made.output
    for user in command_secrets(services).values():
        own = root / "users" / user
        own.mkdir(parents=True, mode=0o700)
        for name in ("ca.pem", f"{user}.password"):
            shutil.copyfile(secure / name, own / name)
            (own / name).chmod(0o600)

    # kafka: the image's rendering of its environment, on this machine.
    kafka = services["kafka"]
    env = environment(kafka)
    props = {k: relocate(v) for k, v in (image_properties(env) | kafka_file_input(kafka)).items()}
    broker = LocalBroker(
        BrokerConfig(
            port=ports[19092],
            controller_port=ports[9093],
            data_dir=data_dir,
            secure=True,
            cluster_id=env["CLUSTER_ID"],
            quorum_voters=props["controller.quorum.voters"],
            overrides=props,
        )
    )
    saved = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = relocate(env["KAFKA_OPTS"])  # the image's KAFKA_OPTS
    try:
        broker.start(timeout=120)
    finally:
        if saved is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = saved
    try:
        # topics: its command as admin.
        topics = services["topics"]
        topics_env = {k: relocate(v, "admin") for k, v in environment(topics).items()}
        made = CliRunner().invoke(
            controlplane_app, [relocate(a) for a in command(topics)[1:]], env=topics_env
        )
        assert made.exit_code == 0, made.output
        # kafka-acls: the script, with Kafka's AclCommand from the project's jars.
        acls = services["kafka-acls"]
        aclcommand = root / "kafka-acls.sh"
        aclcommand.write_text(
            "#!/bin/sh\nexec java -Xmx128m -XX:TieredStopAtLevel=1 "
            f"-Dlog4j2.configurationFile={data_dir / 'log4j2.xml'} "
            f'-cp "{broker.config.jars_dir}/*" org.apache.kafka.tools.AclCommand "$@"\n'
        )
        aclcommand.chmod(0o700)
        script_args = command(acls)
        assert script_args[0] == f"{BROKER_SECRETS}/{ACL_SCRIPT}"
        granted = subprocess.run(
            ["sh", relocate(script_args[0]), relocate(script_args[1]), str(aclcommand)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert granted.returncode == 0, granted.stdout + granted.stderr
        yield Deployment(services, broker, relocate)
    finally:
        broker.stop()


def settings_of(
    deployment: Deployment, name: str, monkeypatch: pytest.MonkeyPatch
) -> KafkaSettings:
    """The Kafka settings of compose service ``name``, from its environment on this machine."""
    service = deployment.services[name]
    env = environment(service)
    (user,) = {  # the coordinator's container names its file twice: its own, the CLI's
        Path(v).stem
        for v in env.values()
        if v.startswith(f"{CLIENT_SECRETS}/") and v.endswith(".password")
    }
    return kafka_settings_of(
        name, {k: deployment.relocate(v, user) for k, v in env.items()}, monkeypatch
    )


def test_every_user_was_formatted_and_the_topics_made_as_admin(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    props = deployment.broker.properties_file.read_text()
    assert "CLIENT://localhost:" in props and "PLAINTEXT" not in props
    assert deployment.broker.secure_files.exists()
    assert sorted(command_secrets(deployment.services).values()) == sorted(PRINCIPALS)
    assert option(command(deployment.services["topics"]), "--topic-prefix") == "fleet"


async def test_a_rollout_succeeds_as_the_compose_services_are_configured(
    deployment: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = settings_of(deployment, "worker-1", monkeypatch)
    coordinator_kafka = settings_of(deployment, "coordinator", monkeypatch)
    ci = settings_of(deployment, "ci", monkeypatch)
    assert (worker.sasl_username, coordinator_kafka.sasl_username, ci.sasl_username) == (
        "worker",
        "coordinator",
        "ci",
    )
    ckpts = weights_dir(tmp_path)
    runner = RecordingRunner()
    rollout_id = "r-compose-secure"
    async with (
        running_agent(worker, tmp_path, runner, worker_id="worker-1", labels={"model": "tiny-lm"}),
        coordinator_on(coordinator_kafka) as coordinator,
    ):
        code = await _publish_and_maybe_wait(
            ci,
            RolloutRequest(
                ReloadWeightsSpec(path=str(ckpts / "model.safetensors"), version="demo-v1"),
                Selector(labels={"model": "tiny-lm"}),
                rollout_id=rollout_id,
            ),
            wait=True,
            wait_timeout=60,
            output=Output.JSON,
        )
        assert code == CliExit.OK

        def succeeded() -> bool:
            fleet = coordinator.fleet
            return (
                rollout_id in fleet
                and fleet.status(rollout_id, coordinator.now()).phase is RolloutPhase.SUCCEEDED
            )

        await until(coordinator, succeeded, "the coordinator judged the rollout succeeded")
    assert runner.applied == ["demo-v1"]


async def test_the_worker_user_writing_a_command_is_denied(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = settings_of(deployment, "worker-2", monkeypatch)
    forged = make_command(
        ReloadWeightsSpec(path="/checkpoints/forged", version="v-forged"),
        selector=Selector(worker_ids=["worker-1"]),
        rollout_id="r-compose-forged",
    )
    with pytest.raises(ControlPlaneError) as caught:
        await publish(worker, forged)
    assert caught.value.code is LocalCode.KAFKA_ACCESS_DENIED, caught.value
    async with Follower(settings_of(deployment, "coordinator", monkeypatch)) as follower:
        await follower.catch_up()
        assert "r-compose-forged" not in follower.fleet
