"""The CLI reads one rollout without the fleet's history (issue 18): ``status <id>`` folds only
that rollout's commands and acks, its acks read from the offsets at its command's time, and
judges it exactly as a full replay does; a publish reads the workers topic and what is appended
after it started; ``topics ensure`` prints what it set in place.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from controlplane.cli.follow import read_log, read_rollout
from controlplane.coordinator.follower import Follower
from controlplane.kafka.bus import Admin, Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.channels import ACKS, COMMANDS
from controlplane.wire.protocol import (
    Ack,
    AckState,
    CommandKind,
    Selector,
    Timings,
    UpdateConfigSpec,
    encode,
    utcnow,
)
from controlplane.wire.topics import Topics, TopicSpec, worker_key
from tests.factories import fake_heartbeat, fresh_topics, succeeded_acks
from tests.fleet import make_command, publish

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
WORKERS = [f"w-{i}" for i in range(4)]


def cli(settings: KafkaSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "controlplane",
            *args,
            "--bootstrap",
            settings.bootstrap_servers,
            "--topic-prefix",
            settings.topic_prefix,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def beat(settings: KafkaSettings, workers: list[str]) -> None:
    async with Producer(settings) as producer:
        for worker_id in workers:
            hb = fake_heartbeat(worker_id, utcnow(), interval_s=600)
            await producer.send(settings.topics.workers.name, encode(hb), key=worker_key(worker_id))


def accepted(worker_id: str, rollout_id: str, command_id: str) -> Ack:
    now = utcnow()
    return Ack(
        command_id=command_id,
        rollout_id=rollout_id,
        worker_id=worker_id,
        kind=CommandKind.UPDATE_CONFIG,
        state=AckState.ACCEPTED,
        timings=Timings(received_at=now),
        sent_at=now,
    )


async def send_acks(settings: KafkaSettings, acks: list[Ack]) -> None:
    async with Producer(settings) as producer:
        for ack in acks:
            await producer.send(
                settings.topics.acks.name, encode(ack), key=worker_key(ack.worker_id)
            )


async def rollout(settings: KafkaSettings, rollout_id: str, *, done: list[str]) -> None:
    """A rollout pinned to every worker: accepted by all, succeeded by ``done``."""
    command = make_command(
        UpdateConfigSpec(overrides={"t": 1}),
        rollout_id=rollout_id,
        selector=Selector(worker_ids=WORKERS),
    )
    await publish(settings, command)
    acks: list[Ack] = []
    for worker_id in WORKERS:
        if worker_id in done:
            acks += succeeded_acks(worker_id, rollout_id, command.command_id)
        else:
            acks.append(accepted(worker_id, rollout_id, command.command_id))
    await send_acks(settings, acks)


async def test_status_of_one_rollout_is_the_full_replays(kafka: KafkaSettings) -> None:
    """For an ended rollout and one in progress, among many earlier rollouts: the targeted
    read's status equals the full replay's, judged at the same time (now, and past the
    deadline), while it folded none of the other rollouts' commands or acks."""
    await beat(kafka, WORKERS)
    for r in range(12):
        await rollout(kafka, f"r-old-{r}", done=WORKERS)
    await rollout(kafka, "r-ended", done=WORKERS)
    for r in range(12, 20):
        await rollout(kafka, f"r-old-{r}", done=WORKERS[:2] if r % 2 else WORKERS)
    await rollout(kafka, "r-live", done=WORKERS[:2])
    await rollout(kafka, "r-after", done=WORKERS)

    async with read_log(kafka) as (full, full_at):
        pass
    assert len(full.fleet.rollout_ids()) == 23
    for rollout_id, phase in (
        ("r-ended", RolloutPhase.SUCCEEDED),
        ("r-live", RolloutPhase.PROGRESSING),
    ):
        async with read_rollout(kafka, rollout_id) as (one, one_at):
            pass
        assert one.fleet.rollout_ids() == [rollout_id]
        assert one.skipped > 0  # the others' records were there, and not folded
        for at in (min(full_at, one_at), max(full_at, one_at) + timedelta(hours=2)):
            assert one.fleet.status(rollout_id, at) == full.fleet.status(rollout_id, at)
        assert full.fleet.status(rollout_id, min(full_at, one_at)).phase is phase


