"""A fleet on a secured broker (``kafka_secure``: SASL_SSL, SCRAM-SHA-512, ACLs enforced), each
part with its own Kafka user: a worker agent as ``worker``, the CLI's publish-and-wait as
``ci``, a coordinator (its follower, probes, controller election and snapshots) as
``coordinator``. And what an ACL refuses: the worker's user writing a command.

All tests share the fixture's one topic prefix: each uses its own worker and rollout ids.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import stat
import struct
import sys
from pathlib import Path

import pytest

from controlplane.cli.admin import secure_env_lines
from controlplane.cli.render import Output
from controlplane.cli.rollout import _publish_and_maybe_wait
from controlplane.coordinator.follower import Follower
from controlplane.coordinator.publisher import RolloutRequest
from controlplane.kafka import node
from controlplane.kafka.broker import BrokerConfig, LocalBroker
from controlplane.kafka.bus import Producer
from controlplane.kafka.secure import Grant, acl_grants
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.errors import BrokerError, ControlPlaneError, LocalCode
from controlplane.wire.exits import CliExit
from controlplane.wire.protocol import ReloadWeightsSpec, Selector
from tests.conftest import SECURE_PREFIX
from tests.factories import free_port, running_agent, weights_dir
from tests.fleet import make_command, publish
from tests.integration.conftest import RecordingRunner
from tests.integration.test_verdicts import coordinator_on, until

pytestmark = [pytest.mark.kafka]

REPO = Path(__file__).resolve().parents[2]


async def test_end_to_end_rollout_over_sasl_ssl(
    kafka_secure: dict[str, KafkaSettings], tmp_path: Path
) -> None:
    ckpts = weights_dir(tmp_path)
    runner = RecordingRunner()
    rollout_id = "r-sec-e2e"
    async with (
        running_agent(
            kafka_secure["worker"], tmp_path, runner, worker_id="sec-w1", labels={"model": "sec"}
        ),
        coordinator_on(kafka_secure["coordinator"]) as coordinator,
    ):
        code = await _publish_and_maybe_wait(
            kafka_secure["ci"],
            RolloutRequest(
                ReloadWeightsSpec(path=str(ckpts / "model.safetensors"), version="v-sec"),
                Selector(labels={"model": "sec"}),
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
        status = coordinator.fleet.status(rollout_id, coordinator.now())
        assert [w.worker_id for w in status.workers] == ["sec-w1"]
    assert runner.applied == ["v-sec"]


async def test_worker_principal_writing_commands_is_denied(
    kafka_secure: dict[str, KafkaSettings],
) -> None:
    forged = make_command(
        ReloadWeightsSpec(path="/ckpt/forged", version="v-forged"),
        selector=Selector(worker_ids=["sec-w1"]),
        rollout_id="r-sec-forged",
    )
    with pytest.raises(ControlPlaneError) as caught:
        await publish(kafka_secure["worker"], forged)
    assert caught.value.code is LocalCode.KAFKA_ACCESS_DENIED, caught.value
    # And nothing was written: the coordinator's user reads the commands topic.
    async with Follower(kafka_secure["coordinator"]) as follower:
        await follower.catch_up()
        assert "r-sec-forged" not in follower.fleet


async def test_ci_principal_writing_the_controller_topic_is_denied(
    kafka_secure: dict[str, KafkaSettings],
) -> None:
    """The controller's records are unsigned: only the coordinator's user may write them."""
    ci = kafka_secure["ci"]
    with pytest.raises(ControlPlaneError) as caught:
        async with Producer(ci) as producer:
            await producer.send(ci.topics.controller.name, b"{}", key=b"forged")
    assert caught.value.code is LocalCode.KAFKA_ACCESS_DENIED, caught.value
    assert ci.topics.controller.name in caught.value.message


def _api_versions(port: int, context: ssl.SSLContext) -> bytes:
    """Send Kafka's ApiVersions v0 request over TLS to 127.0.0.1:``port``; the response's
    first bytes (its correlation id), or an OSError when the broker refuses the connection."""
    client_id = b"tests"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    with (
        socket.create_connection(("127.0.0.1", port), timeout=20) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(struct.pack(">i", len(body)) + body)
        header = tls.recv(8)
        if len(header) < 8:
            raise ConnectionResetError("the broker closed the connection")
        return header[4:8]


def test_controller_listener_requires_a_client_certificate(
    kafka_secure_broker: LocalBroker,
) -> None:
    """Admin clients may talk to controllers (KIP-919): the controller listener lets in only a
    client with a certificate of the broker's CA (the broker itself), never one without."""
    files = kafka_secure_broker.secure_files
    port = kafka_secure_broker.config.controller_port
    anonymous = ssl.create_default_context(cafile=str(files.ca))
    with pytest.raises((ssl.SSLError, OSError)):
        _api_versions(port, anonymous)
    with_cert = ssl.create_default_context(cafile=str(files.ca))
    with_cert.load_cert_chain(files.keystore)
    assert _api_versions(port, with_cert) == struct.pack(">i", 7)


