"""Defects the review of the controller's decisions found (issue 12), each shown here: a rollout
changes weights or config, not both; the stable state a rollout made survives compaction; undo
reverts exactly one change; a dead worker is left to the reconciler, not to a rollback command;
a rejected rollout does not release held workers; drift syncs share max_unavailable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controlplane.rollout.progressive import held, reconcile
from controlplane.rollout.targets import ControlState, reverting
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Desired,
    RolloutSpec,
    Strategy,
    TargetSpec,
    WeightsRef,
)
from controlplane.wire.protocol import UpdateConfigSpec
from tests.factories import at
from tests.unit.progressive_sim import LABELS, V1, V2, Sim, digest, weights


def test_a_rollout_changes_the_weights_or_the_config_not_both() -> None:
    with pytest.raises(ValidationError, match="not both"):
        RolloutSpec(
            rollout_id="r1",
            target="llama",
            desired=weights("v2", temperature=0.5),
            issued_at=at(0),
            issuer="ops",
        )


def test_the_stable_state_a_rollout_made_survives_the_compaction_of_the_targets_spec() -> None:
    sim = Sim(3)
    sim.start(Strategy())
    sim.run(sim.ended())
    assert sim.current().phase is ControlPhase.SUCCEEDED and sim.current().result == V2
    # The target's spec is written again (a new selector, no stable); compaction then drops
    # its first spec: a reader of the compacted log folds the rollout's spec and final state,
    # then the new spec.
    respec = TargetSpec(name="llama", selector=LABELS, issued_at=at(99), issuer="ops")
    live = sim.control
    live.observe(respec)
    compacted = ControlState()
    for record in sim.records:
        if not isinstance(record, TargetSpec):
            compacted.observe(record)
    compacted.observe(respec)
    for fold in (live, compacted):
        target = fold.target("llama")
        assert target is not None and target.stable == V2


def test_undo_reverts_exactly_the_change_that_was_made() -> None:
    v1, v2 = weights("v1"), weights("v2")
    assert reverting(v2, v1) == Desired(weights=v1.weights)
    cfg1 = Desired(weights=v1.weights, config={"temperature": 0.0, "top_k": 5})
    cfg2 = Desired(weights=v1.weights, config={"temperature": 0.7, "top_k": 5, "new": 1})
    assert reverting(cfg2, cfg1) == Desired(config={"temperature": 0.0})
    # only a key the previous state lacked differs: nothing can undo it
    assert reverting(Desired(weights=v1.weights, config={"new": 1}), v1) is None


def test_a_worker_lost_after_applying_is_left_to_the_reconciler_not_to_a_rollback() -> None:
    sim = Sim(3, policy=lambda c, w: "fail" if w == "w02" else "ok")
    sim.start(Strategy(max_failures="0"))
    sim.run(lambda: sim.current().phase is ControlPhase.ROLLING_BACK or sim.ended()())
    sim.workers["w01"].alive = False  # applied v2, then died before its rollback command
    sim.tick(30)  # its lease runs out
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is ControlPhase.ROLLED_BACK, state
    assert sim.versions() == {"w00": "v1", "w01": "v2", "w02": "v1"}
    # back from the dead on v2: the reconciler gives it the stable state (it is not held)
    sim.workers["w01"].alive = True
    sim.restart("w01")
    sim.beat()
    assert held(sim.control, sim.control.target("llama")) == frozenset()  # type: ignore[arg-type]
    commands = reconcile(sim.control, sim.fleet, sim.now)
    assert [(c.selector.worker_ids, c.spec.version) for c in commands] == [(["w01"], "v1")]  # type: ignore[union-attr]


def test_a_rejected_rollout_does_not_release_the_workers_an_abort_held() -> None:
    sim = Sim(2)
    sim.start(Strategy(canary=1, pause="manual"), rollback=False)
    sim.run(sim.in_phase(ControlPhase.PAUSED))
    sim.act(ActionKind.ABORT)
    sim.run(sim.ended())
    target = sim.control.target("llama")
    assert target is not None and held(sim.control, target) == {"w00"}
    sim.start(Strategy(), desired=weights("v3"), rollout_id="r2", target="nope")
    sim.run(sim.ended("r2"))
    assert sim.current("r2").phase is ControlPhase.REJECTED
    assert held(sim.control, target) == {"w00"}


def test_drift_syncs_during_a_rollout_share_its_max_unavailable() -> None:
    sim = Sim(4, delay=5.0)
    sim.start(Strategy(canary=1, steps=["100%"], max_unavailable=1))
    sim.run(lambda: sim.current().wave == 1 and bool(sim.handed_out("r1.w1")))
    # the canary restarts from an old journal (v1) while a batch of wave 2 is applying
    sim.restart("w00", version="v1")
    sim.beat()
    assert sim.handed_out() == {"w01"}
    assert reconcile(sim.control, sim.fleet, sim.now) == []  # max_unavailable=1 is used
    sim.run(sim.ended())
    assert sim.current().phase is ControlPhase.SUCCEEDED
    assert sim.most_applying() == 1
    assert sim.versions() == dict.fromkeys(sim.workers, "v2")


def test_the_stable_state_of_a_target_whose_spec_comes_later_is_kept() -> None:
    sim = Sim(2)
    sim.start(Strategy())
    sim.run(sim.ended())
    fold = ControlState()
    for record in sim.records:
        if not isinstance(record, TargetSpec):
            fold.observe(record)
    assert fold.target("llama") is None
    fold.observe(TargetSpec(name="llama", selector=LABELS, issued_at=at(99), issuer="ops"))
    target = fold.target("llama")
    assert target is not None and target.stable == V2 and target.history[-1].rollout_id == "r1"
    assert V1 != V2 and WeightsRef(path="/ckpt/v2", version="v2") == V2.weights


def test_updated_workers_holding_different_weights_fail_the_agreement_gate() -> None:
    """The same version label, other bytes on one host (a corrupted copy, a stale cache): the
    weights digests of the acks disagree, and the gate catches it before the next wave."""
    sim = Sim(4, digest=lambda c, w: "bad" * 8 if w == "w02" else "good" * 8)
    sim.start(Strategy(steps=["75%", "100%"]))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is ControlPhase.ROLLED_BACK and state.code == "GATE_FAILED"
    (gate,) = [g for g in state.gates if not g.passed]
    assert (gate.wave, gate.gate) == (0, "agreement")
    assert "different weights" in gate.message and "w02" in gate.message
    assert not sim.published("r1.w1.")  # the last wave never started


def test_workers_whose_runner_reports_no_digest_are_not_judged_on_it() -> None:
    sim = Sim(3, digest=lambda c, w: None if w == "w01" else "same" * 8)
    sim.start(Strategy())
    sim.run(sim.ended())
    assert sim.current().phase is ControlPhase.SUCCEEDED


def test_a_config_rollout_learns_its_digest_and_config_drift_converges() -> None:
    """The stable config's digest is what the updated workers reported (agreement); a worker
    restarted with its old config then reports another digest and gets the stable config."""
    sim = Sim(3)
    sim.start(Strategy(), desired=Desired(config={"temperature": 0.5}))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is ControlPhase.SUCCEEDED and state.result is not None
    assert state.result.config_digest == digest({"temperature": 0.5})
    target = sim.control.target("llama")
    assert target is not None and target.stable is not None
    assert target.stable.config_digest == digest({"temperature": 0.5})
    assert target.stable.version == "v1"  # the weights stay
    sim.restart("w01")
    sim.workers["w01"].config = {}  # back from an old journal: no override applied
    sim.beat()
    (command,) = reconcile(sim.control, sim.fleet, sim.now)
    assert command.selector.worker_ids == ["w01"]
    assert command.spec == UpdateConfigSpec(overrides={"temperature": 0.5})
    sim.run(lambda: sim.workers["w01"].config == {"temperature": 0.5})
    assert reconcile(sim.control, sim.fleet, sim.now) == []
    # a weights rollout afterwards keeps the known config digest
    sim.start(Strategy(), rollout_id="r2")
    sim.run(sim.ended("r2"))
    target = sim.control.target("llama")
    assert target is not None and target.stable is not None
    assert (target.stable.version, target.stable.config_digest) == (
        "v2",
        digest({"temperature": 0.5}),
    )


def test_a_worker_that_drifts_again_in_the_same_incarnation_is_synced_again() -> None:
    """A plain reload aimed at a worker of a target is drift, reverted each time (review #4)."""
    sim = Sim(2)
    sim.workers["w01"].version = "v9"  # `controlplane reload-weights --version v9` on it
    sim.beat()
    sim.run(lambda: sim.workers["w01"].version == "v1")
    sim.workers["w01"].version = "v8"  # and another, same incarnation
    sim.beat()
    (command,) = reconcile(sim.control, sim.fleet, sim.now)
    assert command.selector.worker_ids == ["w01"] and command.spec.version == "v1"  # type: ignore[union-attr]


def test_a_gate_failing_over_many_workers_says_so_within_what_a_record_may_hold() -> None:
    sim = Sim(30, digest=lambda c, w: "bad" if w == "w07" else "good-" * 2000)
    sim.start(Strategy())
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is ControlPhase.ROLLED_BACK and state.code == "GATE_FAILED"
    assert len(state.message) <= 1000 and "2 different weights" in state.message
    assert "w07" in state.message and "and 19 more" in state.message
    for record in (state, *state.gates):
        type(record).model_validate(record.model_dump())  # every reader can decode it


def test_a_rollout_whose_decision_raises_ends_aborted_and_decide_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """decide() never raises: one rollout the log makes odd ends aborted (code INTERNAL), the
    controller carries on (before, the exception stopped every coordinator's controller)."""
    from controlplane.rollout import progressive

    sim = Sim(2)
    sim.start(Strategy())

    def broken(*args: object) -> None:
        raise KeyError("a record no controller wrote")

    monkeypatch.setattr(progressive, "_advance", broken)
    decision = sim.decide()
    (state,) = decision.states
    assert (state.phase, state.code) == (ControlPhase.ABORTED, "INTERNAL")
    assert "KeyError" in state.message
    monkeypatch.undo()
    sim.run(sim.ended())  # ended is ended
    assert sim.current().phase is ControlPhase.ABORTED


def test_a_bake_as_long_as_the_deadline_is_refused() -> None:
    with pytest.raises(ValidationError, match="bake_s"):
        Strategy(bake_s=600, progress_deadline_s=600)


def test_a_config_that_is_not_json_is_refused() -> None:
    """1e400 is a JSON number that Python reads as infinity: no command could carry it."""
    with pytest.raises(ValidationError, match="NaN and Infinity"):
        Desired.model_validate_json('{"config": {"x": 1e400}}')


def test_an_empty_probe_answer_fails_the_probe_gate() -> None:
    from controlplane.wire.control import ProbeGate

    sim = Sim(2, probe=lambda c, w: {})
    sim.start(Strategy(probe=ProbeGate(prompt="p")))
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == "GATE_FAILED" and "malformed" in state.message


def test_a_repeated_promote_releases_one_pause_not_the_next() -> None:
    """A promote says which wave's pause it releases: a retried one (a new action id after an
    unconfirmed publish) must not skip the next manual pause (review #6)."""
    sim = Sim(3)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], pause="manual"))
    sim.run(sim.in_phase(ControlPhase.PAUSED))
    rollout = sim.control.rollout("r1")
    assert rollout is not None
    wave = rollout.action_wave(ActionKind.PROMOTE)
    sim.act(ActionKind.PROMOTE, wave=wave)
    sim.act(ActionKind.PROMOTE, wave=wave)  # the retry
    sim.run(lambda: sim.current().wave == 1 and sim.current().phase is ControlPhase.PAUSED)
    assert sim.current().message.endswith("waiting for `rollout promote`")


