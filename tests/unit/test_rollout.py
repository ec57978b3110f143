"""Unit tests for the rollout state machine: phases, per-worker states, replay order and determinism."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controlplane.rollout.fleet import DEFAULT_PROGRESS_DEADLINE_S, Fleet
from controlplane.rollout.models import (
    AnomalyCode,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
    WorkerState,
)
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Heartbeat,
    ReloadWeightsSpec,
    Selector,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
)
from tests.factories import at, heartbeat

TICK = timedelta(microseconds=1)
A, R, S, F, X = (
    AckState.ACCEPTED,
    AckState.RUNNING,
    AckState.SUCCEEDED,
    AckState.FAILED,
    AckState.REJECTED,
)


# --------------------------------------------------------------------------- factories


def command(
    rollout_id: str = "r1",
    command_id: str = "c1",
    *,
    workers: Sequence[str] | None = ("w1", "w2"),
    labels: dict[str, str] | None = None,
    issued: float = 0.0,
    expires: float = 3600.0,
    version: str = "v2",
    overrides: dict[str, Any] | None = None,
) -> Command:
    spec: ReloadWeightsSpec | UpdateConfigSpec = (
        UpdateConfigSpec(overrides=overrides)
        if overrides is not None
        else ReloadWeightsSpec(path="/ckpt", version=version)
    )
    return Command(
        command_id=command_id,
        rollout_id=rollout_id,
        issued_at=at(issued),
        expires_at=at(expires),
        issuer="ci",
        selector=Selector(
            worker_ids=list(workers) if workers is not None else None, labels=labels or {}
        ),
        spec=spec,
    )


def ack(
    worker_id: str,
    state: AckState,
    sent: float,
    *,
    rollout_id: str = "r1",
    command_id: str = "c1",
    code: str | None = None,
    version: str | None = None,
    attempt: int = 1,
    started: float | None = None,
    retryable: bool = False,
) -> Ack:
    error = None
    if state in (F, X):
        default = "CHECKSUM_MISMATCH" if state is X else "RUNNER_FAILED"
        error = AckError(code=code or default, message=f"{worker_id} broke", retryable=retryable)
    if version is None and state is S:
        version = "v2"
    if started is None and state is R:
        started = sent
    return Ack(
        command_id=command_id,
        rollout_id=rollout_id,
        worker_id=worker_id,
        kind=CommandKind.RELOAD_WEIGHTS,
        state=state,
        weights_version=version,
        error=error,
        timings=Timings(
            received_at=at(sent if started is None else min(started, sent)),
            started_at=at(started) if started is not None else None,
            finished_at=at(sent) if state.terminal else None,
        ),
        attempt=attempt,
        sent_at=at(sent),
    )


Event = Command | Ack | Heartbeat | tuple[str, str, datetime]


def abort_event(reason: str, when: float, rollout_id: str = "r1") -> tuple[str, str, datetime]:
    return (rollout_id, reason, at(when))


def feed(fleet: Fleet, events: Iterable[Event]) -> Fleet:
    for event in events:
        if isinstance(event, Command):
            fleet.observe_command(event)
        elif isinstance(event, Ack):
            fleet.observe_ack(event)
        elif isinstance(event, Heartbeat):
            fleet.observe_heartbeat(event)
        else:
            fleet.abort(*event)
    return fleet


def fleet(*events: Event, deadline: float = DEFAULT_PROGRESS_DEADLINE_S) -> Fleet:
    return feed(Fleet(progress_deadline_s=deadline), events)


def alive(*workers: str, sent: float, **kw: Any) -> list[Heartbeat]:
    return [heartbeat(w, sent, **kw) for w in workers]


def status(*events: Event, now: float, deadline: float = 600.0) -> RolloutStatus:
    return fleet(*events, deadline=deadline).status("r1", at(now))


def states(st_: RolloutStatus) -> dict[str, WorkerState]:
    return {d.worker_id: d.state for d in st_.workers}


def full(worker_id: str, start: float, end: float, terminal: AckState = S, **kw: Any) -> list[Ack]:
    """accepted, running and a terminal ack, as a worker sends them."""
    return [
        ack(worker_id, A, start, **kw),
        ack(worker_id, R, start + 1, **kw),
        ack(worker_id, terminal, end, started=start + 1, **kw),
    ]


# --------------------------------------------------------------------------- phases


def test_pending_until_a_worker_acks() -> None:
    s = status(command(), *alive("w1", "w2", sent=10), now=11)
    assert s.phase is RolloutPhase.PENDING and s.reason is None
    assert s.exit_code is None and not s.terminal
    assert s.expected == 2 and s.counts == StateCounts(pending=2)
    assert s.started_at is None and s.finished_at is None and s.duration_s is None
    assert s.target_version == "v2" and s.kind is CommandKind.RELOAD_WEIGHTS
    assert "waiting for 2" in s.message


def test_progressing_after_the_first_ack() -> None:
    s = status(command(), *alive("w1", "w2", sent=10), ack("w1", A, 5), now=11)
    assert s.phase is RolloutPhase.PROGRESSING
    assert s.counts == StateCounts(pending=1, accepted=1)
    assert s.started_at == at(5)


def test_succeeded_when_every_expected_worker_succeeded() -> None:
    s = status(
        command(), *alive("w1", "w2", sent=30), *full("w1", 1, 10), *full("w2", 2, 20), now=31
    )
    assert s.phase is RolloutPhase.SUCCEEDED and s.exit_code == 0 and s.reason is None
    assert s.counts == StateCounts(succeeded=2)
    assert s.started_at == at(1) and s.finished_at == at(20) and s.duration_s == 20.0
    w2 = s.worker("w2")
    assert w2 is not None
    assert w2.state is WorkerState.SUCCEEDED and w2.late_state is None
    assert (w2.weights_version, w2.attempt, w2.acks, w2.error) == ("v2", 1, 3, None)
    assert (w2.accepted_at, w2.started_at, w2.finished_at) == (at(2), at(3), at(20))
    assert w2.duration_s == 17.0 and w2.last_ack_at == at(20)
    assert s.worker("nope") is None
    assert s.message == "all 2 worker(s) succeeded"


def test_failed_carries_the_error_of_each_worker() -> None:
    s = status(
        command(),
        *alive("w1", "w2", sent=30),
        *full("w1", 1, 10),
        *full("w2", 2, 20, terminal=F),
        now=31,
    )
    assert s.phase is RolloutPhase.FAILED and s.exit_code == 1
    assert s.reason is RolloutReason.WORKERS_FAILED
    assert s.counts == StateCounts(succeeded=1, failed=1)
    w2 = s.worker("w2")
    assert w2 is not None and w2.error is not None
    assert (w2.error.code, w2.error.message) == ("RUNNER_FAILED", "w2 broke")
    assert "1 of 2 worker(s) did not succeed: 1 failed" in s.message


def test_rejected_is_a_failure() -> None:
    s = status(
        command(),
        *alive("w1", "w2", sent=30),
        ack("w1", X, 3, code="PATH_NOT_ALLOWED"),
        ack("w2", X, 4),
        now=31,
    )
    assert s.phase is RolloutPhase.FAILED and s.reason is RolloutReason.WORKERS_FAILED
    assert s.counts == StateCounts(rejected=2) and s.finished_at == at(4)


def test_not_failed_while_another_worker_is_still_working() -> None:
    s = status(command(), *alive("w1", "w2", sent=30), ack("w1", F, 3), ack("w2", R, 4), now=31)
    assert s.phase is RolloutPhase.PROGRESSING
    assert s.counts == StateCounts(failed=1, running=1)


def test_timed_out_when_the_command_expires_unfinished() -> None:
    events = [
        command(expires=100),
        *alive("w1", "w2", sent=199),
        *full("w1", 1, 10),
        ack("w2", R, 20),
        heartbeat("w2", 199, flight=("c1", 20)),
    ]
    assert status(*events, now=99).phase is RolloutPhase.PROGRESSING
    s = status(*events, now=100)
    assert s.phase is RolloutPhase.TIMED_OUT and s.reason is RolloutReason.EXPIRED
    assert s.exit_code == 2 and s.finished_at == at(100) and s.duration_s == 100.0
    assert states(s) == {"w1": WorkerState.SUCCEEDED, "w2": WorkerState.RUNNING}
    assert "1 of 2 worker(s) unfinished" in s.message


def test_a_terminal_ack_sent_after_expiry_is_late_and_changes_nothing() -> None:
    events = [
        command(expires=100),
        *alive("w1", "w2", sent=199),
        *full("w1", 1, 10),
        *full("w2", 20, 150),
    ]
    s = status(*events, now=200)
    assert s.phase is RolloutPhase.TIMED_OUT and s.finished_at == at(100)
    w2 = s.worker("w2")
    assert w2 is not None
    assert w2.state is WorkerState.RUNNING and w2.late_state is WorkerState.SUCCEEDED
    assert s.counts == StateCounts(succeeded=1, running=1)


def test_an_ack_sent_before_expiry_counts_whenever_it_arrives() -> None:
    """Timestamps decide, not arrival: a lagging coordinator reaches the same verdict."""
    f = fleet(command(expires=100), *alive("w1", "w2", sent=199), *full("w1", 1, 10))
    f.observe_ack(ack("w2", A, 50))
    assert f.status("r1", at(200)).phase is RolloutPhase.TIMED_OUT
    f.observe_ack(ack("w2", S, 90))  # sent before expiry, delivered late
    s = f.status("r1", at(200))
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(90)


def test_progress_deadline_when_nobody_acks() -> None:
    events = [command(), *alive("w1", "w2", sent=200)]
    assert status(*events, now=60, deadline=60).phase is RolloutPhase.PENDING
    s = status(*events, now=61, deadline=60)
    assert s.phase is RolloutPhase.TIMED_OUT
    assert s.reason is RolloutReason.PROGRESS_DEADLINE_EXCEEDED
    assert s.finished_at == at(60) and s.exit_code == 2
    assert "no progress for 60s" in s.message


def test_progress_deadline_counts_from_the_last_progress() -> None:
    events = [command(), *alive("w1", "w2", sent=200), *full("w1", 10, 20), ack("w2", A, 10)]
    assert status(*events, now=80, deadline=60).phase is RolloutPhase.PROGRESSING
    s = status(*events, now=100, deadline=60)
    assert s.phase is RolloutPhase.TIMED_OUT and s.finished_at == at(80)
    assert states(s) == {"w1": WorkerState.SUCCEEDED, "w2": WorkerState.ACCEPTED}


def test_a_long_reload_shown_in_flight_by_heartbeats_is_progress() -> None:
    events: list[Event] = [
        command(),
        heartbeat("w1", 299, version="v2"),
        *full("w1", 1, 20),
        ack("w2", A, 10),
        ack("w2", R, 11),
        heartbeat("w2", 290, flight=("c1", 11)),
    ]
    s = status(*events, now=300, deadline=60)
    assert s.phase is RolloutPhase.PROGRESSING
    # Once done, heartbeats no longer show it in flight, and the terminal ack's own timings
    # cover the work: no deadline is found in the past.
    events += [ack("w2", S, 400, started=11), heartbeat("w2", 401, version="v2")]
    s = status(*events, now=402, deadline=60)
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(400)


def test_progress_deadline_is_a_constructor_setting() -> None:
    assert Fleet().progress_deadline_s == DEFAULT_PROGRESS_DEADLINE_S == 600.0
    assert Fleet(progress_deadline_s=30).progress_deadline_s == 30.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="progress_deadline_s"):
            Fleet(progress_deadline_s=bad)


def test_abort() -> None:
    events: list[Event] = [
        command(),
        *alive("w1", "w2", sent=99),
        ack("w1", R, 10),
        abort_event("bad canary", 50),
    ]
    s = status(*events, now=100)
    assert s.phase is RolloutPhase.ABORTED and s.reason is RolloutReason.ABORTED
    assert s.exit_code == 1 and s.finished_at == at(50)
    assert s.message == "aborted: bad canary"
    assert status(*events, now=40).phase is RolloutPhase.PROGRESSING  # not yet
    # The earliest abort counts, whatever order they come in.
    later = status(*events, abort_event("second", 70), now=100)
    earlier = status(abort_event("first", 30), *events, now=100)
    assert later.finished_at == at(50) and earlier.message == "aborted: first"


def test_abort_after_the_end_changes_nothing() -> None:
    s = status(
        command(),
        *alive("w1", "w2", sent=99),
        *full("w1", 1, 10),
        *full("w2", 1, 20),
        abort_event("too late", 50),
        now=100,
    )
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(20)


# --------------------------------------------------------------------------- per-worker states


@pytest.mark.parametrize(
    ("acks", "want"),
    [
        ([R, A], WorkerState.RUNNING),
        ([S, R, A], WorkerState.SUCCEEDED),
        ([S], WorkerState.SUCCEEDED),
        ([A, F, R], WorkerState.FAILED),
        ([X, A], WorkerState.REJECTED),
    ],
)
def test_state_only_moves_forward_whatever_the_arrival_order(
    acks: list[AckState], want: WorkerState
) -> None:
    sent = {A: 1.0, R: 2.0, S: 3.0, F: 3.0, X: 3.0}
    events = [command(workers=["w1"]), heartbeat("w1", 9), *(ack("w1", a, sent[a]) for a in acks)]
    s = status(*events, now=10)
    assert states(s) == {"w1": want}
    worker = s.worker("w1")
    assert worker is not None and worker.acks == len(acks)


def test_duplicate_terminal_acks_are_idempotent() -> None:
    """A worker that crashed after publishing its ack redelivers it, maybe as attempt 2."""
    events = [
        command(workers=["w1"]),
        heartbeat("w1", 99),
        *full("w1", 1, 10),
        ack("w1", S, 10),
        ack("w1", S, 40, attempt=2),
    ]
    s = status(*events, now=100)
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(10)
    w1 = s.worker("w1")
    assert w1 is not None and (w1.attempt, w1.acks, w1.finished_at) == (1, 5, at(10))
    assert s.anomalies == ()


def test_a_later_conflicting_terminal_ack_is_an_anomaly_and_the_first_wins() -> None:
    base = [command(workers=["w1"]), heartbeat("w1", 99)]
    first, second = ack("w1", S, 10), ack("w1", F, 30, code="INTERNAL")
    for order in ([first, second], [second, first]):
        s = status(*base, *order, now=100)
        assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(10)
        (anomaly,) = s.anomalies
        assert anomaly.code is AnomalyCode.CONFLICTING_TERMINAL_ACKS
        assert anomaly.worker_id == "w1" and anomaly.command_id == "c1"
        assert "kept succeeded" in anomaly.message and "ignored failed" in anomaly.message
    # Failure first: the later success does not flip it.
    s = status(*base, ack("w1", S, 30), ack("w1", F, 10), now=100)
    assert s.phase is RolloutPhase.FAILED and s.finished_at == at(10)


def test_version_mismatch_is_an_anomaly() -> None:
    s = status(command(workers=["w1"]), heartbeat("w1", 9), ack("w1", S, 5, version="v9"), now=10)
    assert s.phase is RolloutPhase.SUCCEEDED
    (anomaly,) = s.anomalies
    assert anomaly.code is AnomalyCode.VERSION_MISMATCH and "'v9'" in anomaly.message


def test_acks_from_workers_outside_the_expected_set_count_nowhere() -> None:
    s = status(
        command(), *alive("w1", "w2", "w9", sent=30), *full("w1", 1, 10), *full("w9", 1, 10), now=31
    )
    assert s.phase is RolloutPhase.PROGRESSING and s.expected == 2
    assert s.counts == StateCounts(succeeded=1, pending=1)
    assert [(d.worker_id, d.state, d.acks) for d in s.unexpected] == [
        ("w9", WorkerState.SUCCEEDED, 3)
    ]


# --------------------------------------------------------------------------- lost workers


def test_a_worker_that_dies_mid_rollout_is_lost_but_waited_for_until_the_deadline() -> None:
    events = [
        command(),
        heartbeat("w1", 99),
        *full("w1", 1, 10),
        ack("w2", A, 5),
        ack("w2", R, 6),
        heartbeat("w2", 20, flight=("c1", 6)),  # its last: alive until 35
    ]
    s = status(*events, now=35)
    assert s.phase is RolloutPhase.PROGRESSING and states(s)["w2"] is WorkerState.RUNNING
    s = status(*events, now=36)
    lost = at(35) + TICK  # the first instant it is no longer alive
    assert s.phase is RolloutPhase.PROGRESSING and s.exit_code is None
    w2 = s.worker("w2")
    assert w2 is not None and (w2.state, w2.lost_at) == (WorkerState.LOST, lost)
    assert s.counts == StateCounts(succeeded=1, lost=1) and "1 lost" in s.message
    # Lost becomes final at the progress deadline (its last progress: in flight until 20).
    s = status(*events, now=20 + 600 + 1)
    assert s.phase is RolloutPhase.TIMED_OUT
    assert s.reason is RolloutReason.PROGRESS_DEADLINE_EXCEEDED and s.exit_code == 2
    assert s.finished_at == at(620) and states(s)["w2"] is WorkerState.LOST
    # Its success, sent after the end, does not revive the verdict.
    s = status(*events, ack("w2", S, 700), now=800)
    assert (s.phase, s.finished_at) == (RolloutPhase.TIMED_OUT, at(620))
    assert (
        states(s)["w2"] is WorkerState.LOST and s.worker("w2").late_state is WorkerState.SUCCEEDED
    )  # type: ignore[union-attr]
    # Sent before the deadline (a worker that was only cut off), it counts.
    s = status(*events, ack("w2", S, 300, started=6), now=800)
    assert (s.phase, s.finished_at) == (RolloutPhase.SUCCEEDED, at(300))


def test_a_lost_workers_late_report_does_not_fill_a_progress_gap() -> None:
    events = [
        command(),
        ack("w1", R, 1),
        heartbeat("w1", 20, flight=("c1", 1)),  # its last: lost at 35
        heartbeat("w2", 499),  # alive, never acks
    ]
    before = status(*events, now=500, deadline=120)
    after = status(*events, ack("w1", S, 300, started=1), now=500, deadline=120)
    assert before.reason is RolloutReason.PROGRESS_DEADLINE_EXCEEDED
    assert before.finished_at == after.finished_at == at(140)
    assert states(after) == {"w1": WorkerState.LOST, "w2": WorkerState.PENDING}


def test_a_lost_worker_does_not_end_the_rollout_while_others_work() -> None:
    events = [command(), heartbeat("w1", 99), ack("w1", R, 5), heartbeat("w2", 0)]
    s = status(*events, now=100)
    assert s.phase is RolloutPhase.PROGRESSING
    assert states(s) == {"w1": WorkerState.RUNNING, "w2": WorkerState.LOST}
    s = status(*events, ack("w1", S, 80), now=100)
    assert s.phase is RolloutPhase.PROGRESSING and s.counts == StateCounts(succeeded=1, lost=1)
    s = status(*events, ack("w1", S, 80), now=681)
    assert s.phase is RolloutPhase.TIMED_OUT and s.finished_at == at(680)


def test_a_failure_and_a_lost_worker_fail_at_the_deadline() -> None:
    events = [command(), heartbeat("w1", 99), *full("w1", 1, 10, F), heartbeat("w2", 0)]
    assert status(*events, now=100).phase is RolloutPhase.PROGRESSING
    s = status(*events, now=611)
    assert (s.phase, s.reason, s.finished_at) == (
        RolloutPhase.FAILED,
        RolloutReason.WORKERS_FAILED,
        at(610),
    )
    assert states(s) == {"w1": WorkerState.FAILED, "w2": WorkerState.LOST}


def test_a_stopped_worker_is_lost_at_once_but_not_final() -> None:
    events = [
        command(),
        heartbeat("w1", 99),
        *full("w1", 1, 10),
        heartbeat("w2", 12, status=WorkerStatus.STOPPED),
    ]
    s = status(*events, now=13)
    assert s.phase is RolloutPhase.PROGRESSING and states(s)["w2"] is WorkerState.LOST
    w2 = s.worker("w2")
    assert w2 is not None and w2.lost_at == at(12)


def test_a_restarted_worker_is_not_lost_and_may_finish() -> None:
    events: list[Event] = [
        command(),
        heartbeat("w1", 99),
        *full("w1", 1, 10),
        ack("w2", R, 5),
        heartbeat("w2", 30, started=28, seq=0),  # a new incarnation, alive
    ]
    s = status(*events, now=40)
    assert s.phase is RolloutPhase.PROGRESSING and states(s)["w2"] is WorkerState.RUNNING
    # The command is redelivered to it and applied again.
    events += [*full("w2", 31, 45, attempt=2), heartbeat("w2", 46, started=28, seq=3)]
    s = status(*events, now=50)
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(45)
    w2 = s.worker("w2")
    assert w2 is not None and (w2.attempt, w2.acks) == (2, 4)


def _trial(restart_at: float) -> list[Event]:
    """The trial: w2 SIGKILLed mid-reload at ~5 s, restarted ``restart_at - 5`` s later, then
    it re-applies the redelivered command and succeeds; w1 succeeded at once."""
    hb_every = 1.0
    events: list[Event] = [command(), *full("w1", 1, 3)]
    events += [heartbeat("w1", t, interval=hb_every) for t in range(0, 200)]
    events += [ack("w2", A, 1), ack("w2", R, 2)]
    events += [heartbeat("w2", t, interval=hb_every, flight=("c1", 2)) for t in (0, 1, 2, 3, 4, 5)]
    r = restart_at
    events += [
        heartbeat("w2", r + t, started=r, seq=t, interval=hb_every) for t in range(0, 200 - int(r))
    ]
    events += [ack("w2", A, r + 2, attempt=2), ack("w2", R, r + 3, attempt=2)]
    events += [ack("w2", S, r + 10, started=r + 3, attempt=2)]
    return sorted(events, key=_time)


@pytest.mark.parametrize("restart_at", [25.0, 60.0, 500.0])
def test_the_trials_kill_and_restart_never_flips_the_verdict(restart_at: float) -> None:
    """Fed as it happened and asked at every instant: no terminal verdict before the restarted
    worker's success, and that one (the only one) never changes; a replay of the log agrees."""
    events = _trial(restart_at)
    live = Fleet()
    verdicts: set[tuple[RolloutPhase, RolloutReason | None, datetime | None]] = set()
    for i, event in enumerate(events):
        feed(live, [event])
        instant = _time(event)[0]
        if i + 1 < len(events) and _time(events[i + 1])[0] == instant:
            continue
        for now in (instant, instant + timedelta(seconds=0.5)):
            s = live.status("r1", now)
            if s.terminal:
                verdicts.add((s.phase, s.reason, s.finished_at))
            else:
                assert not verdicts, f"{s.phase} at {now} after a verdict"
    done = at(restart_at + 10)
    assert verdicts == {(RolloutPhase.SUCCEEDED, None, done)}
    for order in (events, list(reversed(events)), _compacted(events)):
        s = fleet(*order).status("r1", at(1000))
        assert (s.phase, s.finished_at) == (RolloutPhase.SUCCEEDED, done)


