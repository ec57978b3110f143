"""A dry run (``Command.dry_run``) under a progressive batch's predictable rollout id is never
that batch applied (review LOW-17): its ``succeeded`` acks changed nothing. The rollout ends with
a coded reason (``ROLLOUT_EXISTS``: the batch's id is taken) and no later batch is published."""

from __future__ import annotations

from controlplane.rollout.progressive import batch_rollout_id, rollback_rollout_id
from controlplane.wire.control import ControlPhase, Desired, Strategy
from controlplane.wire.errors import LocalCode
from controlplane.wire.protocol import Command, CommandKind, ReloadWeightsSpec, UpdateConfigSpec
from tests.factories import A, R, S, ack, at, command
from tests.unit.progressive_sim import Sim

TWO_WAVES = Strategy(canary=1, bake_s=2)


def dry_run(sim: Sim, rollout_id: str, *, issued: float, config: bool = False) -> Command:
    """Someone's dry run under ``rollout_id``, to every worker, each acking it ``succeeded``
    (it changed nothing: the workers keep their version and config)."""
    overrides = {"temperature": 0.5} if config else None
    cmd = command(
        rollout_id,
        f"{rollout_id}.dry",
        workers=sorted(sim.workers),
        issued=issued,
        overrides=overrides,
    ).model_copy(update={"dry_run": True})
    sim.feed(cmd)
    kind = CommandKind.UPDATE_CONFIG if config else CommandKind.RELOAD_WEIGHTS
    for worker in sim.workers.values():
        for state, sent in ((A, sim.t), (R, sim.t + 0.1), (S, sim.t + 0.5)):
            sim.feed(
                ack(
                    worker.worker_id,
                    state,
                    sent,
                    rollout_id=rollout_id,
                    command_id=cmd.command_id,
                    version=worker.version if state is S else None,
                    started=sim.t + 0.1 if state is not A else None,
                ).model_copy(update={"kind": kind})
            )
    return cmd


def test_a_dry_run_under_the_first_batchs_id_is_not_the_wave_applied() -> None:
    sim = Sim(4)
    dry_run(sim, batch_rollout_id("r1", 0, 0), issued=0.0, config=True)
    sim.tick()
    sim.start(TWO_WAVES, desired=Desired(config={"temperature": 0.5}), rollback=False)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase in (ControlPhase.ABORTED, ControlPhase.ROLLED_BACK), state
    assert state.code == LocalCode.ROLLOUT_EXISTS.value, state
    assert "dry run" in state.message and "r1.w0.b0" in state.message
    assert state.wave == 0 and state.batch == 0  # never counted as applied
    assert sim.published("r1.w") == []  # no later batch, no later wave
    assert all(not w.config for w in sim.workers.values())  # nothing changed anywhere


def test_a_dry_run_issued_earlier_under_a_published_batchs_id_is_not_the_wave_applied() -> None:
    """The controller published its batch; a dry run under the same id, issued earlier, comes
    after it in the log: the fleet's command of that rollout is now the dry run."""
    sim = Sim(4, delay=3.0)  # the workers answer the controller's batch 3 s later
    sim.start(TWO_WAVES)
    sim.decide()
    [mine] = sim.published("r1.w0.b0")
    dry_run(sim, mine.rollout_id, issued=-1.0)
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == LocalCode.ROLLOUT_EXISTS.value, state
    assert state.wave == 0 and state.batch == 0
    assert sim.published("r1.w1") == []


def test_a_dry_run_under_a_rollback_batchs_id_is_not_a_rollback_done() -> None:
    """Published after the controller's rollback command, issued earlier: the fleet's command
    of that rollback batch is the dry run, whose acks put nobody back."""
    sim = Sim(4, policy=lambda c, w: "fail" if c.rollout_id.startswith("r1.w1") else "ok")
    sim.start(Strategy(canary=1, max_failures="0"))
    rollback_id = rollback_rollout_id("r1", 0)
    sim.run(lambda: bool(sim.published(rollback_id)))
    dry_run(sim, rollback_id, issued=-1.0)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is ControlPhase.ABORTED, state
    assert state.code == LocalCode.ROLLBACK_FAILED.value, state
    assert "dry run" in state.message and rollback_id in state.message


def test_the_controllers_own_batches_are_not_dry_runs() -> None:
    sim = Sim(4)
    sim.start(TWO_WAVES)
    sim.run(sim.ended())
    assert sim.current().phase is ControlPhase.SUCCEEDED
    assert all(not c.dry_run for c in sim.published("r1"))
    assert {type(c.spec) for c in sim.published("r1")} <= {ReloadWeightsSpec, UpdateConfigSpec}
    assert at(0) <= min(c.issued_at for c in sim.published("r1"))
