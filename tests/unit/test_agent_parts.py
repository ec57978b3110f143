"""The agent's pure parts, without Kafka: the precheck, a replayed ack, the stop signal, the view."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    ReloadWeightsSpec,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
)
from workers.agent.commands import precheck, replayed
from workers.agent.session import StopSignal, WorkerView
from workers.agent.settings import WorkerSettings
from workers.runners.base import DegradedInfo, RunnerDescription

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def command(
    spec: ReloadWeightsSpec | UpdateConfigSpec,
    *,
    issued: datetime = T0,
    ttl_s: float = 600.0,
    command_id: str = "c1",
) -> Command:
    return Command(
        command_id=command_id,
        rollout_id="r1",
        issued_at=issued,
        expires_at=issued + timedelta(seconds=ttl_s),
        issuer="test",
        spec=spec,
    )


@pytest.fixture
def settings(tmp_path: Path) -> WorkerSettings:
    (tmp_path / "ckpts").mkdir()
    return WorkerSettings(
        worker_id="w1",
        allowed_roots=[tmp_path / "ckpts"],
        max_ttl_s=3600,
        max_clock_skew_s=60,
    )


def rejected(found: Path | ControlPlaneError | None) -> WireCode | LocalCode:
    assert isinstance(found, ControlPlaneError), found
    return found.code


def test_precheck_resolves_the_weights_path_of_a_valid_reload(
    settings: WorkerSettings, tmp_path: Path
) -> None:
    spec = ReloadWeightsSpec(path=str(tmp_path / "ckpts" / "v2"), version="v2")
    assert precheck(command(spec), T0, settings) == (tmp_path / "ckpts" / "v2").resolve()
    config = UpdateConfigSpec(overrides={"max_new_tokens": 3})
    assert precheck(command(config), T0, settings) is None


@pytest.mark.parametrize(
    ("issued", "ttl_s", "now", "code"),
    [
        (T0, 600.0, T0 + timedelta(seconds=601), WireCode.EXPIRED),
        (T0 + timedelta(seconds=61), 600.0, T0, WireCode.ISSUED_IN_FUTURE),
        (T0, 3601.0, T0, WireCode.TTL_TOO_LONG),
    ],
)
def test_precheck_rejects_in_the_order_expiry_issue_time_ttl(
    settings: WorkerSettings, issued: datetime, ttl_s: float, now: datetime, code: WireCode
) -> None:
    config = UpdateConfigSpec(overrides={"max_new_tokens": 3})
    assert rejected(precheck(command(config, issued=issued, ttl_s=ttl_s), now, settings)) is code


def test_precheck_rejects_a_path_outside_the_allowed_roots(settings: WorkerSettings) -> None:
    spec = ReloadWeightsSpec(path="/etc/passwd", version="v2")
    assert rejected(precheck(command(spec), T0, settings)) is WireCode.PATH_NOT_ALLOWED


def test_a_replayed_ack_counts_an_attempt_and_says_so() -> None:
    ack = Ack(
        command_id="c1",
        rollout_id="r1",
        worker_id="w1",
        state=AckState.SUCCEEDED,
        timings=Timings(received_at=T0),
        sent_at=T0,
        result={"version": "v2"},
    )
    again = replayed(ack, T0 + timedelta(seconds=5))
    assert again.attempt == ack.attempt + 1
    assert again.sent_at == T0 + timedelta(seconds=5)
    assert again.result == {"version": "v2", "replayed": True}
    assert again.timings == ack.timings and again.state is ack.state


async def test_a_stop_sets_its_wakeups_once_and_fixes_its_deadlines() -> None:
    stop = StopSignal(drain_timeout_s=10.0)
    early, late = asyncio.Event(), asyncio.Event()
    stop.add_wakeup(early)
    assert stop.deadline(0.0, 5.0) is None and stop.drain_deadline() is None
    stop.request()
    assert early.is_set() and stop.is_set()
    at = stop.stopped_at
    assert at is not None
    stop.request()  # a second request changes nothing
    assert stop.stopped_at == at
    stop.add_wakeup(late)  # registered after the stop: set at once
    assert late.is_set()
    assert stop.drain_deadline() == at + 10.0
    # A publish that began before the stop gets the drain timeout; one that begins later
    # than that still gets its least.
    assert stop.deadline(at - 1.0, 5.0) == at + 10.0
    assert stop.deadline(at + 8.0, 5.0) == at + 13.0


async def test_unless_stopped_gives_the_result_or_none_once_stopped() -> None:
    stop = StopSignal(drain_timeout_s=1.0)

    async def value() -> int:
        return 7

    assert await stop.unless_stopped(value()) == 7
    never = asyncio.Event()
    waiting = asyncio.ensure_future(stop.unless_stopped(never.wait()))
    await asyncio.sleep(0)
    stop.request()
    assert await waiting is None
    assert await stop.unless_stopped(value()) == 7  # after a stop: just the call
    await asyncio.wait_for(stop.sleep(3600.0), 60.0)  # returns at once once stopped


async def test_one_stop_ends_every_unless_stopped_wait_and_leaves_no_task_behind() -> None:
    stop = StopSignal(drain_timeout_s=1.0)
    never = asyncio.Event()
    calls = [asyncio.ensure_future(stop.unless_stopped(never.wait())) for _ in range(3)]
    await asyncio.sleep(0)
    # This test, and per wait its own task and its call's: the three race one shared stop
    # future, not a task each.
    assert len(asyncio.all_tasks()) == 1 + 3 * 2
    stop.request()
    assert await asyncio.gather(*calls) == [None, None, None]
    assert asyncio.all_tasks() == {asyncio.current_task()}  # the calls were cancelled, unwound


def test_unless_stopped_works_in_each_event_loop_the_signal_meets() -> None:
    stop = StopSignal(drain_timeout_s=1.0)

    async def value() -> int:
        return 7

    assert asyncio.run(stop.unless_stopped(value())) == 7
    assert asyncio.run(stop.unless_stopped(value())) == 7  # a second loop: a new stop future

    async def stopped_meanwhile() -> object:
        never = asyncio.Event()
        waiting = asyncio.ensure_future(stop.unless_stopped(never.wait()))
        await asyncio.sleep(0)
        stop.request()
        return await waiting

    assert asyncio.run(stopped_meanwhile()) is None


def test_the_view_says_degraded_before_stopping() -> None:
    view = WorkerView()
    assert view.device == "unknown"
    assert view.idle_status(stopping=False) is WorkerStatus.READY
    assert view.idle_status(stopping=True) is WorkerStatus.STOPPING
    view.describe = RunnerDescription(
        runner="fake",
        device="cpu",
        model_loaded=True,
        weights_version="v1",
        config={},
        config_digest="d",
        accepts={},
        degraded=DegradedInfo(code="X", message="m", from_version=None, to_version="v2", since=T0),
    )
    assert view.device == "cpu"
    assert view.idle_status(stopping=True) is WorkerStatus.DEGRADED