def test_the_trial_without_a_restart_ends_at_the_deadline_and_stays_ended() -> None:
    events = [e for e in _trial(25.0) if not (isinstance(e, Heartbeat) and e.sent_at >= at(25))]
    events = [e for e in events if not (isinstance(e, Ack) and e.attempt == 2)]
    deadline = 60.0
    # Its last progress: in flight on its heartbeat at 5.
    assert fleet(*events, deadline=deadline).status("r1", at(65)).phase is RolloutPhase.PROGRESSING
    s = fleet(*events, deadline=deadline).status("r1", at(66))
    assert (s.phase, s.finished_at) == (RolloutPhase.TIMED_OUT, at(65))
    # The worker is restarted after the verdict and applies the command: the verdict stands.
    later = [
        *events,
        *(heartbeat("w2", 100 + t, started=100, seq=t, interval=1.0) for t in range(5)),
        *full("w2", 101, 104, attempt=2),
    ]
    s = fleet(*later, deadline=deadline).status("r1", at(200))
    assert (s.phase, s.finished_at) == (RolloutPhase.TIMED_OUT, at(65))
    assert s.worker("w2").late_state is WorkerState.SUCCEEDED  # type: ignore[union-attr]


def test_an_expected_worker_never_seen_is_lost_from_the_start() -> None:
    s = status(command(), heartbeat("w1", 99), *full("w1", 1, 10), now=11)
    assert s.phase is RolloutPhase.PROGRESSING
    assert states(s)["w2"] is WorkerState.LOST


