"""Unit tests for the rollout state machine: commands and orphan acks, exit codes, worker
levels, unreadable and expired commands, hostile numbers. Builders in tests/factories.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import (
    AnomalyCode,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
)
from controlplane.wire.protocol import (
    CommandKind,
)
from tests.factories import (
    Event,
    F,
    R,
    S,
    X,
    ack,
    alive,
    at,
    command,
    fleet,
    full,
    heartbeat,
    nack,
    status,
)

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


# --------------------------------------------------------------------------- unreadable and expired commands


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
