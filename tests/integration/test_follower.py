"""The Follower on a real broker: the cyclic garbage collector is off while it replays the log."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

import pytest

from controlplane.coordinator.follower import Follower
from controlplane.kafka.bus import Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.wire.protocol import (
    Command,
    Heartbeat,
    UpdateConfigSpec,
    encode,
    utcnow,
)
from controlplane.wire.topics import worker_key
from tests.factories import fake_heartbeat, fresh_topics
from tests.fleet import make_command, publish

pytestmark = pytest.mark.kafka


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    assert gc.isenabled()
    yield
    gc.enable()  # whatever a failing test left behind


async def test_the_collector_is_off_while_replaying_and_on_once_caught_up(
    kafka: KafkaSettings,
) -> None:
    command = make_command(UpdateConfigSpec(overrides={"temperature": 0.5}))
    await publish(kafka, command)
    async with Follower(kafka) as follower:
        assert not follower.caught_up.is_set()
        assert not gc.isenabled(), "a replay runs without the cyclic collector"
        await follower.catch_up()
        assert gc.isenabled(), "back on once caught up"
        assert command.rollout_id in follower.fleet
    assert gc.isenabled()


async def test_a_follower_stopped_before_catching_up_turns_the_collector_back_on(
    kafka: KafkaSettings,
) -> None:
    await publish(kafka, make_command(UpdateConfigSpec(overrides={"temperature": 0.5})))
    async with Follower(kafka) as follower:
        assert not gc.isenabled()
        assert not follower.caught_up.is_set()
    assert gc.isenabled()


async def test_an_empty_log_and_someone_elses_pause_are_left_alone(kafka: KafkaSettings) -> None:
    async with Follower(kafka) as follower:  # nothing to replay: nothing to pause
        assert follower.caught_up.is_set() and gc.isenabled()
    await publish(kafka, make_command(UpdateConfigSpec(overrides={"temperature": 0.5})))
    gc.disable()
    async with Follower(kafka) as follower:
        await follower.catch_up()
    assert not gc.isenabled(), "a pause the follower did not make is not its to end"


# --------------------------------------------------------------------------- catching up by positions
#
# Foreign clients (aiokafka itself here, as kcat or an operator's admin tool would) make logs
# whose last offset holds no record the follower can read.


async def test_a_partition_emptied_by_retention_is_caught_up(kafka: KafkaSettings) -> None:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    for n in range(3):
        await publish(kafka, make_command(UpdateConfigSpec(overrides={"n": n})))
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        tp = TopicPartition(kafka.topics.commands.name, 0)
        await admin.delete_records({tp: RecordsToDelete(before_offset=3)})
    finally:
        await admin.close()
    async with Follower(kafka) as follower:  # log start == end == 3: nothing left to read
        async with asyncio.timeout(30):
            await follower.catch_up()
        assert follower.records == 0 and not follower.fleet.rollouts(utcnow())
        assert gc.isenabled()


async def test_a_partition_ending_in_a_transaction_marker_is_caught_up(
    kafka: KafkaSettings,
) -> None:
    from aiokafka import AIOKafkaProducer

    command = make_command(UpdateConfigSpec(overrides={"temperature": 0.5}))
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers, transactional_id=f"tx-{uuid.uuid4().hex}"
    )
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(kafka.topics.commands.name, encode(command))
    finally:
        await producer.stop()
    async with Follower(kafka) as follower:  # offset 0: the command; offset 1: the commit marker
        async with asyncio.timeout(30):
            await follower.catch_up()
        assert command.rollout_id in follower.fleet


# --------------------------------------------------------------------------- a failing fold


class _FleetThatFailsOn(Fleet):
    def __init__(self, rollout_id: str) -> None:
        super().__init__()
        self.poison = rollout_id

    def observe_command(self, command: Command) -> None:
        if command.rollout_id == self.poison:
            raise RuntimeError("boom")
        super().observe_command(command)


async def test_a_record_whose_fold_fails_is_counted_and_logged_and_the_batch_goes_on(
    kafka: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    commands = [make_command(UpdateConfigSpec(overrides={"n": n})) for n in range(3)]
    await publish(kafka, *commands)
    fleet = _FleetThatFailsOn(commands[1].rollout_id)
    with caplog.at_level(logging.ERROR, logger="controlplane.coordinator.follower"):
        async with Follower(kafka, fleet) as follower:
            async with asyncio.timeout(30):
                await follower.catch_up()
    assert commands[0].rollout_id in fleet and commands[2].rollout_id in fleet
    assert commands[1].rollout_id not in fleet
    assert follower.fold_errors == 1
    lines = [
        r.getMessage() for r in caplog.records if r.name == "controlplane.coordinator.follower"
    ]
    assert any(f"{kafka.topics.commands.name}[0]@1" in line and "boom" in line for line in lines), (
        lines
    )


# --------------------------------------------------------------------------- current_as_of


async def test_current_as_of_is_none_until_caught_up_then_follows_the_fetches(
    kafka: KafkaSettings,
) -> None:
    await publish(kafka, make_command(UpdateConfigSpec(overrides={"temperature": 0.5})))
    async with Follower(kafka) as follower:
        assert follower.current_as_of() is None
        await follower.catch_up()
        first = await _until_current(follower, None)
        assert first <= utcnow()
        later = await _until_current(follower, first)
        assert later > first


async def _until_current(follower: Follower, after: datetime | None) -> datetime:
    async with asyncio.timeout(30):
        while True:
            await follower.poll(timeout_s=0.2)
            at = follower.current_as_of()
            if at is not None and (after is None or at > after):
                return at


# --------------------------------------------------------------------------- received_at


class _RecordingFleet(Fleet):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[Heartbeat, datetime | None]] = []

    def observe_heartbeat(self, heartbeat: Heartbeat, received_at: datetime | None = None) -> bool:
        self.received.append((heartbeat, received_at))
        return super().observe_heartbeat(heartbeat, received_at)


def _heartbeat(worker_id: str, sent_at: datetime) -> Heartbeat:
    return fake_heartbeat(worker_id, sent_at, interval_s=1.0)


async def _send_heartbeat(settings: KafkaSettings, hb: Heartbeat) -> tuple[datetime, datetime]:
    """Publish; returns the wall clock just before and just after (to the millisecond)."""
    async with Producer(settings) as producer:
        before = utcnow().replace(microsecond=utcnow().microsecond // 1000 * 1000)
        before = before - timedelta(milliseconds=1)
        await producer.send(settings.topics.workers.name, encode(hb), key=worker_key(hb.worker_id))
        after = utcnow()
    return before, after


async def test_received_at_is_the_brokers_append_time_whatever_the_workers_clock(
    kafka: KafkaSettings,
) -> None:
    skewed = utcnow() - timedelta(hours=1)  # a worker whose clock is an hour behind
    replayed = _heartbeat("w-replayed", skewed)
    before_replayed, after_replayed = await _send_heartbeat(kafka, replayed)
    fleet = _RecordingFleet()
    async with Follower(kafka, fleet) as follower:
        await follower.catch_up()
        live = _heartbeat("w-live", skewed)
        before_live, after_live = await _send_heartbeat(kafka, live)
        async with asyncio.timeout(30):
            while len(fleet.received) < 2:
                await follower.poll(timeout_s=0.2)
    got = {hb.worker_id: at for hb, at in fleet.received}
    assert got["w-replayed"] is not None and got["w-live"] is not None
    assert before_replayed <= got["w-replayed"] <= after_replayed
    assert before_live <= got["w-live"] <= after_live


async def test_without_log_append_time_replayed_keeps_its_own_clock_live_gets_the_readers(
    kafka_bootstrap: str,
) -> None:
    from controlplane.kafka.bus import Admin
    from tests.integration.test_topics import _OlderTopics

    settings = fresh_topics(kafka_bootstrap, "n")
    prefix = settings.topic_prefix
    async with Admin(settings) as admin:
        await admin.ensure_topics(_OlderTopics(prefix=prefix))
    skewed = utcnow() - timedelta(hours=1)
    await _send_heartbeat(settings, _heartbeat("w-replayed", skewed))
    fleet = _RecordingFleet()
    async with Follower(settings, fleet) as follower:
        await follower.catch_up()
        before, _ = await _send_heartbeat(settings, _heartbeat("w-live", skewed))
        async with asyncio.timeout(30):
            while len(fleet.received) < 2:
                await follower.poll(timeout_s=0.2)
        after = utcnow()
    got = {hb.worker_id: at for hb, at in fleet.received}
    assert got["w-replayed"] is None  # the registry falls back to the heartbeat's sent_at
    assert got["w-live"] is not None and before <= got["w-live"] <= after


# --------------------------------------------------------------------------- probes
#
# A prober holding back its judgement while Kafka holds writes back needs a cluster:
# tests/integration/test_cluster.py.


async def test_without_probes_nothing_is_written_and_the_time_is_the_fetches(
    kafka: KafkaSettings,
) -> None:
    async with Follower(kafka) as follower:
        await follower.catch_up()
        await _poll_until([follower], lambda: follower.current_as_of() is not None)
        assert follower.probes_sent == 0
        end = await _workers_end(kafka)
    assert end == 0


async def _poll_until(
    followers: list[Follower], done: Callable[[], bool], timeout: float = 60.0
) -> None:
    async with asyncio.timeout(timeout):
        while not done():
            for follower in followers:
                await follower.poll(timeout_s=0.05)


async def _workers_end(settings: KafkaSettings) -> int:
    from controlplane.kafka.bus import Consumer

    async with Consumer(settings) as consumer:
        ends = await consumer.end_offsets(settings.topics.workers.name)
    return sum(ends.values())


async def test_a_tombstone_removes_the_worker_from_a_running_reader_as_from_a_fresh_one(
    kafka: KafkaSettings,
) -> None:
    """A worker gone for good is removed with a tombstone (``kcat -K: -Z``, key = its id): a
    reader following the log drops it, as a fresh reader of the compacted topic never sees it."""
    await _send_heartbeat(kafka, _heartbeat("w-gone", utcnow()))
    await _send_heartbeat(kafka, _heartbeat("w-stays", utcnow()))
    fleet = Fleet()
    async with Follower(kafka, fleet) as follower:
        await follower.catch_up()
        assert "w-gone" in fleet.registry and "w-stays" in fleet.registry
        async with Producer(kafka) as producer:
            await producer.send(kafka.topics.workers.name, None, key=worker_key("w-gone"))
        async with asyncio.timeout(30):
            while "w-gone" in fleet.registry:
                await follower.poll(timeout_s=0.2)
    assert "w-stays" in fleet.registry
    fresh = Fleet()
    async with Follower(kafka, fresh) as reader:
        await reader.catch_up()
    assert "w-gone" not in fresh.registry and "w-stays" in fresh.registry