def test_an_expected_worker_that_acks_without_heartbeats_is_waited_for() -> None:
    s = status(command(), heartbeat("w1", 99), *full("w1", 1, 10), ack("w2", R, 5), now=11)
    assert s.phase is RolloutPhase.PROGRESSING


# --------------------------------------------------------------------------- expected set


@pytest.mark.parametrize(
    "cmd",
    [
        command(workers=None, labels={"model": "gpt"}),
        command(workers=[]),
    ],
    ids=["labels-match-nobody", "empty-id-list"],
)
def test_an_empty_match_is_a_failure(cmd: Command) -> None:
    s = status(cmd, *alive("w1", "w2", sent=0), now=1)
    assert s.phase is RolloutPhase.FAILED and s.reason is RolloutReason.NO_MATCHING_WORKERS
    assert s.exit_code == 1 and s.expected == 0 and s.finished_at == at(0)
    assert s.workers == ()


def test_label_only_command_expects_matching_workers_alive_at_issue() -> None:
    """A kcat-written command: the heartbeat rule decides, on replay as live."""
    cmd = command(workers=None, labels={"model": "llama"}, issued=100, expires=3600)
    events: list[Event] = [
        cmd,
        heartbeat("a", 490, started=0),  # alive at issue (compacted: only a later one survives)
        heartbeat("b", 490, started=150),  # started after the command
        heartbeat("c", 490, started=0, labels={"model": "mistral"}),  # does not match
        heartbeat("d", 50, started=0),  # silent since before the command
        heartbeat("e", 90, started=0, status=WorkerStatus.STOPPED),  # stopped before
    ]
    s = status(*events, now=491)
    assert [d.worker_id for d in s.workers] == ["a"] and s.phase is RolloutPhase.PENDING
    # A matching worker that acks joins; a non-matching one is unexpected.
    events += [*full("b", 200, 210), *full("c", 200, 210)]
    s = status(*events, now=491)
    assert [d.worker_id for d in s.workers] == ["a", "b"]
    assert [d.worker_id for d in s.unexpected] == ["c"]
    assert s.phase is RolloutPhase.PROGRESSING
    events += full("a", 300, 320)
    s = status(*events, now=491)
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(320)
    # One that first acks after the end is listed, and the verdict stands.
    events += [heartbeat("f", 490, started=350), *full("f", 400, 410)]
    s = status(*events, now=491)
    assert s.phase is RolloutPhase.SUCCEEDED and s.expected == 2
    assert [d.worker_id for d in s.unexpected] == ["c", "f"]


