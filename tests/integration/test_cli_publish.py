"""Publishing from the CLI: a rollout id already in the log is refused, command ids are unique
per publish, a TTL over the maximum is refused before anything reaches Kafka, and a publish the
cluster does not confirm in time is exit 6 ("outcome unknown, check status"), never exit 4 ("not
published") and never a hang; under `--wait` the CLI waits for it to land instead.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controlplane.coordinator.publisher import MAX_TTL_S, build_command
from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.bus import Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import CommandRejected, WireCode
from controlplane.wire.protocol import (
    Selector,
    UpdateConfigSpec,
    encode,
    utcnow,
)
from controlplane.wire.topics import worker_key
from tests.factories import fake_heartbeat, free_port, succeeded_acks
from tests.fleet import make_command, publish
from tests.integration.test_bus_publish import (
    fleet_below_min_isr,
    node_down,
    restore_commands_topic,
)
from tests.integration.test_cli_outage import Cli, until

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


async def live_worker(settings: KafkaSettings) -> str:
    worker_id = f"w-{uuid.uuid4().hex[:6]}"
    hb = fake_heartbeat(worker_id, utcnow(), interval_s=600)
    async with Producer(settings) as producer:
        await producer.send(settings.topics.workers.name, encode(hb), key=worker_key(worker_id))
    return worker_id


def update_config(
    settings: KafkaSettings, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return cli(
        "update-config",
        "--set",
        "temperature=0.5",
        *args,
        "--bootstrap",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
        env=env,
    )


@pytest.mark.kafka
async def test_a_rollout_id_in_the_log_is_refused(kafka: KafkaSettings) -> None:
    worker = await live_worker(kafka)
    first = update_config(kafka, "--worker", worker, "--rollout-id", "r-again")
    assert first.returncode == 0, first.stderr
    again = update_config(kafka, "--worker", worker, "--rollout-id", "r-again")
    assert again.returncode == 3, again.stdout + again.stderr
    assert one_error_line(again).startswith("error: ROLLOUT_EXISTS: rollout 'r-again'")
    assert "published" not in again.stdout


@pytest.mark.kafka
async def test_a_rollout_id_written_by_another_client_is_refused(kafka: KafkaSettings) -> None:
    worker = await live_worker(kafka)
    await publish(kafka, make_command(UpdateConfigSpec(overrides={"a": 1}), rollout_id="r-kcat"))
    proc = update_config(kafka, "--worker", worker, "--rollout-id", "r-kcat", "--wait")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert one_error_line(proc).startswith("error: ROLLOUT_EXISTS")


def test_command_ids_are_unique_per_publish() -> None:
    spec = UpdateConfigSpec(overrides={"a": 1})
    ids = {
        build_command(spec, Selector(worker_ids=["w"]), issuer="t", rollout_id="r-1").command_id
        for _ in range(50)
    }
    assert len(ids) == 50
    assert "r-1.c1" not in ids and all(i.startswith("r-1.") for i in ids)


def test_a_ttl_over_the_maximum_is_refused_before_kafka() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the refusal must come first
    proc = cli("update-config", "--set", "a=1", "--all", "--ttl", str(MAX_TTL_S + 1), "-b", dead)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert one_error_line(proc).startswith("error: TTL_TOO_LONG")
    proc = cli(
        "reload-weights", "/m.safetensors", "--version", "v1", "--all", "--ttl", "1e9", "-b", dead
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert one_error_line(proc).startswith("error: TTL_TOO_LONG")
    with pytest.raises(CommandRejected) as info:  # the API's path too
        build_command(
            UpdateConfigSpec(overrides={"a": 1}),
            Selector(worker_ids=["w"]),
            issuer="t",
            ttl_s=MAX_TTL_S * 2,
        )
    assert info.value.code is WireCode.TTL_TOO_LONG
    proc = cli("update-config", "--set", "a=1", "--all", "--ttl", str(MAX_TTL_S), "-b", dead)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # the maximum itself is allowed


@pytest.mark.kafka
async def test_wait_timeout_with_kafka_up_is_exit_2_not_4(kafka: KafkaSettings) -> None:
    worker = await live_worker(kafka)  # never acks
    proc = update_config(kafka, "--worker", worker, "--wait", "--wait-timeout", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gave up waiting: the rollout is still" in proc.stdout
    assert "Traceback" not in proc.stderr and "Kafka unreachable" not in proc.stderr


# --------------------------------------------------------------------------- unknown outcome


def unknown_line(proc: subprocess.CompletedProcess[str], rollout_id: str) -> str:
    line = one_error_line(proc)
    assert line.startswith(
        f"error: PUBLISH_OUTCOME_UNKNOWN: rollout {rollout_id} (command {rollout_id}.c-"
    ), line
    assert "may have been published" in line
    assert f"check `controlplane status {rollout_id}`" in line
    return line


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_publish_below_min_isr_is_exit_6_outcome_unknown(
    kafka_cluster: LocalCluster,
) -> None:
    """Not exit 4: the record was handed to the producer and may be in the log."""
    settings = await fleet_below_min_isr(kafka_cluster)
    worker = await live_worker(settings)
    async with node_down(kafka_cluster):
        plain = await asyncio.to_thread(
            update_config,
            settings,
            "--worker",
            worker,
            "--rollout-id",
            "r-unknown-1",
            env={"FLEET_DELIVERY_TIMEOUT": "3"},
        )
        waited = await asyncio.to_thread(
            update_config,
            settings,
            "--worker",
            worker,
            "--rollout-id",
            "r-unknown-2",
            "--wait",
            "--wait-timeout",
            "4",
            "--delivery-timeout",
            "2",
        )
    assert plain.returncode == 6, plain.stdout + plain.stderr
    assert "did not confirm it within 3 s" in unknown_line(plain, "r-unknown-1")
    assert "published rollout" not in plain.stdout
    # --wait kept following the log for it, until --wait-timeout; then the same verdict.
    assert waited.returncode == 6, waited.stdout + waited.stderr
    assert "--wait-timeout" in unknown_line(waited, "r-unknown-2")
    assert "still trying" in waited.stderr
    assert "published rollout" not in waited.stdout


async def ack_succeeded(
    settings: KafkaSettings, worker_id: str, rollout_id: str, command_id: str
) -> None:
    async with Producer(settings) as producer:
        for ack in succeeded_acks(worker_id, rollout_id, command_id):
            await producer.send(settings.topics.acks.name, encode(ack), key=worker_key(worker_id))


@pytest.mark.kafka
@pytest.mark.slow
async def test_wait_after_an_unknown_outcome_follows_the_publish_to_its_real_verdict(
    kafka_cluster: LocalCluster,
) -> None:
    settings = await fleet_below_min_isr(kafka_cluster)
    worker = await live_worker(settings)
    async with node_down(kafka_cluster):
        cli = await Cli.start(
            "update-config",
            "--set",
            "a=1",
            "--worker",
            worker,
            "--rollout-id",
            "r-late",
            "--wait",
            "--wait-timeout",
            "240",
            "--delivery-timeout",
            "2",
            "--bootstrap",
            settings.bootstrap_servers,
            "--topic-prefix",
            settings.topic_prefix,
        )
        try:
            await until(lambda: "still trying" in cli.text, "the unknown-outcome notice", 90)
            assert cli.proc.returncode is None, cli.text  # still waiting, not exit 6
            await restore_commands_topic(settings)  # the retried record gets through
            pattern = re.compile(r"published rollout r-late \(command (\S+), ")
            await until(lambda: bool(pattern.search(cli.text)), "the late publish", 120)
            match = pattern.search(cli.text)
            assert match is not None
            await ack_succeeded(settings, worker, "r-late", match.group(1))
            code = await cli.wait(120)
        finally:
            cli.kill()
    assert code == 0, cli.text
    assert "Traceback" not in cli.text and "error: " not in cli.text