def test_a_stable_state_declared_by_a_spec_survives_a_later_spec_and_compaction() -> None:
    """`targets set --weights v3` then `targets set -s new=selector`: a compacted log keeps the
    declared v3 (its record has a key of its own), as a live reader does (review #5)."""
    from controlplane.wire.channels import CONTROL
    from controlplane.wire.topics import Topics

    sim = Sim(2)
    sim.start(Strategy())
    sim.run(sim.ended())
    v3 = TargetSpec(
        name="llama", selector=LABELS, stable=weights("v3"), issued_at=at(50), issuer="ops"
    )
    respec = TargetSpec(name="llama", selector={"model": "x"}, issued_at=at(60), issuer="ops")
    log = [*sim.records, v3, respec]
    latest: dict[bytes, int] = {}
    for offset, record in enumerate(log):
        latest[CONTROL.record(Topics(), record)[1]] = offset
    compacted = ControlState()
    for offset, record in enumerate(log):
        if latest[CONTROL.record(Topics(), record)[1]] == offset:
            compacted.observe(record)
    target = compacted.target("llama")
    assert target is not None and target.stable == weights("v3")
    assert target.spec.selector == {"model": "x"}


def test_a_worker_unhealthy_during_the_bake_fails_the_health_gate() -> None:
    """The bake counts from the moment the applied wave is first seen healthy; from then until
    it ends, each worker of the wave must stay healthy (not only not degraded)."""
    sim = Sim(3)
    sim.start(Strategy(canary=1, bake_s=20))
    sim.run(lambda: sim.current().healthy_at is not None)
    healthy_at = sim.current().healthy_at
    assert healthy_at is not None and sim.current().wave == 0
    sim.tick(5)  # baking
    sim.decide()
    assert sim.current().phase is ControlPhase.PROGRESSING and not sim.published("r1.w1.")
    sim.workers["w00"].version = "v0"  # the canary reports another version mid-bake
    sim.beat()
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == "GATE_FAILED" and "during the bake" in state.message
    assert "w00" in state.message and not sim.published("r1.w1.")


def test_the_bake_counts_from_the_first_healthy_moment() -> None:
    sim = Sim(2)
    sim.start(Strategy(canary=1, bake_s=10))
    sim.run(lambda: sim.current().healthy_at is not None)
    healthy_at = sim.current().healthy_at
    assert healthy_at is not None
    sim.run(lambda: sim.current().wave == 1)
    assert (sim.now - healthy_at).total_seconds() >= 10