def test_label_only_worker_without_heartbeat_that_acks_is_trusted() -> None:
    cmd = command(workers=None, labels={"model": "llama"})
    s = status(cmd, heartbeat("a", 50), *full("a", 1, 10), *full("z", 2, 12), now=51)
    assert [d.worker_id for d in s.workers] == ["a", "z"]
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(12)


def test_label_only_with_nobody_alive_fails_even_if_someone_acks_later() -> None:
    cmd = command(workers=None, labels={"model": "llama"}, issued=100)
    s = status(cmd, heartbeat("a", 1000, started=150), *full("a", 200, 210), now=1001)
    assert s.reason is RolloutReason.NO_MATCHING_WORKERS
    assert [d.worker_id for d in s.unexpected] == ["a"]


# --------------------------------------------------------------------------- commands and orphans


def test_acks_before_their_command_are_kept_then_folded_in() -> None:
    acks = [*full("w1", 1, 10), *full("w2", 2, 20)]
    f = fleet(*alive("w1", "w2", sent=30), *acks)
    assert "r1" not in f and f.rollouts(at(31)) == []
    with pytest.raises(KeyError):
        f.status("r1", at(31))
    (orphan,) = f.orphans()
    assert (orphan.rollout_id, orphan.command_id, orphan.workers, orphan.acks) == ("r1", "c1", 2, 6)
    assert (orphan.first_sent_at, orphan.last_sent_at) == (at(1), at(20))
    assert f.stats().orphan_acks == 6
    f.observe_command(command())
    assert f.orphans() == [] and f.stats().orphan_acks == 0
    assert f.status("r1", at(31)) == status(command(), *alive("w1", "w2", sent=30), *acks, now=31)


