"""Publishing from the CLI: a rollout id already in the log is refused, command ids are unique
per publish, and a TTL over the maximum is refused before anything reaches Kafka."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controlplane.bus import Producer
from controlplane.errors import CommandRejected, ErrorCode
from controlplane.protocol import (
    Heartbeat,
    Selector,
    UpdateConfigSpec,
    WorkerStatus,
    encode,
    utcnow,
)
from controlplane.publisher import MAX_TTL_S, build_command
from controlplane.settings import KafkaSettings
from controlplane.topics import worker_key
from tests.conftest import free_port
from tests.fleet import make_command, publish

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


async def live_worker(settings: KafkaSettings) -> str:
    worker_id = f"w-{uuid.uuid4().hex[:6]}"
    now = utcnow()
    hb = Heartbeat(
        worker_id=worker_id,
        runner="fake",
        device="cpu",
        status=WorkerStatus.READY,
        seq=1,
        sent_at=now,
        started_at=now,
        interval_s=600,
    )
    async with Producer(settings) as producer:
        await producer.send(settings.topics.workers.name, encode(hb), key=worker_key(worker_id))
    return worker_id


def update_config(settings: KafkaSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(
        "update-config",
        "--set",
        "temperature=0.5",
        *args,
        "--bootstrap",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
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
    proc = cli("reload-weights", "/m.safetensors", "-v", "v1", "--all", "--ttl", "1e9", "-b", dead)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert one_error_line(proc).startswith("error: TTL_TOO_LONG")
    with pytest.raises(CommandRejected) as info:  # the API's path too
        build_command(
            UpdateConfigSpec(overrides={"a": 1}),
            Selector(worker_ids=["w"]),
            issuer="t",
            ttl_s=MAX_TTL_S * 2,
        )
    assert info.value.code is ErrorCode.TTL_TOO_LONG
    proc = cli("update-config", "--set", "a=1", "--all", "--ttl", str(MAX_TTL_S), "-b", dead)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # the maximum itself is allowed


@pytest.mark.kafka
async def test_wait_timeout_with_kafka_up_is_exit_2_not_4(kafka: KafkaSettings) -> None:
    worker = await live_worker(kafka)  # never acks
    proc = update_config(kafka, "--worker", worker, "--wait", "--wait-timeout", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gave up waiting: the rollout is still" in proc.stdout
    assert "Traceback" not in proc.stderr and "Kafka unreachable" not in proc.stderr
