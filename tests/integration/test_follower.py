"""The Follower on a real broker: the cyclic garbage collector is off while it replays the log."""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime

import pytest

from controlplane.follower import Follower
from controlplane.protocol import Command, UpdateConfigSpec, encode, utcnow
from controlplane.rollout import Fleet
from controlplane.settings import KafkaSettings
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
    with caplog.at_level(logging.ERROR, logger="controlplane.follower"):
        async with Follower(kafka, fleet) as follower:
            async with asyncio.timeout(30):
                await follower.catch_up()
    assert commands[0].rollout_id in fleet and commands[2].rollout_id in fleet
    assert commands[1].rollout_id not in fleet
    assert follower.fold_errors == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "controlplane.follower"]
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