def test_acks_for_unknown_commands_never_crash() -> None:
    f = fleet(
        command(),
        heartbeat("w1", 0),
        ack("w1", S, 1, rollout_id="r9", command_id="c9"),
        ack("w1", F, 2, command_id="c-other"),
    )
    assert [(o.rollout_id, o.command_id) for o in f.orphans()] == [("r1", "c-other"), ("r9", "c9")]
    assert f.status("r1", at(3)).phase is RolloutPhase.PENDING
    assert f.rollout_ids() == ["r1"]


def test_a_second_command_for_a_rollout_is_an_anomaly_and_ignored() -> None:
    first = command(command_id="c1", issued=0, version="v2")
    second = command(command_id="c2", issued=5, version="v3")
    acks = [*full("w1", 6, 10), ack("w1", S, 11, command_id="c2", version="v3")]
    for order in ([first, second], [second, first]):
        s = status(*order, *alive("w1", "w2", sent=30), *acks, now=31)
        assert (s.command_id, s.target_version) == ("c1", "v2")
        (anomaly,) = s.anomalies
        assert anomaly.code is AnomalyCode.DUPLICATE_ROLLOUT_COMMAND
        assert anomaly.command_id == "c2" and "1 ack(s) for it ignored" in anomaly.message
    f = fleet(second, first)
    assert f.command("r1") == first and f.orphans() == []


def test_a_redelivered_command_is_no_anomaly_but_a_reused_id_is() -> None:
    s = status(command(), command(), *alive("w1", "w2", sent=0), now=1)
    assert s.anomalies == ()
    assert fleet(command(), command()).stats().commands == 2
    s = status(command(), command(version="v9"), *alive("w1", "w2", sent=0), now=1)
    assert [a.code for a in s.anomalies] == [AnomalyCode.COMMAND_ID_REUSED]


def test_update_config_status_shows_the_overrides() -> None:
    s = status(command(overrides={"max_num_seqs": 64}), *alive("w1", "w2", sent=0), now=1)
    assert s.kind is CommandKind.UPDATE_CONFIG
    assert (s.target_version, s.overrides) == (None, {"max_num_seqs": 64})


def test_rollouts_are_listed_oldest_first() -> None:
    f = fleet(
        command("r2", "c2", issued=10),
        command("r1", "c1", issued=0),
        command("r3", "c3", issued=5),
        *alive("w1", "w2", sent=0),
    )
    assert [s.rollout_id for s in f.rollouts(at(1))] == ["r1", "r3", "r2"]
    assert f.rollout_ids() == ["r1", "r2", "r3"]
    assert "r2" in f and "r4" not in f
    assert f.stats().rollouts == 3 and f.stats().heartbeats == 2


def test_status_serializes_with_its_exit_code_and_is_frozen() -> None:
    s = status(command(), *alive("w1", "w2", sent=30), *full("w1", 1, 10), ack("w2", F, 20), now=31)
    data = s.model_dump(mode="json")
    assert data["exit_code"] == 1 and data["phase"] == "failed"
    assert data["workers"][1]["error"]["code"] == "RUNNER_FAILED"
    assert RolloutStatus.model_validate_json(s.model_dump_json()) == s
    with pytest.raises(ValidationError):
        s.phase = RolloutPhase.SUCCEEDED  # type: ignore[misc]


