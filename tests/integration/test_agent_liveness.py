"""The worker agent against a real broker: heartbeats (during slow reloads, around quick commands,
while the journal syncs), timeouts, draining on stop, and a fetch outage logged once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from controlplane.kafka.bus import Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError
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
    wait_for,
)
from tests.integration.conftest import RecordingRunner, acks_on_the_topic, reload
from workers.agent import loop as agent_module

pytestmark = pytest.mark.kafka


async def test_heartbeats_continue_during_a_slow_reload_and_timeout_cancels(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    gate = threading.Event()  # a reload ends only when the test opens it (or on cancellation)
    runner = RecordingRunner(gate=gate)
    async with (
        running_agent(kafka, tmp_path, runner),
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as hbs,
    ):
        slow = reload(weights, "v-slow")
        await publish(kafka, slow)
        await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
        await hbs.until(lambda items: sum(1 for h in items if h.in_flight is not None) >= 4)
        # Four heartbeats went out while the reload was still held at the gate.
        assert runner.applied == [] and not terminal(acks.items, slow.command_id)
        busy = [h for h in hbs.items if h.in_flight is not None]
        assert {h.status for h in busy} == {WorkerStatus.BUSY}
        assert busy[-1].in_flight and busy[-1].in_flight.command_id == slow.command_id
        gate.set()
        await acks.until(has_terminal(slow.command_id))
        gate.clear()  # the next reload never ends by itself: only its timeout stops it
        short = reload(weights, "v-too-slow", timeout_s=0.5)
        await settled(kafka, acks, short)
    assert terminal(acks.items, slow.command_id)[0].state is AckState.SUCCEEDED
    (t,) = terminal(acks.items, short.command_id)
    assert t.state is AckState.FAILED and t.error and t.error.code == "COMMAND_TIMEOUT"
    assert t.weights_version == "v-slow"
    assert latest(hbs.items, "w1") is not None


async def test_stop_drains_in_flight_and_sends_a_last_heartbeat(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    gate = threading.Event()
    runner = RecordingRunner(gate=gate)

    def status_is(status: WorkerStatus) -> Callable[[list[Any]], bool]:
        return lambda items: (hb := latest(items, "w1")) is not None and hb.status is status

    async with acks_tail(kafka) as acks, heartbeats_tail(kafka) as hbs:
        async with running_agent(kafka, tmp_path, runner) as agent:
            cmd = reload(weights, "v-drain")
            await publish(kafka, cmd)
            await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
            agent.request_stop()  # while the reload is held at the gate
            await hbs.until(status_is(WorkerStatus.STOPPING))
            assert not terminal(acks.items, cmd.command_id)
            gate.set()  # the reload in flight ends within the drain timeout
        # run() returned: the command was acked, then a last heartbeat was sent.
        await acks.until(has_terminal(cmd.command_id))
        await hbs.until(status_is(WorkerStatus.STOPPED))
    assert terminal(acks.items, cmd.command_id)[0].state is AckState.SUCCEEDED
    assert runner.applied == ["v-drain"]


async def test_an_idle_agent_waits_for_commands_without_polling_and_a_stop_ends_the_wait(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command loop's fetch waits as long as it is allowed (an hour here): a command ends
    the wait as it lands, twice over, and a stop ends it at once (else the agent would not stop
    within agent_running's 60 s)."""
    monkeypatch.setattr(agent_module, "COMMAND_WAIT_S", 3600.0)
    runner = RecordingRunner()
    async with acks_tail(kafka) as acks, running_agent(kafka, tmp_path, runner):
        for version in ("v2", "v3"):
            await settled(kafka, acks, reload(weights, version))
    # run() returned: the stop ended the hour-long wait for a third command.
    assert runner.applied == ["v2", "v3"]


async def test_a_quick_command_needs_no_busy_heartbeat_and_its_end_sends_one(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The busy heartbeat waits for a grace period (the slow-reload test above shows it sent);
    a command done within it is reported by its acks and by the heartbeat at its end."""
    runner = RecordingRunner()
    async with (
        running_agent(
            kafka, tmp_path, runner, heartbeat_interval_s=3600.0, progress_grace_s=3600.0
        ),
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as hbs,
    ):
        await hbs.until(lambda items: latest(items, "w1") is not None)
        cmd = reload(weights, "v2")
        await settled(kafka, acks, cmd)
        await hbs.until(lambda items: any(h.weights_version == "v2" for h in items))
    assert WorkerStatus.BUSY not in {h.status for h in hbs.items}
    assert all(h.in_flight is None for h in hbs.items)
    last = hbs.items[-1]
    assert last.status is WorkerStatus.READY and last.weights_version == "v2"


async def test_heartbeats_go_on_while_the_journal_syncs_and_the_ack_waits_for_it(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's fsync runs off the event loop: while it hangs, heartbeats still go out,
    and the terminal ack does not (its outcome is not durable yet)."""
    real_fsync = os.fsync
    armed, inside, release = threading.Event(), threading.Event(), threading.Event()

    def hanging_fsync(fd: int) -> None:
        if armed.is_set():
            inside.set()
            release.wait(15)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", hanging_fsync)
    runner = RecordingRunner()
    cmd = reload(weights, "v2")
    try:
        async with (
            running_agent(kafka, tmp_path, runner, heartbeat_interval_s=0.2),
            acks_tail(kafka) as acks,
            heartbeats_tail(kafka) as hbs,
        ):
            armed.set()
            await publish(kafka, cmd)
            assert await asyncio.to_thread(inside.wait, 60), "the journal was never synced"
            seen = len(hbs.items)
            await hbs.until(lambda items: len(items) >= seen + 3)  # the loop is not blocked
            assert not [a for a in await acks_on_the_topic(kafka) if a.command_id == cmd.command_id]
            assert runner.applied == ["v2"]  # applied, but not durable: nothing said yet
            armed.clear()
            release.set()
            await acks.until(has_terminal(cmd.command_id))
    finally:
        release.set()
    assert [a.state for a in acks.items if a.command_id == cmd.command_id] == [
        AckState.ACCEPTED,
        AckState.RUNNING,
        AckState.SUCCEEDED,
    ]


async def test_a_fetch_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The command loop retries a failing fetch every second: not a WARNING each time."""
    caplog.set_level(logging.DEBUG, logger="workers.agent.loop")
    down = threading.Event()
    failures: list[int] = []

    class CutConsumer(Consumer):
        async def fetch(self, *, timeout_s: float = 1.0, max_records: int | None = None) -> Any:
            if down.is_set():
                failures.append(1)
                raise BusError("fetching: Kafka unreachable (injected)")
            return await super().fetch(timeout_s=timeout_s, max_records=max_records)

    monkeypatch.setattr(agent_module, "Consumer", CutConsumer)
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        down.set()
        await wait_for(lambda: len(failures) >= 4)
        down.clear()
        cmd = reload(weights, "v2")
        await settled(kafka, acks, cmd)
    agent_lines = [r for r in caplog.records if r.name == "workers.agent.loop"]

    def count(text: str, level: int) -> int:
        return sum(1 for r in agent_lines if text in r.getMessage() and r.levelno == level)

    assert count("Kafka unreachable since", logging.WARNING) == 1
    assert count("Kafka reachable again", logging.WARNING) == 1
    assert count("fetch failed, retrying", logging.DEBUG) == len(failures) - 1
    assert count("fetch failed", logging.WARNING) == 0
    assert runner.applied == ["v2"]