def test_acls_are_granted_in_one_jvm_or_else_one_per_grant(
    kafka_secure_broker: LocalBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Granting again is a no-op, in one JVM. Where the batch cannot run (a JRE has no compiler
    for Java's source launcher), each grant runs AclCommand itself; a grant the tool refuses is
    KAFKA_ERROR naming it."""
    assert kafka_secure_broker.grant_acls(SECURE_PREFIX) == 1
    monkeypatch.setattr(node, "ACL_BATCH_SOURCE", "this is not Java")
    monkeypatch.setattr(node, "acl_grants", lambda prefix: acl_grants(prefix)[:1])
    assert kafka_secure_broker.grant_acls(SECURE_PREFIX) == 2
    cluster_write = Grant(("ci",), ("Write",), (("--cluster", ""),))  # not an operation on it
    monkeypatch.setattr(node, "acl_grants", lambda prefix: [cluster_write])
    with pytest.raises(BrokerError) as info:
        kafka_secure_broker.grant_acls(SECURE_PREFIX)
    assert info.value.code is LocalCode.KAFKA_ERROR
    assert "--allow-principal User:ci --operation Write --cluster" in info.value.message


@pytest.mark.parametrize("formatted_secure", [False, True], ids=["plaintext", "secured"])
def test_a_data_dir_is_started_as_it_was_formatted(tmp_path: Path, formatted_secure: bool) -> None:
    """Its users and ACLs are in its metadata, written at format: a plaintext data directory
    started with --secure (or the reverse) is SETTINGS_INVALID, before anything starts."""

    def broker(secure: bool) -> LocalBroker:
        config = BrokerConfig(
            port=free_port(), controller_port=free_port(), data_dir=tmp_path, secure=secure
        )
        return LocalBroker(config)

    first = broker(formatted_secure)
    first.prepare(first.ensure_jars())  # formats storage (a short JVM run), starts nothing
    if formatted_secure:  # its records and the users' salted hashes: the owner's only
        assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    with pytest.raises(BrokerError) as info:
        broker(not formatted_secure).start(timeout=30)
    assert info.value.code is LocalCode.SETTINGS_INVALID
    assert ("start it with --secure" in info.value.message) is formatted_secure
    assert not (tmp_path / "broker.pid").exists()


async def _cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """The real CLI in a child process with ``env`` (on top of PATH and HOME only)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controlplane",
        *args,
        cwd=REPO,
        env={k: os.environ[k] for k in ("PATH", "HOME", "PJRT_DEVICE") if k in os.environ} | env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_cli_publishes_and_waits_as_ci_with_the_printed_environment(
    kafka_secure_broker: LocalBroker, kafka_secure: dict[str, KafkaSettings], tmp_path: Path
) -> None:
    """`broker start --secure`'s lines for ci, as the CLI's whole environment (no flags): the
    CLI reaches the secured broker, publishes as ci and waits for the worker's ack; a wrong
    password in the same environment is KAFKA_AUTH_FAILED's one line, not a traceback."""
    env: dict[str, str] = {}
    lines = secure_env_lines(kafka_secure_broker, SECURE_PREFIX)
    start = next(i for i, line in enumerate(lines) if line.startswith("# ci:"))
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        name, _, value = line.partition("=")
        env[name] = value
    assert env["FLEET_KAFKA_BOOTSTRAP"] == kafka_secure_broker.bootstrap
    ckpts = weights_dir(tmp_path)
    runner = RecordingRunner()
    async with running_agent(
        kafka_secure["worker"], tmp_path, runner, worker_id="sec-cli-w1", labels={"model": "cli"}
    ):
        code, out, err = await _cli(
            env,
            "reload-weights",
            str(ckpts / "model.safetensors"),
            "--version",
            "v-cli",
            "--worker",
            "sec-cli-w1",
            "--rollout-id",
            "r-sec-cli",
            "--wait",
            "--wait-timeout",
            "60",
        )
        assert code == CliExit.OK, (out, err)
    assert runner.applied == ["v-cli"]

    wrong = env | {"FLEET_KAFKA__SASL_PASSWORD": "not-the-password"}
    del wrong["FLEET_KAFKA__SASL_PASSWORD_FILE"]
    code, out, err = await _cli(wrong, "workers")
    assert code != CliExit.OK
    assert "KAFKA_AUTH_FAILED" in err and "Traceback" not in err, err