@pytest.mark.parametrize(
    ("phase", "code"),
    [
        (RolloutPhase.PENDING, None),
        (RolloutPhase.PROGRESSING, None),
        (RolloutPhase.SUCCEEDED, 0),
        (RolloutPhase.FAILED, 1),
        (RolloutPhase.ABORTED, 1),
        (RolloutPhase.TIMED_OUT, 2),
    ],
)
def test_exit_codes(phase: RolloutPhase, code: int | None) -> None:
    assert phase.exit_code == code and phase.terminal is (code is not None)


# --------------------------------------------------------------------------- worker levels


def test_worker_levels_compare_desired_and_reported_versions() -> None:
    f = fleet(
        command("r1", "c1", workers=["w1", "w2"], issued=0, version="v2"),
        *full("w1", 1, 10),
        *full("w2", 1, 10),
        command("r2", "c2", workers=["w1", "w2"], issued=20, version="v3"),
        ack("w1", F, 25, command_id="c2", rollout_id="r2"),
        ack("w2", F, 25, command_id="c2", rollout_id="r2"),
        command("r3", "c3", workers=["w3"], issued=30, version="v4"),
        command("r4", "c4", workers=["w1"], issued=40, overrides={"k": 1}),
        heartbeat("w1", 50, version="v2"),
        heartbeat("w2", 50, version="v1"),
        heartbeat("w3", 50, version="v1"),
        heartbeat("w4", 50, version="v1", degraded=True),
    )
    levels = {lv.worker_id: lv for lv in f.worker_levels(at(51))}
    assert list(levels) == ["w1", "w2", "w3", "w4"]
    # r2 failed, so it desires nothing: r1's v2 stands; update_config rollouts do not count.
    assert (levels["w1"].desired_version, levels["w1"].in_sync) == ("v2", True)
    assert (levels["w2"].desired_version, levels["w2"].in_sync) == ("v2", False)
    # r3 is in progress: w3 is converging.
    assert (levels["w3"].desired_rollout_id, levels["w3"].in_sync) == ("r3", False)
    # Nothing desired, but degraded (a mix of two versions): not in sync.
    assert levels["w4"].desired_version is None and levels["w4"].in_sync is False
    assert levels["w4"].degraded is True and levels["w1"].alive is True


def test_worker_levels_list_expected_workers_without_heartbeats() -> None:
    f = fleet(command(workers=["ghost"]), ack("ghost", R, 1))
    (level,) = f.worker_levels(at(2))
    assert (level.worker_id, level.alive, level.reported_version) == ("ghost", False, None)
    assert (level.desired_version, level.in_sync) == ("v2", False)


# --------------------------------------------------------------------------- determinism

HB_EVERY = 20.0  # heartbeat period in generated scenarios: alive for 60 s after each
HORIZON = 600
DEADLINE = 120.0  # above 3 heartbeat periods, as in production (600 s against 15 s)


def _time(event: Event) -> tuple[datetime, int]:
    if isinstance(event, Command):
        return event.issued_at, 0
    if isinstance(event, Ack | Heartbeat):
        return event.sent_at, 1
    return event[2], 1


@st.composite
def scenarios(draw: st.DrawFn) -> list[Event]:
    """A rollout as a fleet lives it: heartbeats every period until a worker dies, acks in any
    state order (duplicates and conflicts included), heartbeats showing the command in flight
    while it runs, maybe a stranger's acks and an abort."""
    n = draw(st.integers(1, 4))
    label_only = draw(st.booleans())
    ids = [f"w{i}" for i in range(n)]
    events: list[Event] = [
        command(
            workers=None if label_only else ids,
            labels={"model": "llama"} if label_only else None,
            expires=draw(st.sampled_from([150.0, 3600.0])),
        )
    ]
    for w in ids:
        started = draw(st.sampled_from([-100.0, 30.0])) if label_only else -100.0
        labels = {"model": draw(st.sampled_from(["llama", "llama", "other"]))}
        death = draw(st.one_of(st.none(), st.integers(0, 400)))
        # An incarnation sends nothing after it died (a SIGKILLed process stamps no more acks).
        first, last = (int(started) + 1 if started > 0 else 0), 450 if death is None else death
        kinds = draw(st.lists(st.sampled_from([A, R, S, F, X]), max_size=4 if first <= last else 0))
        times = draw(
            st.lists(
                st.integers(first, max(first, last)),
                min_size=len(kinds),
                max_size=len(kinds),
            ).map(sorted)
        )
        running = next((t for k, t in zip(kinds, times, strict=True) if k is R), None)
        finish = min((t for k, t in zip(kinds, times, strict=True) if k.terminal), default=None)
        acks = [
            ack(
                w,
                k,
                t,
                started=running if k.terminal and running is not None and running <= t else None,
            )
            for k, t in zip(kinds, times, strict=True)
        ]
        if acks and draw(st.booleans()):
            acks.append(draw(st.sampled_from(acks)))  # a redelivery
        events += acks
        t = started
        while t <= HORIZON and (death is None or t <= death):
            working = running is not None and running <= t and (finish is None or t < finish)
            events.append(
                heartbeat(
                    w,
                    t,
                    started=started,
                    labels=labels,
                    interval=HB_EVERY,
                    flight=("c1", running) if working and running is not None else None,
                )
            )
            t += HB_EVERY
        if death is not None and draw(st.booleans()):
            # Restarted (a new incarnation), maybe long after; it re-applies the command.
            restart = draw(st.integers(death + 1, HORIZON))
            again = draw(st.lists(st.sampled_from([A, R, S, F]), max_size=3))
            moments = sorted(
                draw(
                    st.lists(
                        st.integers(restart, HORIZON), min_size=len(again), max_size=len(again)
                    )
                )
            )
            events += [ack(w, k, m, attempt=2) for k, m in zip(again, moments, strict=True)]
            t = float(restart)
            while t <= HORIZON:
                events.append(heartbeat(w, t, started=restart, labels=labels, interval=HB_EVERY))
                t += HB_EVERY
    if draw(st.booleans()):
        events += full("x9", 5, 50)
    if draw(st.booleans()):
        events.append(abort_event("operator", draw(st.integers(0, 500))))
    return sorted(events, key=_time)


def _compacted(events: list[Event]) -> list[Event]:
    """What a restarted coordinator reads: only each worker's latest heartbeat survives."""
    latest: dict[str, Heartbeat] = {}
    for e in events:
        if isinstance(e, Heartbeat):
            held = latest.get(e.worker_id)
            if held is None or (e.started_at, e.seq) > (held.started_at, held.seq):
                latest[e.worker_id] = e
    return [e for e in events if not isinstance(e, Heartbeat)] + list(latest.values())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, HORIZON + 100), st.randoms(use_true_random=False))
