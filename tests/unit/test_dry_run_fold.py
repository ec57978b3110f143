"""A dry run in the coordinator's fold: its success never becomes a worker's desired version (no
drift, no "converging"), in full or once summarized, and its status says it was a dry run."""

from __future__ import annotations

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.judge import DRY_RUN_PREFIX
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.protocol import AckState, Command
from tests.factories import at, command, feed, full, heartbeat

S = AckState.SUCCEEDED


def dry(rollout_id: str, command_id: str, **kw: object) -> Command:
    return command(rollout_id, command_id, **kw).model_copy(update={"dry_run": True})  # type: ignore[arg-type]


def levels(f: Fleet, now: float) -> dict[str, tuple[str | None, str | None, bool]]:
    return {
        lv.worker_id: (lv.desired_version, lv.desired_rollout_id, lv.in_sync)
        for lv in f.worker_levels(at(now))
    }


def test_a_dry_runs_success_is_never_a_desired_version() -> None:
    """r1 applied v2; the dry run r2 of v3 succeeded on both workers (which still run v2): v2
    stays desired and both are in sync. A dry run in progress desires nothing either."""
    f = feed(
        Fleet(),
        [
            command("r1", "c1", issued=0, version="v2"),
            *full("w1", 1, 10, rollout_id="r1", command_id="c1"),
            *full("w2", 1, 10, rollout_id="r1", command_id="c1"),
            dry("r2", "c2", issued=20, version="v3"),
            *full("w1", 21, 30, rollout_id="r2", command_id="c2", version="v2"),
            *full("w2", 21, 30, rollout_id="r2", command_id="c2", version="v2"),
            dry("r3", "c3", workers=["w3"], issued=40, version="v4"),
            heartbeat("w1", 50, version="v2"),
            heartbeat("w2", 50, version="v2"),
            heartbeat("w3", 50, version="v1"),
        ],
    )
    assert levels(f, 51) == {
        "w1": ("v2", "r1", True),
        "w2": ("v2", "r1", True),
        "w3": (None, None, True),
    }
    status = f.status("r2", at(51))
    assert status.phase is RolloutPhase.SUCCEEDED
    assert status.message == DRY_RUN_PREFIX + "all 2 worker(s) succeeded"
    assert status.dry_run
    assert not status.anomalies  # it acks the version in force: no VERSION_MISMATCH
    assert not f.status("r1", at(51)).message.startswith(DRY_RUN_PREFIX)
    assert not f.status("r1", at(51)).dry_run


def test_a_summarized_dry_run_desires_nothing() -> None:
    """Once an ended dry run is kept only as a summary, it still desires nothing."""
    f = feed(
        Fleet(max_ended_rollouts=1),
        [
            dry("r1", "c1", issued=0, version="v2"),
            *full("w1", 1, 10, rollout_id="r1", command_id="c1", version="v1"),
            *full("w2", 1, 10, rollout_id="r1", command_id="c1", version="v1"),
            command("r2", "c2", workers=["w9"], issued=20, overrides={"k": 1}),
            *full("w9", 21, 30, rollout_id="r2", command_id="c2"),
            heartbeat("w1", 50, version="v1"),
            heartbeat("w2", 50, version="v1"),
        ],
    )
    assert f.compact(at(100)) == 1
    assert f.status("r1", at(100)).details_dropped
    assert f.fold_state().summary_desired == {}
    assert {w: lv[0] for w, lv in levels(f, 51).items()} == {"w1": None, "w2": None}
