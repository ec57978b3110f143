"""The Follower on a real broker: the cyclic garbage collector is off while it replays the log."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from controlplane.follower import Follower
from controlplane.protocol import UpdateConfigSpec
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