def test_the_same_events_in_any_order_give_the_same_status(
    events: list[Event], now: int, rnd: random.Random
) -> None:
    shuffled = list(events)
    rnd.shuffle(shuffled)
    a = fleet(*events, deadline=DEADLINE).status("r1", at(now))
    b = fleet(*shuffled, deadline=DEADLINE).status("r1", at(now))
    assert a == b


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_live_feed_never_reopens_an_ended_rollout_and_a_restart_agrees(
    events: list[Event], rnd: random.Random
) -> None:
    """Fed as it happens (asked for status at every instant), a rollout that ended stays ended,
    with the same verdict; a fresh Fleet fed the compacted log, in any order, says the same.

    Events sent in the same microsecond have no order but the documented tie-breaks, so status
    is asked once all of an instant's events are in."""
    live = Fleet(progress_deadline_s=DEADLINE)
    ended: RolloutStatus | None = None
    for i, event in enumerate(events):
        feed(live, [event])
        instant = _time(event)[0]
        if "r1" not in live or (i + 1 < len(events) and _time(events[i + 1])[0] == instant):
            continue
        s = live.status("r1", instant)
        if ended is not None:
            assert _verdict(s) == _verdict(ended)
        elif s.terminal:
            ended = s
    end = at(HORIZON + 100)
    # A reader started later: one that reads the compacted log (only each worker's latest
    # heartbeat) says exactly the same when no worker restarted; with restarts (whose old
    # incarnation's in-flight heartbeats compaction may drop), one that reads it uncompacted.
    incarnations = {(e.worker_id, e.started_at) for e in events if isinstance(e, Heartbeat)}
    restarts = len(incarnations) > len({w for w, _ in incarnations})
    restarted = list(events) if restarts else _compacted(events)
    rnd.shuffle(restarted)
    assert fleet(*restarted, deadline=DEADLINE).status("r1", end) == live.status("r1", end)


def _verdict(s: RolloutStatus) -> tuple[Any, ...]:
    """What never changes once a rollout ended: the phase, why, when, and what workers reported
    by then (whether an unfinished worker counts as lost or pending is knowledge, not verdict)."""
    c = s.counts
    return (s.phase, s.reason, s.finished_at, s.expected, c.succeeded, c.failed, c.rejected)


# --------------------------------------------------------------------------- unreadable and expired commands


def nack(worker_id: str, sent: float, code: str, **kw: Any) -> Ack:
    """A worker's NACK of a record it could not read: no kind."""
    return ack(worker_id, X, sent, code=code, **kw).model_copy(update={"kind": None})


def test_a_rollout_known_only_from_nacks_of_an_unreadable_command_is_rejected() -> None:
    f = fleet(
        nack("w1", 2, "SCHEMA_INVALID"),
        nack("w2", 1, "UNSUPPORTED_SCHEMA_VERSION"),
        nack("w2", 3, "SCHEMA_INVALID"),  # redelivered, garbled differently: the first counts
        nack("w3", 4, "SCHEMA_INVALID", command_id="c9"),
    )
    assert "r1" in f and f.rollout_ids() == ["r1"]
    s = f.status("r1", at(10))
    assert (s.phase, s.reason, s.exit_code) == (
        RolloutPhase.FAILED,
        RolloutReason.COMMAND_REJECTED,
        1,
    )
    assert s.kind is None and s.expires_at is None and s.issuer is None
    assert (s.issued_at, s.finished_at, s.expected) == (at(1), at(1), 3)
    assert s.counts == StateCounts(rejected=3)
    assert {d.worker_id: d.error.code for d in s.workers if d.error} == {
        "w1": "SCHEMA_INVALID",
        "w2": "UNSUPPORTED_SCHEMA_VERSION",
        "w3": "SCHEMA_INVALID",
    }
    assert "SCHEMA_INVALID x2" in s.message
    assert [r.rollout_id for r in f.rollouts(at(10))] == ["r1"]
    assert RolloutStatus.model_validate_json(s.model_dump_json()) == s
    assert f.orphans() == []


def test_unreadable_nacks_never_count_as_a_workers_state_when_the_command_is_readable() -> None:
    """Garbage (or forged) records carrying a real command's ids: their NACKs are anomalies."""
    events: list[Event] = [command(), *alive("w1", "w2", sent=50)]
    events += [nack("w1", 1, "MALFORMED_JSON"), nack("w2", 1, "SCHEMA_INVALID")]
    s = status(*events, now=51)
    assert s.phase is RolloutPhase.PENDING and s.counts == StateCounts(pending=2)
    codes = [(a.code, a.worker_id) for a in s.anomalies]
    assert codes == [
        (AnomalyCode.UNREADABLE_COMMAND_NACK, "w1"),
        (AnomalyCode.UNREADABLE_COMMAND_NACK, "w2"),
    ]
    s = status(*events, *full("w1", 2, 5), *full("w2", 2, 6), now=51)
    assert s.phase is RolloutPhase.SUCCEEDED and s.finished_at == at(6)


def test_a_command_published_after_it_expired_shows_as_expired() -> None:
    """kcat, an old command: nobody was alive at its issue; the workers NACK it EXPIRED."""
    cmd = command(workers=None, labels={"model": "llama"}, issued=0, expires=60)
    events: list[Event] = [cmd, *alive("w1", "w2", sent=1000, started=900)]
    events += [ack("w1", X, 1001, code="EXPIRED"), ack("w2", X, 1002, code="EXPIRED")]
    s = status(*events, now=1003)
    assert (s.phase, s.reason, s.exit_code) == (RolloutPhase.TIMED_OUT, RolloutReason.EXPIRED, 2)
    assert s.expected == 2 and s.counts == StateCounts(rejected=2) and s.unexpected == ()
    assert s.finished_at == at(60) and "expired" in s.message
    # Nobody alive at its issue, and nobody says it expired: no matching workers, as before.
    s = status(cmd, *alive("w1", sent=1000, started=900), *full("w1", 1001, 1002), now=1003)
    assert s.reason is RolloutReason.NO_MATCHING_WORKERS


# --------------------------------------------------------------------------- hostile numbers


