"""The time a reader judges liveness at: when its view of the log was current, never its clock.

The rule (:class:`~controlplane.coordinator.follower.PartitionClock`, docs/rollouts.md,
Liveness): a partition is read up to T when the reader's position has reached an end the
partition had at T (sampled at start, or returned by a fetch sent at T), or when it has read a
record appended at T; a view is current as of its oldest partition. Times are injected here:
the consumer's progress is given, no broker and no clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.coordinator.follower import Follower, PartitionClock, view_as_of
from controlplane.kafka.bus import LOG_APPEND_TIME, Record
from controlplane.kafka.consumer import PartitionProgress
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.wire.protocol import Selector
from tests.factories import fake_heartbeat

T0 = 1_700_000_000.0
WORKERS, ACKS = "fleet.workers", "fleet.acks"


def _when(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


# --------------------------------------------------------------------------- one partition


def test_an_end_counts_once_the_position_reaches_it() -> None:
    clock = PartitionClock()
    clock.reached(T0, end=10, position=9)
    assert clock.as_of() is None  # behind the end it knew at T0: nothing is known read
    clock.reached(T0, end=10, position=10)
    assert clock.as_of() == T0


def test_the_latest_end_reached_counts_and_an_older_one_never_takes_it_back() -> None:
    clock = PartitionClock()
    clock.reached(T0 + 5, end=50, position=50)
    clock.reached(T0, end=10, position=50)
    clock.reached(T0 + 9, end=90, position=50)  # a later fetch, not handed out yet
    assert clock.as_of() == T0 + 5


def test_a_lagging_reader_is_current_as_of_the_last_append_it_read() -> None:
    clock = PartitionClock()
    clock.reached(T0, end=10, position=10)
    clock.reached(T0 + 60, end=1_000_000, position=20)  # a minute of backlog behind
    clock.appended(T0 + 3)  # ...read into: everything appended before T0 + 3 is read
    assert clock.as_of() == T0 + 3


def test_a_probers_workers_partition_counts_appends_only_unless_it_knows_none() -> None:
    clock = PartitionClock()
    clock.reached(T0, end=10, position=10, start=True)
    clock.reached(T0 + 9, end=12, position=12)
    # No append time known yet (an empty topic, or no LogAppendTime before its probe came
    # back): the start sample, never a later fetch, which a later append would go back on.
    assert clock.as_of(ends_count=False) == T0
    clock.appended(T0 + 2)
    assert clock.as_of(ends_count=False) == T0 + 2  # writes held back hide below no end
    assert clock.as_of() == T0 + 9


def test_a_view_is_current_as_of_its_oldest_partition() -> None:
    assert view_as_of([T0 + 3, T0 + 1, T0 + 2]) == T0 + 1
    assert view_as_of([T0, None]) is None
    assert view_as_of([]) is None


# --------------------------------------------------------------------------- the follower


@pytest.fixture
async def follower() -> AsyncIterator[Follower]:
    f = Follower(KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    yield f
    await f.stop()  # never started: closes its consumer


def _caught_up(
    f: Follower,
    sampled_at: float,
    targets: dict[tuple[str, int], int],
    progress: dict[tuple[str, int], PartitionProgress],
) -> None:
    """``f`` as if it had started at ``sampled_at`` with ``targets`` and read to ``progress``."""
    f._targets = dict(targets)
    f._targets_at = sampled_at
    f._consumer.progress = lambda: progress  # type: ignore[method-assign]
    f.caught_up.set()


def _replaying(f: Follower, position: int) -> None:
    """Started at T0 (the workers partition then ended at 100); the last fetch, sent at
    T0 + 60, says it ends at 5000 now, and the reader is at ``position``."""
    _caught_up(
        f,
        T0,
        {(WORKERS, 0): 100, (ACKS, 0): 0},
        {
            (WORKERS, 0): PartitionProgress(position=position, end=5000, fetched_at=T0 + 60),
            (ACKS, 0): PartitionProgress(position=0, end=0, fetched_at=T0 + 60),
        },
    )


async def test_a_reader_at_the_ends_it_sampled_is_current_as_of_the_sample_while_it_lags(
    follower: Follower,
) -> None:
    # It replayed for a minute while workers kept beating, and has not read past the start.
    _replaying(follower, position=100)
    assert follower.current_as_of() == _when(T0)  # not None: no caller falls back to a clock


async def test_a_lagging_reader_advances_through_its_backlog_by_append_times(
    follower: Follower,
) -> None:
    _replaying(follower, position=300)
    appended = Record(WORKERS, 0, 299, b"w1", b"{}", int((T0 + 4) * 1000), LOG_APPEND_TIME)
    follower._note_written([appended], now=T0 + 61)
    assert follower.current_as_of() == _when(T0 + 4)


async def test_a_broker_clock_ahead_of_the_readers_is_capped_at_the_readers(
    follower: Follower,
) -> None:
    _caught_up(
        follower,
        T0,
        {(WORKERS, 0): 1},
        {(WORKERS, 0): PartitionProgress(position=1, end=1, fetched_at=T0 + 1)},
    )
    ahead = Record(WORKERS, 0, 0, b"w1", b"{}", int((T0 + 30) * 1000), LOG_APPEND_TIME)
    follower._note_written([ahead], now=T0 + 2)
    assert follower.current_as_of() == _when(T0 + 2)


async def test_a_fetch_end_noted_at_the_poll_survives_a_later_fetch_answered_ahead(
    follower: Follower,
) -> None:
    """aiokafka fetches ahead: by the time someone asks, a newer answer (not handed out yet)
    hides the end this poll reached. The poll notes it before anything else runs."""
    progress = {(ACKS, 0): PartitionProgress(position=7, end=7, fetched_at=T0 + 10)}
    _caught_up(follower, T0, {(ACKS, 0): 3}, progress)
    follower._note_reached()  # what poll() does after its fold
    progress[(ACKS, 0)] = PartitionProgress(position=7, end=9, fetched_at=T0 + 11)
    assert follower.current_as_of() == _when(T0 + 10)


# --------------------------------------------------------------------------- judged at it


def test_workers_current_as_of_the_view_are_alive_whatever_the_readers_clock() -> None:
    """A replay that ended an hour after its view was current: judged at the view's time, the
    workers are alive; at the reader's clock they would all look lost."""
    fleet = Fleet()
    sent = _when(T0 - 1)
    for worker_id in ("w1", "w2"):
        fleet.observe_heartbeat(
            fake_heartbeat(worker_id, sent, interval_s=3.0, labels={"model": "big"}),
            received_at=sent,
        )
    as_of, clock = _when(T0), _when(T0) + timedelta(hours=1)
    selector = Selector(labels={"model": "big"})
    assert [w.worker_id for w in fleet.registry.matching(selector, as_of)] == ["w1", "w2"]
    assert fleet.registry.matching(selector, clock) == []  # what the clock would have said
    # A worker silent beyond its window as of the view is lost, as before.
    assert fleet.registry.matching(selector, _when(T0 + 9)) == []
