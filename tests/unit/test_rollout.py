"""Unit tests for the rollout state machine: phases, per-worker states and the expected set.

The other parts of the fold: test_rollout_lost (lost workers, clocks), test_rollout_commands
(commands, orphans, nacks, worker levels), test_rollout_replay (determinism, compaction).
Builders in tests/factories.py.
"""

from __future__ import annotations

import pytest

from controlplane.rollout.fleet import DEFAULT_PROGRESS_DEADLINE_S, Fleet
from controlplane.rollout.models import (
    AnomalyCode,
    RolloutPhase,
    RolloutReason,
    StateCounts,
    WorkerState,
)
from controlplane.wire.protocol import (
    AckState,
    Command,
    CommandKind,
    WorkerStatus,
)
from tests.factories import (
    A,
    Event,
    F,
    R,
    S,
    X,
    abort_event,
    ack,
    alive,
    at,
    command,
    fleet,
    full,
    heartbeat,
    states,
    status,
)

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
