"""The worker agent through a real Kafka outage: a broker of its own, stopped and started again.

The agent survives it, says so once when it starts and once when it ends (not at every retry),
and applies a command published after the broker is back. (aiokafka's own log lines are bus.py's
business; the command loop's fetch failures, which a stopped broker does not always cause, are
shown in test_agent.py.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controlplane.kafka.broker import BrokerConfig, LocalBroker
from controlplane.kafka.bus import Admin, Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import AckState
from tests.factories import agent_running, agent_settings, free_port, weights_dir
from tests.fleet import acks_tail, has_terminal, publish, settled, terminal
from tests.integration.conftest import RecordingRunner, reload
from workers.agent.settings import WorkerSettings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    """A broker for this test alone (the session's must stay up for the others)."""
    local = LocalBroker(
        BrokerConfig(port=free_port(), controller_port=free_port(), data_dir=tmp_path / "kafka")
    )
    local.start(timeout=120)
    try:
        yield local
    finally:
        local.stop()


def _records(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "workers.agent.loop" and text in r.getMessage()]


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.1)


async def test_an_outage_is_logged_once_and_commands_flow_after_it(
    broker: LocalBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="workers.agent.loop")
    kafka = KafkaSettings(
        bootstrap_servers=broker.bootstrap, topic_prefix="outage", request_timeout_ms=5000
    )
    async with Admin(kafka) as admin:
        await admin.ensure_topics(kafka.topics)
    ckpts = weights_dir(tmp_path)
    runner = RecordingRunner()
    settings = agent_settings(kafka, tmp_path, labels={})
    async with agent_running(settings, runner, ready_s=60, stop_s=120) as (_, task):
        await asyncio.to_thread(broker.stop)
        # A heartbeat waits for Kafka at most three periods: each one fails, said once.
        await _until(lambda: len(_records(caplog, "heartbeat failed")) >= 3, "heartbeats fail")
        await asyncio.to_thread(broker.start, timeout=120)
        cmd = reload(ckpts, "v2")
        async with acks_tail(kafka) as acks:
            await settled(kafka, acks, cmd, timeout=120)
        await _until(lambda: bool(_records(caplog, "heartbeats sent again")), "heartbeats again")
        assert not task.done()
    assert terminal(acks.items, cmd.command_id)[0].state is AckState.SUCCEEDED
    assert runner.applied == ["v2"]
    loud = [
        r.getMessage()
        for r in caplog.records
        if r.name == "workers.agent.loop" and r.levelno >= logging.WARNING
    ]
    assert sum("heartbeat failed" in m for m in loud) == 1, loud
    assert sum("Kafka unreachable since" in m for m in loud) <= 1, loud
    assert not [m for m in loud if "fetch failed" in m], loud
    assert len(_records(caplog, "heartbeats sent again")) == 1


async def test_a_stop_during_an_outage_does_not_wait_for_kafka(
    broker: LocalBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM while Kafka is down: the agent stops (its last heartbeat cannot go out; nothing
    it has not journaled is at stake). It used to wait in a heartbeat's send for Kafka."""
    kafka = KafkaSettings(
        bootstrap_servers=broker.bootstrap, topic_prefix="outage", request_timeout_ms=5000
    )
    async with Admin(kafka) as admin:
        await admin.ensure_topics(kafka.topics)
    settings = WorkerSettings(
        worker_id="w1", kafka=kafka, state_dir=tmp_path / "state", heartbeat_interval_s=0.5
    )
    runner = RecordingRunner()
    async with agent_running(settings, runner, ready_s=60):
        await asyncio.to_thread(broker.stop)
        await _until(lambda: bool(_records(caplog, "heartbeat failed")), "a heartbeat fails")
    assert runner.closed


async def test_an_ack_kafka_cannot_take_is_said_once_and_published_once_when_it_is_back(
    broker: LocalBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker stops while a command runs: its terminal ack (journaled) waits, said once,
    on the same record; once the broker is back it is published once and the offset
    committed. (Before, each failed send was logged and sent again.)"""
    caplog.set_level(logging.INFO, logger="workers.agent.loop")
    kafka = KafkaSettings(
        bootstrap_servers=broker.bootstrap,
        topic_prefix="outage",
        request_timeout_ms=5000,
        delivery_timeout_ms=1000,
    )
    async with Admin(kafka) as admin:
        await admin.ensure_topics(kafka.topics)
    ckpts = weights_dir(tmp_path)
    settings = agent_settings(kafka, tmp_path, labels={}, progress_grace_s=0)
    gate = threading.Event()
    runner = RecordingRunner(gate=gate)
    cmd = reload(ckpts, "v2")
    async with agent_running(settings, runner, ready_s=60, stop_s=120) as (_, task):
        try:
            async with acks_tail(kafka) as acks:
                await publish(kafka, cmd)
                await acks.until(lambda items: AckState.RUNNING in [a.state for a in items])
            await asyncio.to_thread(broker.stop)
            gate.set()
            await _until(lambda: bool(_records(caplog, "cannot publish to Kafka")), "said")
            await _until(lambda: bool(_records(caplog, "heartbeat failed")), "heartbeats fail")
            await asyncio.to_thread(broker.start, timeout=120)
            await _until(lambda: bool(_records(caplog, "acks published again")), "published")
            await _committed(kafka, 1)
            assert not task.done()
        finally:
            gate.set()
    async with acks_tail(kafka) as acks:
        await acks.until(has_terminal(cmd.command_id))
        await acks.drain(1.0)
    states = [a.state for a in acks.items if a.command_id == cmd.command_id]
    assert states == [AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED]
    assert runner.applied == ["v2"]
    assert len(_records(caplog, "cannot publish to Kafka")) == 1
    assert len(_records(caplog, "acks published again")) == 1


async def _committed(kafka: KafkaSettings, offset: int) -> None:
    """Wait until w1's committed position on the commands topic is ``offset``."""
    deadline = time.monotonic() + 120
    async with Consumer(kafka, group_id=kafka.topics.worker_group("w1")) as probe:
        await probe.assign(kafka.topics.commands.name, [0])
        while (now := await probe.committed(kafka.topics.commands.name, 0)) != offset:
            assert now is None, now
            assert time.monotonic() < deadline, "never committed"
            await asyncio.sleep(0.1)