@pytest.mark.parametrize("interval", [1e300, float("inf"), float("nan"), -5.0, 1e-300])
def test_a_heartbeat_with_any_decoded_numbers_never_breaks_the_fold(interval: float) -> None:
    hb = heartbeat("w1", 5, flight=("c1", 1)).model_copy(
        update={"interval_s": interval, "seq": 2**70}
    )
    far = heartbeat("w2", 5).model_copy(
        update={"sent_at": datetime.max.replace(tzinfo=UTC), "interval_s": interval}
    )
    early = heartbeat("w3", 5).model_copy(
        update={
            "sent_at": datetime.min.replace(tzinfo=UTC),
            "started_at": datetime.min.replace(tzinfo=UTC),
            "interval_s": interval,
        }
    )
    f = Fleet()
    for cmd in (command(workers=None, labels={"model": "llama"}), command("r2", "c2")):
        f.observe_command(cmd)
    for h in (hb, far, early):
        f.observe_heartbeat(h)
        f.observe_heartbeat(h.model_copy(update={"seq": 0}), received_at=at(6))
    f.observe_ack(ack("w1", R, 2))
    for now in (at(6), at(10**6), datetime.max.replace(tzinfo=UTC)):
        f.rollouts(now)
        f.worker_levels(now)
        f.registry.workers(now)


# --------------------------------------------------------------------------- memory


def test_compact_keeps_the_last_n_ended_rollouts_in_full_and_older_ones_as_a_summary() -> None:
    f = Fleet(max_ended_rollouts=2)
    f.observe_heartbeat(heartbeat("w1", 1000))
    for i in range(5):
        f.observe_command(command(f"r{i}", f"c{i}", workers=["w1"], issued=10 * i))
        f.observe_ack(ack("w1", S, 10 * i + 1, rollout_id=f"r{i}", command_id=f"c{i}"))
    f.observe_command(command("live", "cl", workers=["w1"], issued=100))
    f.observe_ack(ack("w1", R, 101, rollout_id="live", command_id="cl"))
    f.observe_ack(nack("w1", 3, "SCHEMA_INVALID", rollout_id="bad", command_id="cb"))
    now = at(200)
    before = {r.rollout_id: r for r in f.rollouts(now)}
    assert f.compact(now) == 4  # 6 ended (5 + the rejected one), 2 kept in full
    assert f.compact(now) == 0
    after = {r.rollout_id: r for r in f.rollouts(now)}
    assert after.keys() == before.keys()
    kept = {rid for rid, r in after.items() if not r.details_dropped}
    assert kept == {"r3", "r4", "live"}
    for rid, r in after.items():
        assert (r.phase, r.reason, r.finished_at, r.counts) == (
            before[rid].phase,
            before[rid].reason,
            before[rid].finished_at,
            before[rid].counts,
        )
        if r.details_dropped:
            assert r.workers == () and r.anomalies == () and r.selector.worker_ids is None
    # Later acks for a summarized rollout are dropped; the desired version it set survives.
    f.observe_ack(ack("w1", S, 150, rollout_id="r0", command_id="c0"))
    assert f.stats().dropped_acks == 1 and f.stats().compacted == 4
    assert f.status("r0", now).details_dropped
    (level,) = f.worker_levels(now)
    assert (level.desired_version, level.desired_rollout_id) == ("v2", "live")
    assert "r0" in f and f.rollout_keys()[0] == (at(0), "r0")


def test_compact_keeps_the_desired_version_of_a_summarized_rollout() -> None:
    f = Fleet(max_ended_rollouts=0)
    f.observe_heartbeat(heartbeat("w1", 1000, version="v2"))
    f.observe_command(command(workers=["w1"], version="v2"))
    f.observe_ack(ack("w1", S, 1))
    assert f.compact(at(100)) == 1
    (level,) = f.worker_levels(at(100))
    assert (level.desired_version, level.desired_rollout_id, level.in_sync) == ("v2", "r1", True)


def test_without_a_bound_compact_keeps_everything() -> None:
    f = fleet(command(), *alive("w1", "w2", sent=50), *full("w1", 1, 5), *full("w2", 1, 6))
    assert f.compact(at(100)) == 0 and not f.status("r1", at(100)).details_dropped


def test_a_worker_whose_clock_is_behind_is_not_lost_when_the_reader_got_its_heartbeats() -> None:
    """Its clock is 30 s behind the reader's (and the command's issuer's)."""
    skew = 30.0
    f = Fleet()
    f.observe_command(command(workers=["w1"]))
    for t in range(0, 100, 5):
        hb = heartbeat("w1", t - skew, started=-100 - skew, flight=("c1", 2 - skew))
        f.observe_heartbeat(hb, received_at=at(t))
    f.observe_ack(ack("w1", R, 2 - skew))
    s = f.status("r1", at(96))
    assert s.phase is RolloutPhase.PROGRESSING and states(s) == {"w1": WorkerState.RUNNING}
    (level,) = f.worker_levels(at(96))
    assert level.alive
    assert [v.worker_id for v in f.registry.matching(Selector(), at(96))] == ["w1"]
    # Judged by its own clock it would have been lost (and a publish found no worker).
    g = fleet(command(workers=["w1"]), heartbeat("w1", 95 - skew, started=-100 - skew))
    assert states(g.status("r1", at(96))) == {"w1": WorkerState.LOST}


@pytest.mark.parametrize("label_only", [False, True])
def test_the_verdict_does_not_depend_on_when_a_reader_received_the_heartbeats(
    label_only: bool,
) -> None:
    """A live reader gets heartbeats late (or replays them: no receive time at all); the
    verdict and when it came are the same for both: a function of the log alone."""
    cmd = command(
        workers=None if label_only else ["w1"], labels={"model": "llama"} if label_only else None
    )
    beats = [heartbeat("w1", t, flight=("c1", 1), interval=5) for t in range(-20, 60, 5)]
    events: list[Event] = [cmd, ack("w1", A, 0.5), ack("w1", R, 1)]
    verdicts = []
    for delay in (None, 0.0, 2.5, 12.0):
        f = fleet(*events, deadline=120)
        for hb in beats:
            f.observe_heartbeat(
                hb, None if delay is None else hb.sent_at + timedelta(seconds=delay)
            )
        s = f.status("r1", at(400))
        verdicts.append((s.phase, s.reason, s.finished_at, s.expected))
    assert verdicts == [verdicts[0]] * 4
    assert verdicts[0] == (
        RolloutPhase.TIMED_OUT,
        RolloutReason.PROGRESS_DEADLINE_EXCEEDED,
        at(55 + 120),  # in flight on its last heartbeat, at 55 by its own clock
        1,
    )