async def test_status_never_reads_the_acks_before_its_command(kafka: KafkaSettings) -> None:
    """Acks appended before the command's time (less the margin) are never fetched: records
    that name the rollout but do not decode, stamped an hour before it, are not read (none
    counted undecodable, the acks read are exactly the rollout's own), while a full replay
    reads and counts them. The CLI shows the rollout as it is."""
    await beat(kafka, WORKERS)
    rollout_id = f"r-{uuid.uuid4().hex[:8]}"
    garbage = [f'{{"rollout_id": "{rollout_id}", "garbage {i}'.encode() for i in range(50)]
    hour_ago = int((time.time() - 3600) * 1000)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers)
    await producer.start()
    try:
        for i, value in enumerate(garbage):
            await producer.send_and_wait(
                kafka.topics.acks.name, value, key=f"w-{i}".encode(), timestamp_ms=hour_ago
            )
    finally:
        await producer.stop()
    await rollout(kafka, rollout_id, done=WORKERS)

    async with read_rollout(kafka, rollout_id) as (one, at):
        status = one.fleet.status(rollout_id, at)
    assert status.phase is RolloutPhase.SUCCEEDED
    assert one.undecodable == 0
    assert one.records_read.get(kafka.topics.acks.name) == 3 * len(WORKERS)
    async with read_log(kafka) as (full, _):
        pass
    assert full.undecodable == len(garbage)

    proc = await asyncio.to_thread(cli, kafka, "status", rollout_id, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["phase"] == "succeeded"


async def test_a_rollout_id_written_with_json_escapes_is_found(kafka: KafkaSettings) -> None:
    """The bytes of a record need not contain the id as such (``r\\/esc`` is ``r/esc`` in
    JSON): such a command is still decoded and folded, and its rollout id is taken."""
    await beat(kafka, WORKERS)
    command = make_command(
        UpdateConfigSpec(overrides={"t": 1}),
        rollout_id="r/esc",
        selector=Selector(worker_ids=WORKERS),
    )
    value = encode(command)
    assert value.count(b"r/esc") == 1
    await publish(kafka, value.replace(b"r/esc", b"r\\/esc"))
    await send_acks(
        kafka, [a for w in WORKERS for a in succeeded_acks(w, "r/esc", command.command_id)]
    )
    async with read_rollout(kafka, "r/esc") as (one, at):
        assert one.fleet.status("r/esc", at).phase is RolloutPhase.SUCCEEDED
    proc = await asyncio.to_thread(
        cli, kafka, "update-config", "--set", "a=1", "--all", "--rollout-id", "r/esc"
    )
    assert proc.returncode == 3 and "ROLLOUT_EXISTS" in proc.stderr, proc.stderr


async def test_status_of_a_rollout_not_on_the_commands_topic(kafka: KafkaSettings) -> None:
    """No command record names it: the acks are read from the beginning (only those naming
    it decoded), so a rollout known from acks alone is found as a full replay finds it, and
    an unknown id is still refused."""
    await beat(kafka, WORKERS)
    await rollout(kafka, "r-other", done=WORKERS)
    async with read_rollout(kafka, "r-nowhere") as (one, _):
        assert "r-nowhere" not in one.fleet
    proc = await asyncio.to_thread(cli, kafka, "status", "r-nowhere")
    assert proc.returncode == 3 and "no rollout 'r-nowhere'" in proc.stderr, proc.stderr


async def test_a_publish_reads_no_history(kafka: KafkaSettings) -> None:
    """Acks and commands already in the log are not read by a publish (its reader starts
    them at their end): a publish right after many rollouts folds none of their records,
    and its own command is read back by ``--wait``'s reader all the same."""
    await beat(kafka, WORKERS)
    for r in range(5):
        await rollout(kafka, f"r-old-{r}", done=WORKERS)
    async with Follower(kafka, rollouts=("r-new",), tail=(ACKS, COMMANDS)) as follower:
        await follower.catch_up()
        assert follower.records_read.get(kafka.topics.acks.name, 0) == 0
        assert follower.records_read.get(kafka.topics.commands.name, 0) == 0
        await rollout(kafka, "r-new", done=WORKERS)
        while "r-new" not in follower.fleet:
            await follower.poll(timeout_s=0.5)
    proc = await asyncio.to_thread(
        cli, kafka, "update-config", "--set", "a=1", "--all", "--rollout-id", "r-old-3"
    )
    assert proc.returncode == 3 and "ROLLOUT_EXISTS" in proc.stderr, proc.stderr


class _PreviousTopics(Topics):
    """The workers topic with the roll settings of the version before issue 18."""

    @property
    def workers(self) -> TopicSpec:
        spec = super().workers
        config = dict(spec.config, **{"segment.ms": str(60 * 60 * 1000)})
        return TopicSpec(spec.name, spec.partitions, config, spec.replication_factor)


async def test_topics_ensure_prints_what_it_set_in_place(kafka_bootstrap: str) -> None:
    settings = fresh_topics(kafka_bootstrap, "ta")
    async with Admin(settings) as admin:
        await admin.ensure_topics(_PreviousTopics(prefix=settings.topic_prefix))
    proc = await asyncio.to_thread(cli, settings, "topics", "ensure")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = settings.topics.workers.name
    assert f"altered  {workers}: segment.ms 3600000 -> 60000" in proc.stdout.splitlines()
    again = await asyncio.to_thread(cli, settings, "topics", "ensure")
    assert "altered" not in again.stdout
