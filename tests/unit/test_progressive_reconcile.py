"""The reconcile loop (controlplane/rollout/progressive.py): every live worker of a target runs
what it should (its stable state, or a rollout's change once its wave passed), one command per
worker incarnation; a worker two targets claim is left alone. Over a simulated fleet
(tests/unit/progressive_sim.py). Pure: no Kafka.
"""

from __future__ import annotations

from controlplane.rollout.progressive import (
    conflicts,
    members,
    reconcile,
    should_run,
    sync_rollout_id,
)
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Strategy,
    TargetSpec,
)
from controlplane.wire.protocol import Command, ReloadWeightsSpec
from tests.factories import at
from tests.unit.progressive_sim import LABELS, V1, V2, Outcome, Sim, weights

PHASE = ControlPhase


# --------------------------------------------------------------------------- reconcile


def test_a_drifting_worker_gets_one_sync_command_per_incarnation() -> None:
    sim = Sim(3)
    sim.workers["w01"].version = "v0"
    sim.beat()
    first = sim.decide().commands
    assert len(first) == 1
    (command,) = first
    assert command.selector.worker_ids == ["w01"]
    assert command.spec == ReloadWeightsSpec(path="/ckpt/v1", version="v1")
    assert command.rollout_id == sync_rollout_id("llama", V1, "w01", 1, reported="v0")
    # Not applied yet (the worker still reports v0): no second command for the same incarnation.
    for _ in range(5):
        sim.tick(1)
        assert not sim.decide().commands
    sim.restart("w01", version="v0")
    sim.tick(1)
    (again,) = sim.decide().commands
    assert again.selector.worker_ids == ["w01"] and again.rollout_id != command.rollout_id
    assert again.rollout_id == sync_rollout_id("llama", V1, "w01", 2, reported="v0")


def test_a_worker_restarted_from_an_old_journal_converges() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1))
    sim.run(sim.ended())
    sim.restart("w02", version="v1")
    sim.tick(1)
    sim.run(lambda: sim.workers["w02"].version == "v2", limit=5)
    assert set(sim.versions().values()) == {"v2"}


def test_a_worker_matched_by_two_targets_gets_nothing() -> None:
    sim = Sim(3)
    sim.observe(
        TargetSpec(
            name="zone-a", selector={"zone": "a"}, stable=weights("v7"), issued_at=at(0), issuer="o"
        )
    )
    sim.workers["w01"].labels = {**LABELS, "zone": "a"}
    sim.workers["w01"].version = "v0"
    sim.workers["w02"].version = "v0"
    sim.beat()
    assert conflicts(sim.control, sim.fleet, sim.now) == {"w01": ["llama", "zone-a"]}
    target = sim.control.target("llama")
    assert target is not None
    assert members(sim.control, sim.fleet, target, sim.now) == ["w00", "w02"]
    commands = sim.decide().commands
    assert [c.selector.worker_ids for c in commands] == [["w02"]]
    sim.start(Strategy())
    sim.run(sim.ended())
    assert "w01" not in sim.receivers(sim.published("r1"))


def test_should_run_follows_the_waves() -> None:
    sim = Sim(5)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], pause="manual"))
    target = sim.control.target("llama")
    assert target is not None
    assert should_run(sim.control, target, "w04") == V1
    sim.decide()  # the canary's batch is handed out: the rollout's to finish
    assert should_run(sim.control, target, "w00") is None
    sim.run(sim.in_phase(PHASE.PAUSED))
    # its wave's batches are over: it runs the change (a restart from an old journal gets it back)
    assert should_run(sim.control, target, "w00") == V2
    sim.act(ActionKind.PROMOTE)
    sim.decide()
    assert should_run(sim.control, target, "w00") == V2
    assert should_run(sim.control, target, "w01") is None  # its batch is out
    assert should_run(sim.control, target, "w04") == V1
    assert should_run(sim.control, target, "new") == V1


def test_reconcile_alone_leaves_workers_in_sync_alone() -> None:
    sim = Sim(3)
    assert reconcile(sim.control, sim.fleet, sim.now) == []


def test_a_worker_that_failed_in_a_rollout_is_left_alone_until_it_ends() -> None:
    """A failed worker of an updated wave is the rollout's (counted against max_failures): a
    sync command to it during the rollout would retry the failed change outside the batches, one
    more worker applying than ``max_unavailable`` allows. Once the rollout ended, it converges."""

    def policy(command: Command, worker_id: str) -> Outcome:
        return "fail" if worker_id == "w01" and command.rollout_id.startswith("r1.") else "ok"

    sim = Sim(10, policy=policy, delay=3.0)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], max_unavailable=2, max_failures="1"))

    def until() -> bool:
        assert len(sim.handed_out()) <= 2, sim.handed_out()
        return sim.ended()()

    sim.run(until)
    assert sim.current().phase is PHASE.SUCCEEDED and sim.current().failed == ["w01"]
    assert sim.receivers(sim.published()).count("w01") == 1
    sim.tick(1)
    (sync,) = sim.decide().commands
    assert sync.selector.worker_ids == ["w01"]
    assert sync.spec == ReloadWeightsSpec(path="/ckpt/v2", version="v2")


def test_a_worker_restarted_on_the_old_version_while_its_wave_waits_to_be_healthy_gets_it_back() -> (
    None
):
    """Its batch acked, the canary restarts from an older journal (v1) before its wave is seen
    healthy: the reconciler gives it the rollout's version back, so the wave passes instead of
    waiting for its progress deadline."""
    sim = Sim(3)
    sim.start(Strategy(canary=1, progress_deadline_s=60))
    sim.decide()
    assert sim.receivers(sim.published()) == ["w00"]
    sim.tick()  # w00 acks: succeeded, on v2
    sim.restart("w00", version="v1")
    sim.beat()
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is ControlPhase.SUCCEEDED, state.message
    syncs = [c for c in sim.published("sync-")]
    assert [(c.selector.worker_ids, c.spec.version) for c in syncs] == [(["w00"], "v2")]  # type: ignore[union-attr]
    assert sim.versions() == {"w00": "v2", "w01": "v2", "w02": "v2"}
