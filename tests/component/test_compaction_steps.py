"""The coordinator's compaction of ended rollouts at fleet scale (issue 18): one rollout judged at
a time with the loop free between two, and rollouts a reader's judgment found ended not judged
again. No Kafka: never-started coordinators fed directly (tests/component/conftest.py).
Nothing here asserts on time: what was judged, in what order with what else ran.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from datetime import datetime

import pytest

from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.coordinator.summary import Summaries
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.wire.protocol import AckState
from tests.component.conftest import Clock, ack, command, feed, heartbeat, succeeded

Make = Callable[[int], Coordinator]


@pytest.fixture
async def make(clock: Clock) -> AsyncIterator[Make]:
    made: list[Coordinator] = []

    def build(keep: int) -> Coordinator:
        """Five rollouts of w1, w2: r0..r3 succeeded, r4 in progress; ``keep`` ended in full."""
        settings = CoordinatorSettings(
            kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), max_ended_rollouts=keep
        )
        coord = Coordinator(settings, clock=clock, current_as_of=clock)
        coord.follower.caught_up.set()
        made.append(coord)
        feed(coord, heartbeat("w1", 9.0), heartbeat("w2", 9.0))
        for i in range(4):
            cmd = command(f"r{i}", issued=i * 0.5)
            feed(coord, cmd, *succeeded(cmd, "w1", "w2", sent=i * 0.5 + 2.0))
        live = command("r4", issued=3.0)
        feed(coord, live, ack(live, "w1", AckState.RUNNING, 4.0))
        return coord

    yield build
    for coord in made:
        await coord.stop()


def judged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rollout ids compaction judges from now on (not yet known to have ended), in order."""
    seen: list[str] = []
    check_ended = Fleet.check_ended

    def counting(self: Fleet, rollout_id: str, now: datetime) -> datetime | None:
        if self.ended(rollout_id) is None:
            seen.append(rollout_id)
        return check_ended(self, rollout_id, now)

    monkeypatch.setattr(Fleet, "check_ended", counting)
    return seen


async def test_stepwise_compaction_summarizes_what_compact_does(make: Make) -> None:
    at_once, stepwise = make(1), make(1)
    assert at_once.compact() == 3
    assert await stepwise.compact_stepwise() == 3
    now = at_once.now()
    for rollout_id in at_once.fleet.rollout_ids():
        assert stepwise.fleet.status(rollout_id, now) == at_once.fleet.status(rollout_id, now)
    assert [stepwise.fleet.ended(r) for r in ("r0", "r3", "r4")] == [
        at_once.fleet.ended(r) for r in ("r0", "r3", "r4")
    ]
    assert stepwise.fleet.ended("r4") is None
    assert stepwise.fleet.stats().compacted == 3


async def test_stepwise_compaction_leaves_the_loop_free_between_two_rollouts(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make(0)
    seen = judged(monkeypatch)
    ticks = 0
    ticks_at: list[int] = []
    check_ended = Fleet.check_ended

    def noting(self: Fleet, rollout_id: str, now: datetime) -> datetime | None:
        ticks_at.append(ticks)
        return check_ended(self, rollout_id, now)

    monkeypatch.setattr(Fleet, "check_ended", noting)

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    try:
        assert await coord.compact_stepwise() == 4
    finally:
        other.cancel()
    assert len(ticks_at) == 5  # r0..r4, each judged once
    assert all(b > a for a, b in itertools.pairwise(ticks_at)), ticks_at
    assert seen == ["r0", "r1", "r2", "r3", "r4"]


async def test_compaction_does_not_judge_again_what_a_reader_found_ended(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make(0)
    summaries = Summaries(coord)
    try:
        await summaries.prepare()  # a reader's judgments: every rollout, r0..r3 ended
        seen = judged(monkeypatch)
        assert await coord.compact_stepwise() == 4
    finally:
        summaries.close()
    assert seen == ["r4"]  # only the one in progress


async def test_a_judgment_made_before_the_coordinator_caught_up_is_not_trusted(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = make(0)
    coord.follower.caught_up.clear()  # its view is not known current: a judgment proves nothing
    summaries = Summaries(coord)
    try:
        summaries.overview_cached("r0")
        assert coord.fleet.ended("r0") is None
        coord.follower.caught_up.set()
        summaries.overview_cached("r1")
        assert summaries.judgments == 2
    finally:
        summaries.close()
    assert coord.fleet.ended("r0") is None
    assert coord.fleet.ended("r1") is not None
