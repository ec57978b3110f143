"""The fold of the controller topic (controlplane/rollout/targets.py): a target's stable state
and history, rollouts and their actions, the controller's states and the leader, folded from
records in log order. Folding a record again, or an older state after a newer one, changes
nothing. Pure: no Kafka.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controlplane.rollout.targets import ControlState, applied
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    ControlRecord,
    Desired,
    LeaderRecord,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    TargetSpec,
    WeightsRef,
)
from tests.factories import at
from tests.unit.strategies import fuzz


def weights(version: str, **config: Any) -> Desired:
    return Desired(weights=WeightsRef(path=f"/ckpt/{version}", version=version), config=config)


def config(**overrides: Any) -> Desired:
    return Desired(config=overrides)


def target(
    name: str = "llama",
    stable: Desired | None = None,
    when: float = 0.0,
    **selector: str,
) -> TargetSpec:
    return TargetSpec(
        name=name,
        selector=selector or {"model": name},
        stable=stable,
        issued_at=at(when),
        issuer="ops",
    )


def rollout(rollout_id: str, desired: Desired, target_: str = "llama", **kw: Any) -> RolloutSpec:
    return RolloutSpec(
        rollout_id=rollout_id, target=target_, desired=desired, issued_at=at(1), issuer="ops", **kw
    )


def state(
    rollout_id: str,
    revision: int,
    phase: ControlPhase = ControlPhase.PROGRESSING,
    target_: str = "llama",
    when: float | None = None,
    **kw: Any,
) -> RolloutState:
    moment = at(10 + revision if when is None else when)
    return RolloutState(
        rollout_id=rollout_id,
        target=target_,
        revision=revision,
        phase=phase,
        started_at=at(10),
        updated_at=moment,
        ended_at=moment if phase.terminal else None,
        **kw,
    )


def action(rollout_id: str, action_id: str, kind: ActionKind, **kw: Any) -> RolloutAction:
    return RolloutAction(
        rollout_id=rollout_id,
        action_id=action_id,
        action=kind,
        issued_at=at(20),
        issuer="ops",
        **kw,
    )


def fold(*records: ControlRecord) -> ControlState:
    control = ControlState()
    for record in records:
        control.observe(record)
    return control


def stable_of(control: ControlState, name: str = "llama") -> Desired | None:
    found = control.target(name)
    assert found is not None
    return found.stable


def history_of(control: ControlState, name: str = "llama") -> list[tuple[Desired, str | None]]:
    found = control.target(name)
    assert found is not None
    return [(entry.desired, entry.rollout_id) for entry in found.history]


def summary(control: ControlState) -> tuple[Any, ...]:
    """Everything a reader can ask the fold, comparable."""
    return (
        [
            (t.spec, [(h.desired, h.rollout_id, h.since) for h in t.history])
            for t in control.targets()
        ],
        [(r.spec, r.seq, r.actions, r.state) for r in control.rollouts()],
        control.leader,
    )


V1, V2, V3 = weights("v1", temperature=0.7), weights("v2"), weights("v3")
SUCCEEDED, ROLLED_BACK = ControlPhase.SUCCEEDED, ControlPhase.ROLLED_BACK


# --------------------------------------------------------------------------- stable and history


def test_a_target_s_stable_is_its_spec_s_until_a_rollout_succeeds() -> None:
    control = fold(target(stable=V1), rollout("r1", V2), state("r1", 0))
    assert stable_of(control) == V1
    control.observe(state("r1", 1, SUCCEEDED, when=50))
    # weights replaced, config kept
    assert stable_of(control) == Desired(weights=V2.weights, config={"temperature": 0.7})
    found = control.target("llama")
    assert found is not None
    assert [(h.rollout_id, h.since) for h in found.history] == [(None, at(0)), ("r1", at(50))]
    assert found.previous is not None and found.previous.desired == V1


def test_a_config_rollout_overlays_its_keys() -> None:
    control = fold(
        target(stable=V1),
        rollout("r1", config(top_k=4, temperature=0.2)),
        state("r1", 0, SUCCEEDED),
    )
    assert stable_of(control) == weights("v1", temperature=0.2, top_k=4)


def test_rollouts_that_did_not_succeed_leave_the_stable_state_alone() -> None:
    control = fold(
        target(stable=V1),
        rollout("r1", V2),
        state("r1", 0),
        state("r1", 1, ROLLED_BACK),
        rollout("r2", V3),
        state("r2", 0, ControlPhase.ABORTED),
        rollout("r3", V3),
        state("r3", 0, ControlPhase.REJECTED),
    )
    assert history_of(control) == [(V1, None)]


def test_history_is_every_stable_state_in_log_order_and_undo_s_previous() -> None:
    control = fold(
        target(stable=V1),
        rollout("r1", V2),
        rollout("r2", config(top_k=1)),
        state("r1", 0, SUCCEEDED),
        state("r2", 0, SUCCEEDED),
        rollout("r3", V3),
        state("r3", 5, SUCCEEDED),
    )
    v2 = applied(V1, V2)
    v2k = applied(v2, config(top_k=1))
    v3 = applied(v2k, V3)
    assert history_of(control) == [(V1, None), (v2, "r1"), (v2k, "r2"), (v3, "r3")]
    assert stable_of(control) == weights("v3", temperature=0.7, top_k=1)
    found = control.target("llama")
    assert found is not None and found.previous is not None
    assert (found.previous.desired, found.previous.rollout_id) == (v2k, "r2")


def test_a_target_without_a_stable_state_takes_its_first_rollout_s() -> None:
    control = fold(target(), rollout("r1", V2))
    found = control.target("llama")
    assert found is not None and found.stable is None and found.previous is None
    control.observe(state("r1", 0, SUCCEEDED))
    assert stable_of(control) == V2
    assert found.previous is None


def test_a_spec_written_again_replaces_the_selector_and_keeps_the_stable_state() -> None:
    control = fold(target(stable=V1), rollout("r1", V2), state("r1", 0, SUCCEEDED))
    control.observe(target(model="llama", zone="a", when=99))
    found = control.target("llama")
    assert found is not None
    assert found.matches({"model": "llama", "zone": "a"})
    assert not found.matches({"model": "llama"})
    assert stable_of(control) == applied(V1, V2)
    # The same stable again adds no entry; another one is applied to it (weights replaced,
    # config keys overlaid, as a rollout's change is).
    control.observe(target(stable=applied(V1, V2), when=100))
    assert len(history_of(control)) == 2
    control.observe(target(stable=V3, when=101))
    assert history_of(control)[-1] == (applied(applied(V1, V2), V3), None)


def test_a_rollout_of_an_unknown_target_changes_no_target() -> None:
    control = fold(
        target(stable=V1), rollout("r1", V2, "other"), state("r1", 0, SUCCEEDED, "other")
    )
    assert control.target("other") is None
    assert history_of(control) == [(V1, None)]
    found = control.rollout("r1")
    assert found is not None and found.ended


# --------------------------------------------------------------------------- idempotence


def test_a_state_folded_twice_changes_nothing() -> None:
    records: list[ControlRecord] = [
        target(stable=V1),
        rollout("r1", V2),
        state("r1", 0),
        state("r1", 1, SUCCEEDED),
    ]
    once = fold(*records)
    twice = fold(*records, *records[2:])
    assert summary(twice) == summary(once)
    assert len(history_of(twice)) == 2


def test_an_older_revision_after_a_newer_one_changes_nothing() -> None:
    control = fold(target(stable=V1), rollout("r1", V2), state("r1", 3, SUCCEEDED))
    before = summary(control)
    control.observe(state("r1", 2))
    control.observe(state("r1", 3, ControlPhase.ABORTED))  # same revision: already folded
    assert summary(control) == before
    found = control.rollout("r1")
    assert found is not None and found.phase is SUCCEEDED and found.ended


def test_a_state_without_its_rollout_is_ignored() -> None:
    control = fold(target(stable=V1), state("r9", 0, SUCCEEDED))
    assert control.rollout("r9") is None
    assert history_of(control) == [(V1, None)]


def test_a_rollout_spec_written_again_keeps_the_first() -> None:
    control = fold(target(stable=V1), rollout("r1", V2), rollout("r1", V3), rollout("r2", V3))
    found = control.rollout("r1")
    assert found is not None and found.spec.desired == V2 and found.seq == 0
    assert [r.rollout_id for r in control.rollouts()] == ["r1", "r2"]


_LOG: list[ControlRecord] = [
    target(stable=V1),
    target("other", stable=V3),
    rollout("r1", V2),
    action("r1", "a1", ActionKind.PAUSE),
    state("r1", 0),
    action("r1", "a2", ActionKind.RESUME),
    state("r1", 1, ControlPhase.PAUSED),
    state("r1", 2),
    LeaderRecord(member="c1", generation=1, producer_epoch=0, since=at(0)),
    state("r1", 3, SUCCEEDED),
    rollout("r2", config(top_k=2)),
    state("r2", 0),
    action("r2", "a3", ActionKind.ABORT, reason="no"),
    state("r2", 1, ControlPhase.ROLLING_BACK),
    LeaderRecord(member="c2", generation=2, producer_epoch=1, since=at(30)),
    state("r2", 2, ROLLED_BACK),
    rollout("r3", V3, "other"),
    state("r3", 0, SUCCEEDED, "other"),
]
_REPEATABLE = [i for i, r in enumerate(_LOG) if not isinstance(r, TargetSpec)]


@fuzz(60)
@given(data=st.data())
def test_replayed_records_change_nothing(data: st.DataObject) -> None:
    """Any state, action, rollout or leader record folded again later (the controller folds its
    own writes and then reads them back; a redelivery) gives the same fold."""
    log = list(_LOG)
    for _ in range(data.draw(st.integers(1, 8))):
        original = data.draw(st.sampled_from(_REPEATABLE))
        later = data.draw(st.integers(original + 1, len(log)))
        log.insert(later, _LOG[original])
    assert summary(fold(*log)) == summary(fold(*_LOG))


# --------------------------------------------------------------------------- actions


def test_actions_are_deduplicated_by_action_id() -> None:
    promote = action("r1", "p1", ActionKind.PROMOTE)
    control = fold(target(stable=V1), rollout("r1", V2), promote, promote)
    control.observe(promote.model_copy(update={"reason": "again", "issued_at": at(30)}))
    found = control.rollout("r1")
    assert found is not None
    assert found.count(ActionKind.PROMOTE) == 1
    control.observe(action("r1", "p2", ActionKind.PROMOTE))
    assert found.count(ActionKind.PROMOTE) == 2
    # Another rollout's action with the same id is its own.
    control.observe(rollout("r2", V3))
    control.observe(action("r2", "p1", ActionKind.PROMOTE))
    assert found.count(ActionKind.PROMOTE) == 2


def test_actions_before_their_rollout_are_kept_until_it_comes() -> None:
    early = action("r1", "a1", ActionKind.ABORT, rollback=False)
    control = fold(target(stable=V1), early, early, rollout("r1", V2), early)
    found = control.rollout("r1")
    assert found is not None and found.actions == [early]
    assert found.abort == early


def test_operator_paused_follows_the_last_pause_or_resume() -> None:
    control = fold(target(stable=V1), rollout("r1", V2))
    found = control.rollout("r1")
    assert found is not None and not found.operator_paused
    steps = [
        ("a1", ActionKind.PAUSE, True),
        ("a2", ActionKind.PROMOTE, True),
        ("a3", ActionKind.RESUME, False),
        ("a4", ActionKind.ABORT, False),
        ("a5", ActionKind.PAUSE, True),
        ("a1", ActionKind.RESUME, True),  # a replayed id: ignored, still paused
        ("a6", ActionKind.RESUME, False),
    ]
    for action_id, kind, paused in steps:
        control.observe(action("r1", action_id, kind))
        assert found.operator_paused is paused, (action_id, kind)


def test_the_first_abort_counts() -> None:
    first = action("r1", "a1", ActionKind.ABORT, reason="first", rollback=False)
    control = fold(
        target(stable=V1), rollout("r1", V2), first, action("r1", "a2", ActionKind.ABORT)
    )
    found = control.rollout("r1")
    assert found is not None and found.abort == first


# --------------------------------------------------------------------------- leader


def _leader(generation: int, member: str = "c1") -> LeaderRecord:
    return LeaderRecord(
        member=member, generation=generation, producer_epoch=generation, since=at(generation)
    )


def test_the_leader_record_keeps_the_highest_generation() -> None:
    control = fold(_leader(3, "c3"), _leader(2, "c2"), _leader(1, "c1"))
    assert control.leader == _leader(3, "c3")
    control.observe(_leader(4, "c4"))
    assert control.leader == _leader(4, "c4")
    control.observe(_leader(3, "c3"))
    assert control.leader == _leader(4, "c4")


# --------------------------------------------------------------------------- questions


def test_rollouts_in_log_order_open_and_active() -> None:
    control = fold(
        target(stable=V1),
        target("other", stable=V3),
        rollout("r1", V2),
        rollout("r2", V3, "other"),
        rollout("r3", V3),
        state("r1", 0, SUCCEEDED),
        state("r3", 0),
    )
    assert [r.rollout_id for r in control.rollouts()] == ["r1", "r2", "r3"]
    assert [r.rollout_id for r in control.rollouts("llama")] == ["r1", "r3"]
    assert [r.rollout_id for r in control.open_rollouts()] == ["r2", "r3"]
    active = control.active("llama")
    assert active is not None and active.rollout_id == "r3"
    assert control.active("other") is None  # r2 not started yet
    r2 = control.rollout("r2")
    assert r2 is not None and r2.phase is None and not r2.ended


def test_targets_of_reports_every_matching_target() -> None:
    control = fold(target(stable=V1), target("zone-a", zone="a"), target("other"))
    assert [t.name for t in control.targets()] == ["llama", "other", "zone-a"]
    names = sorted(t.name for t in control.targets_of({"model": "llama", "zone": "a"}))
    assert names == ["llama", "zone-a"]
    assert control.targets_of({"model": "mistral"}) == []
    found = control.target("llama")
    assert found is not None and found.selector.labels == {"model": "llama"}


def test_records_are_counted() -> None:
    assert fold(*_LOG).records == len(_LOG)
