"""The worker agent against a real broker: its journal and committed position across restarts
(duplicate delivery applies once, the position moves only after the terminal ack, each run a
higher incarnation, a journal that cannot be written stops the worker with a coded error).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import DeleteGroupsRequest

from controlplane.kafka.bus import Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.protocol import (
    AckState,
    WorkerStatus,
)
from tests.factories import running_agent
from tests.fleet import (
    acks_tail,
    has_terminal,
    heartbeats_tail,
    latest,
    publish,
    settled,
    terminal,
)
from tests.integration.conftest import RecordingRunner, acks_on_the_topic, reload
from workers.agent.loop import Agent
from workers.agent.settings import WorkerSettings

pytestmark = pytest.mark.kafka


async def delete_worker_group(kafka: KafkaSettings, worker_id: str) -> None:
    """Delete the worker's consumer group on the broker (its committed offset with it), as
    Kafka does when offsets expire on a quiet topic (``offsets.retention.minutes``)."""
    group = kafka.topics.worker_group(worker_id)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        node = await admin.find_coordinator(group)
        response = await admin._send_request(DeleteGroupsRequest([group]), node)
        assert [tuple(r) for r in response.results] == [(group, 0)]
    finally:
        await admin.close()
    async with Consumer(kafka, group_id=group) as probe:
        await probe.assign(kafka.topics.commands.name, [0])
        assert await probe.committed(kafka.topics.commands.name, 0) is None


async def test_duplicate_delivery_and_restart_apply_once(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent.loop")
    runner = RecordingRunner()
    cmd = reload(weights, "v7")
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, runner):
            await publish(kafka, cmd, cmd)  # the same command twice (a producer retry, a replay)
            first_marker = reload(weights, "v7b")
            await publish(kafka, first_marker)  # acks are in order: all of cmd's came before
            await acks.until(has_terminal(first_marker.command_id))
        assert len(terminal(acks.items, cmd.command_id)) == 1
        # While the worker is down its committed offset is deleted and a command is published:
        # it resumes from its local journal (the head of the log would skip the missed one).
        await delete_worker_group(kafka, "w1")
        missed = reload(weights, "v8")
        await publish(kafka, missed)
        second = RecordingRunner()
        caplog.clear()
        async with running_agent(kafka, tmp_path, second):
            marker = reload(weights, "v9")
            await publish(kafka, cmd, marker)
            await acks.until(has_terminal(marker.command_id))
    assert "(local state (committed offset expired))" in caplog.text
    assert runner.applied == ["v7", "v7b"]
    # v7b restored at start-up (level), then the missed command, then the marker; the replayed
    # v7 is a duplicate by its id in the journal and is not applied again.
    assert second.applied == ["v7b", "v8", "v9"]
    assert len(terminal(acks.items, cmd.command_id)) == 1
    (applied,) = terminal(acks.items, missed.command_id)
    assert applied.state is AckState.SUCCEEDED


async def test_commits_position_only_after_terminal_ack(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, "v9")
        await settled(kafka, acks, cmd)
        async with Consumer(kafka, group_id=kafka.topics.worker_group("w1")) as probe:
            await probe.assign(kafka.topics.commands.name, [0])
            committed: list[int | None] = []

            async def committed_now() -> int | None:
                committed.append(await probe.committed(kafka.topics.commands.name, 0))
                return committed[-1]

            deadline = time.monotonic() + 30
            while await committed_now() != 1:
                assert time.monotonic() < deadline, f"never committed: {committed[-5:]}"
                await asyncio.sleep(0.05)
            assert set(committed) <= {None, 1}


async def test_each_run_on_a_state_dir_reports_a_higher_incarnation(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with heartbeats_tail(kafka) as hbs:
        async with running_agent(kafka, tmp_path, RecordingRunner()):
            await hbs.until(lambda items: len(items) > 0)
        first = hbs.items[0].incarnation
        async with running_agent(kafka, tmp_path, RecordingRunner()):
            await hbs.until(lambda items: items[-1].incarnation != first)
        second = hbs.items[-1].incarnation
    assert 0 < first < second
    assert [h.incarnation for h in hbs.items] == sorted(h.incarnation for h in hbs.items)


async def test_a_journal_that_cannot_be_written_stops_the_worker_with_a_coded_error(
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full disk: the outcome cannot be made durable, so its ack is never sent; the worker
    stops taking commands, says why in a degraded heartbeat, closes its runner and run()
    raises JOURNAL_WRITE_FAILED (the one the disk gave, not a later one from closing)."""
    real_fsync = os.fsync
    disk_full = threading.Event()

    def fsync(fd: int) -> None:
        if disk_full.is_set():
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    runner = RecordingRunner()
    settings = WorkerSettings(
        worker_id="w1",
        kafka=kafka,
        allowed_roots=[tmp_path / "ckpts"],
        state_dir=tmp_path / "state",
        heartbeat_interval_s=0.5,
    )
    agent = Agent(settings, runner)
    cmd = reload(weights, "v2")
    async with heartbeats_tail(kafka) as hbs:
        task = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.ready.wait(), 30)
            disk_full.set()
            await publish(kafka, cmd)
            with pytest.raises(ControlPlaneError) as raised:
                await asyncio.wait_for(task, 60)
        finally:
            agent.request_stop()
            if not task.done():
                await asyncio.wait_for(asyncio.shield(task), 60)
        await hbs.until(
            lambda items: (
                (hb := latest(items, "w1")) is not None and hb.status is WorkerStatus.STOPPED
            )
        )
    assert raised.value.code is WireCode.JOURNAL_WRITE_FAILED
    assert "No space left on device" in raised.value.message
    assert runner.applied == ["v2"] and runner.closed
    # Its accepted and running acks may be out; its outcome is not: it was never durable.
    assert not terminal(await acks_on_the_topic(kafka), cmd.command_id)
    degraded = [h for h in hbs.items if h.status is WorkerStatus.DEGRADED]
    assert degraded and degraded[0].degraded is not None
    assert degraded[0].degraded.code == "JOURNAL_WRITE_FAILED"
    last = hbs.items[-1]
    assert last.degraded is not None and last.degraded.code == "JOURNAL_WRITE_FAILED"
    assert "the journal could not be closed" in caplog.text  # logged, not raised over it
