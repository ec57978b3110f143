"""A reader never turns its own staleness into a verdict, on a real broker (issue 18).

Two readers that fall behind the workers topic while the workers go on beating: a CLI whose
replay ends long after the offsets it read to were current (``reload-weights --selector``,
``status``), and a coordinator whose event loop is blocked (by a big API response) while
heartbeats keep arriving. Both judge at the time their view of the log was current
(``Follower.current_as_of``), so neither sees its workers lost, a rollout losing them, no
live worker or NO_MATCHING_WORKERS.

Made deterministic without sleeps or wall-clock assertions: fetches bring about one record
batch each (:class:`SmallFetches`: a replay that takes one fetch per batch), heartbeats are
appended after the reader sampled its start offsets (so it lags when it has caught up with
them), a blocked loop waits on the writer's progress (a condition), and the readers' clocks
are injected an hour on (how long their replay or block lasted is then not a matter of timing).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

import controlplane.cli.follow as cli_follow
import controlplane.coordinator.follower as follower_module
from controlplane.cli.render import Output
from controlplane.cli.rollout import _publish_and_maybe_wait
from controlplane.coordinator.follower import Batch, Follower
from controlplane.coordinator.publisher import RolloutRequest, prepare_rollout
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.bus import Consumer, Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.exits import CliExit
from controlplane.wire.protocol import (
    AckState,
    CommandKind,
    ReloadWeightsSpec,
    Selector,
    encode,
    utcnow,
)
from controlplane.wire.topics import worker_key
from tests.factories import fake_heartbeat, succeeded_acks
from tests.fleet import make_command, publish

pytestmark = pytest.mark.kafka

WORKERS = ("w-1", "w-2", "w-3")
BIG = Selector(labels={"model": "big"})
SPEC = ReloadWeightsSpec(path="/ckpt/v2", version="v2")
#: The readers' clocks when their replay (or block) ends: an hour after the log they read.
HOUR = timedelta(hours=1)


class SmallFetches(Consumer):
    """A consumer whose fetches bring about one record batch each (at least one always comes)."""

    def __init__(self, settings: KafkaSettings, **kw: Any) -> None:
        kw["max_partition_fetch_bytes"] = 1024
        super().__init__(settings, **kw)


@pytest.fixture
def slow_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower_module, "Consumer", SmallFetches)


async def beat(settings: KafkaSettings, rounds: int, workers: Sequence[str] = WORKERS) -> None:
    """``rounds`` heartbeats of each worker, one record batch each (lease: 30 s)."""
    async with Producer(settings) as producer:
        for _ in range(rounds):
            for worker_id in workers:
                hb = fake_heartbeat(worker_id, utcnow(), interval_s=10.0, labels={"model": "big"})
                await producer.send(
                    settings.topics.workers.name, encode(hb), key=worker_key(worker_id)
                )


async def in_progress(settings: KafkaSettings) -> str:
    """A rollout pinned to the workers, accepted by each: progressing. Its rollout id."""
    command = make_command(SPEC, selector=Selector(worker_ids=list(WORKERS)))
    await publish(settings, command)
    async with Producer(settings) as producer:
        for worker_id in WORKERS:
            [accepted, _, _] = succeeded_acks(
                worker_id, command.rollout_id, command.command_id, CommandKind.RELOAD_WEIGHTS
            )
            assert accepted.state is AckState.ACCEPTED
            await producer.send(
                settings.topics.acks.name, encode(accepted), key=worker_key(worker_id)
            )
    return command.rollout_id


# --------------------------------------------------------------------------- a CLI's long replay


async def test_a_replay_that_ends_long_after_its_view_was_current_judges_the_workers_alive(
    kafka: KafkaSettings, slow_replay: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    await beat(kafka, rounds=3)
    rollout_id = await in_progress(kafka)
    late = utcnow() + HOUR
    monkeypatch.setattr(cli_follow, "utcnow", lambda: late)
    async with Follower(kafka) as follower:  # as `reload-weights` without --wait reads
        await beat(kafka, rounds=10)  # the workers beat on while it replays
        await cli_follow.catch_up(follower, kafka)
        assert not follower.reached(await follower.end_offsets())  # it lags: the case
        as_of = cli_follow.judge_time(follower)
        command = prepare_rollout(
            RolloutRequest(SPEC, BIG), follower.fleet, as_of=as_of, now=utcnow(), issuer="t"
        )
        assert command.selector.worker_ids == list(WORKERS)
        status = follower.fleet.status(rollout_id, as_of)
        assert status.phase is RolloutPhase.PROGRESSING
        assert status.counts.lost == 0 and status.counts.accepted == len(WORKERS)
        views = follower.fleet.registry.workers(as_of)
        assert [v.alive for v in views] == [True] * len(WORKERS)


async def test_reload_weights_with_a_selector_after_a_long_replay_publishes(
    kafka: KafkaSettings, slow_replay: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reload-weights --selector model=big`, whose replay ended an hour after its offsets
    were current (issue 18: NO_MATCHING_WORKERS, every heartbeat older than its window)."""
    await beat(kafka, rounds=3)
    late = utcnow() + HOUR
    monkeypatch.setattr(cli_follow, "utcnow", lambda: late)
    start = Follower.start
    lagging: list[bool] = []

    async def start_then_beat(self: Follower) -> None:
        await start(self)
        await beat(kafka, rounds=10)  # appended after its start offsets: it will lag

    async def catch_up(follower: Follower, settings: KafkaSettings) -> None:
        await cli_follow.catch_up(follower, settings)
        lagging.append(not follower.reached(await follower.end_offsets()))

    monkeypatch.setattr(Follower, "start", start_then_beat)
    monkeypatch.setattr("controlplane.cli.rollout.catch_up", catch_up)
    code = await _publish_and_maybe_wait(
        kafka,
        RolloutRequest(SPEC, BIG, rollout_id="r-after-a-long-replay"),
        wait=False,
        wait_timeout=None,
        output=Output.JSON,
    )
    assert lagging == [True]
    assert code == CliExit.OK
    async with Follower(kafka) as follower:
        await follower.catch_up()
        command = follower.fleet.command("r-after-a-long-replay")
    assert command.selector.worker_ids == list(WORKERS)


