"""Unit tests for the rollout state machine: lost workers (dead, stopped, restarted, never seen)
and whose clock judges them. Builders in tests/factories.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import (
    RolloutPhase,
    RolloutReason,
    StateCounts,
    WorkerState,
)
from controlplane.wire.protocol import (
    Ack,
    Heartbeat,
    Selector,
    WorkerStatus,
)
from tests.factories import (
    TICK,
    A,
    Event,
    F,
    R,
    S,
    ack,
    at,
    command,
    compacted_log,
    event_time,
    feed,
    fleet,
    full,
    heartbeat,
    states,
    status,
)

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
    return sorted(events, key=event_time)


@pytest.mark.parametrize("restart_at", [25.0, 60.0, 500.0])
def test_the_trials_kill_and_restart_never_flips_the_verdict(restart_at: float) -> None:
    """Fed as it happened and asked at every instant: no terminal verdict before the restarted
    worker's success, and that one (the only one) never changes; a replay of the log agrees."""
    events = _trial(restart_at)
    live = Fleet()
    verdicts: set[tuple[RolloutPhase, RolloutReason | None, datetime | None]] = set()
    for i, event in enumerate(events):
        feed(live, [event])
        instant = event_time(event)[0]
        if i + 1 < len(events) and event_time(events[i + 1])[0] == instant:
            continue
        for now in (instant, instant + timedelta(seconds=0.5)):
            s = live.status("r1", now)
            if s.terminal:
                verdicts.add((s.phase, s.reason, s.finished_at))
            else:
                assert not verdicts, f"{s.phase} at {now} after a verdict"
    done = at(restart_at + 10)
    assert verdicts == {(RolloutPhase.SUCCEEDED, None, done)}
    for order in (events, list(reversed(events)), compacted_log(events)):
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


# --------------------------------------------------------------------------- clocks


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