async def test_status_after_a_long_replay_shows_the_rollout_in_progress_with_none_lost(
    kafka: KafkaSettings, slow_replay: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status <id>` (a reader that probes), whose replay ended an hour after its offsets were
    current (issue 18: failed, every worker lost, after a 23.6 s replay)."""
    await beat(kafka, rounds=3)
    rollout_id = await in_progress(kafka)
    late = utcnow() + HOUR
    monkeypatch.setattr(cli_follow, "utcnow", lambda: late)
    start = Follower.start

    async def start_then_beat(self: Follower) -> None:
        await start(self)
        await beat(kafka, rounds=10)

    monkeypatch.setattr(Follower, "start", start_then_beat)
    async with cli_follow.read_log(kafka) as (follower, as_of):
        assert follower.probe and not follower.reached(await follower.end_offsets())
        status = follower.fleet.status(rollout_id, as_of)
    assert status.phase is RolloutPhase.PROGRESSING, status.message
    assert status.counts.lost == 0 and status.counts.accepted == len(WORKERS)


# --------------------------------------------------------------------------- a blocked coordinator


class Beating:
    """Workers that beat every ``every_s`` from another thread (its own loop and producer),
    whatever the reader's event loop is doing. ``rounds``: rounds written so far."""

    def __init__(self, settings: KafkaSettings, every_s: float = 0.05) -> None:
        self.settings = settings
        self.every_s = every_s
        self.rounds = 0
        self.error: BaseException | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="beating", daemon=True)

    def __enter__(self) -> Beating:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # told to the waiter, not lost in the thread
            self.error = exc
            with self._changed:
                self._changed.notify_all()

    async def _run(self) -> None:
        async with Producer(self.settings) as producer:
            while not self._stop.is_set():
                await beat_with(producer, self.settings)
                with self._changed:
                    self.rounds += 1
                    self._changed.notify_all()
                await asyncio.sleep(self.every_s)  # a worker's pace, not a synchronization

    def wait_rounds(self, n: int) -> None:
        """Block (the calling thread, whatever loop it runs) until ``n`` rounds are written."""
        with self._changed:
            done = self._changed.wait_for(lambda: self.rounds >= n or self.error, timeout=60)
        assert done and self.error is None, f"the workers stopped beating: {self.error!r}"


async def beat_with(producer: Producer, settings: KafkaSettings) -> None:
    for worker_id in WORKERS:
        hb = fake_heartbeat(worker_id, utcnow(), interval_s=10.0, labels={"model": "big"})
        await producer.send(settings.topics.workers.name, encode(hb), key=worker_key(worker_id))


class Judged:
    """What the coordinator would answer at one instant: its judge time, the workers alive
    (``/api/v1/workers?alive=true``), the selector's live workers (a POST's expected set),
    the rollout's phase and lost count (its status and SSE stream), and whether it lagged."""

    def __init__(self, coordinator: Coordinator, rollout_id: str) -> None:
        now = coordinator.now()
        fleet = coordinator.fleet
        self.now: datetime = now
        self.lagging = coordinator.follower.behind()
        self.alive = sum(v.alive for v in fleet.registry.workers(now))
        self.matching = [w.worker_id for w in fleet.registry.matching(BIG, now)]
        status = fleet.status(rollout_id, now)
        self.phase, self.lost = status.phase, status.counts.lost

    def __repr__(self) -> str:
        return repr(vars(self))


async def test_a_coordinator_blocked_while_workers_beat_judges_none_lost_when_it_resumes(
    kafka: KafkaSettings, slow_replay: None
) -> None:
    await beat(kafka, rounds=3)
    rollout_id = await in_progress(kafka)
    coordinator = Coordinator(
        CoordinatorSettings(kafka=kafka, controller=False),
        clock=lambda: utcnow() + HOUR,  # how long its loop was blocked, made long
    )
    judged: dict[str, Judged] = {}
    blocked_in_replay: list[bool] = []
    failures: list[BaseException] = []
    done = asyncio.Event()
    with Beating(kafka) as workers:

        def block_until_more_rounds() -> None:
            """A blocking call inside the loop (a big response being built) while the
            workers go on beating: it ends when they have written 10 more rounds."""
            workers.wait_rounds(workers.rounds + 10)

        def listener(batch: Batch) -> None:
            try:
                follower = coordinator.follower
                if not blocked_in_replay and batch.replay and not follower.caught_up.is_set():
                    blocked_in_replay.append(True)  # blocked mid-replay, once
                    block_until_more_rounds()
                elif "ready" not in judged and follower.caught_up.is_set():
                    judged["ready"] = Judged(coordinator, rollout_id)
                    block_until_more_rounds()  # blocked again, once ready
                    judged["resumed"] = Judged(coordinator, rollout_id)
                    done.set()
            except BaseException as exc:  # never into the coordinator's loop
                failures.append(exc)
                done.set()

        coordinator.follower.listeners.append(listener)
        async with coordinator:
            await coordinator.wait_ready(60)
            await asyncio.wait_for(done.wait(), 60)
    assert not failures, failures
    assert blocked_in_replay == [True]
    for moment in ("ready", "resumed"):
        seen = judged[moment]
        assert seen.lagging, (moment, seen)  # the case: its own backlog still to read
        assert seen.alive == len(WORKERS), (moment, seen)
        assert seen.matching == list(WORKERS), (moment, seen)
        assert seen.phase is RolloutPhase.PROGRESSING and seen.lost == 0, (moment, seen)


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    before = {t.name for t in threading.enumerate()}
    yield
    assert not ({t.name for t in threading.enumerate()} - before) & {"beating"}
