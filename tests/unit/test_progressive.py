"""The controller's decisions (controlplane/rollout/progressive.py), driven with a real Fleet fed
real commands, acks and heartbeats, and an injected ``now`` (tests/unit/progressive_sim.py):
waves and batches, pause and promote, abort and rollback, rejected starts, a resumed controller.
Gates and failures: test_progressive_gates.py; drift: test_progressive_reconcile.py; properties:
test_progressive_properties.py. Pure: no Kafka.
"""

from __future__ import annotations

from controlplane.rollout.progressive import (
    batch_rollout_id,
    decide,
    rollback_rollout_id,
    sync_rollout_id,
)
from controlplane.rollout.waves import plan_waves
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Strategy,
    TargetSpec,
)
from controlplane.wire.errors import LocalCode
from controlplane.wire.protocol import Command, ReloadWeightsSpec
from tests.factories import at
from tests.unit.progressive_sim import V1, V2, Outcome, Sim, Worker, weights

PHASE = ControlPhase


# --------------------------------------------------------------------------- waves


def test_a_canary_then_10_50_100_percent_rollout_goes_wave_by_wave_to_succeeded() -> None:
    sim = Sim(10)
    sim.start(Strategy(canary=1, steps=["10%", "50%", "100%"]))
    acked_before: dict[str, set[str]] = {}

    def until() -> bool:
        for t, command in sim.commands:
            if command.rollout_id not in acked_before:
                acked_before[command.rollout_id] = {
                    w for w, v in sim.versions().items() if v == "v2"
                }
                assert t == sim.t
        return sim.ended()()

    sim.run(until)
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED and state.code is None
    # 10% of 10 is the canary already: three waves.
    assert state.waves == [
        ["w00"],
        ["w01", "w02", "w03", "w04"],
        [f"w{i:02}" for i in range(5, 10)],
    ]
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0", "r1.w1.b0", "r1.w2.b0"]
    receivers = sim.receivers(sim.published())
    assert sorted(receivers) == sorted(sim.workers) and len(set(receivers)) == len(receivers)
    # Each wave was published only once every worker of the waves before it had applied v2.
    for index, command in enumerate(sim.published()):
        before = {w for wave in state.waves[:index] for w in wave}
        assert before <= acked_before[command.rollout_id]
        assert not set(command.selector.worker_ids or []) & acked_before[command.rollout_id]
        assert command.command_id == f"{command.rollout_id}.a1"
        assert command.spec == ReloadWeightsSpec(path="/ckpt/v2", version="v2")
    assert set(sim.versions().values()) == {"v2"}
    target = sim.control.target("llama")
    assert target is not None and target.stable == V2
    assert target.previous is not None and target.previous.desired == V1
    assert state.previous == V1
    assert [g.gate for g in state.gates if g.passed] == ["health", "agreement"] * 3
    # Ended is ended: nothing more is decided, for the rollout or for drift.
    sim.tick(5)
    assert not sim.decide()


def test_a_four_wave_rollout_over_twenty_workers() -> None:
    sim = Sim(20)
    sim.start(Strategy(canary=1, steps=["10%", "50%", "100%"]))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED
    assert [len(w) for w in state.waves] == [1, 1, 8, 10]
    assert len(sim.published()) == 4
    assert sorted(sim.receivers(sim.published())) == sorted(sim.workers)


def test_states_grow_one_revision_at_a_time() -> None:
    sim = Sim(4)
    sim.start(Strategy(canary=1))
    sim.run(sim.ended())
    assert [s.revision for s in sim.states] == list(range(len(sim.states)))
    assert all(s.updated_at <= at(sim.t) for s in sim.states)
    assert sim.states[0].started_at == at(0) and sim.states[-1].ended_at is not None


def test_max_unavailable_publishes_batches_of_at_most_k_one_after_the_other() -> None:
    sim = Sim(10, delay=3.0)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], max_unavailable=2))
    outstanding: list[str] = []

    def until() -> bool:
        published = sim.published()
        for command in published[len(outstanding) :]:
            # Published only once the batch before it ended.
            for earlier in outstanding:
                assert sim.fleet.status(earlier, sim.now).terminal, (command.rollout_id, earlier)
            outstanding.append(command.rollout_id)
        return sim.ended()()

    sim.run(until)
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED
    commands = sim.published()
    assert all(len(c.selector.worker_ids or []) <= 2 for c in commands)
    assert [c.rollout_id for c in commands] == [
        "r1.w0.b0",
        "r1.w1.b0",
        "r1.w1.b1",
        "r1.w2.b0",
        "r1.w2.b1",
        "r1.w2.b2",
    ]
    assert sorted(sim.receivers(commands)) == sorted(sim.workers)
    # From the acks' timings: never more than two workers applying at once.
    assert sim.most_applying("r1.") == 2


def test_a_worker_that_joins_after_the_plan_waits_for_the_stable_state() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.workers["w99"] = Worker("w99", version="v0")
    sim.beat()
    decision = sim.decide()
    # Not in the plan: it should run the stable state, and gets a sync command for it.
    assert [c.selector.worker_ids for c in decision.commands] == [["w99"]]
    assert decision.commands[0].spec == ReloadWeightsSpec(path="/ckpt/v1", version="v1")


# --------------------------------------------------------------------------- pause, promote, abort


def test_a_manual_pause_holds_until_promote() -> None:
    sim = Sim(5)
    sim.start(Strategy(canary=1, steps=["100%"], pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    state = sim.current()
    assert state.wave == 0 and "promote" in state.message
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0"]
    for _ in range(30):
        sim.tick(1)
        assert not sim.decide()
    sim.act(ActionKind.PROMOTE)
    decision = sim.decide()
    assert [c.rollout_id for c in decision.commands] == ["r1.w1.b0"]
    assert decision.states[-1].phase is PHASE.PROGRESSING and decision.states[-1].promoted == 1
    sim.run(sim.ended())
    assert sim.current().phase is PHASE.SUCCEEDED


def test_a_promote_given_before_the_pause_releases_it() -> None:
    sim = Sim(5)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], pause="manual"))
    sim.act(ActionKind.PROMOTE)
    sim.run(sim.in_phase(PHASE.PAUSED))
    state = sim.current()
    # One promote releases one pause: the canary's; the next boundary waits again.
    assert state.wave == 1 and state.promoted == 1


def test_a_manual_pause_longer_than_the_progress_deadline_does_not_abort() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1, pause="manual", progress_deadline_s=30))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.tick(120)
    assert not sim.decide()
    sim.act(ActionKind.PROMOTE)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED, state.message


def test_an_operator_pause_holds_the_next_batch_and_resume_releases_it() -> None:
    sim = Sim(6, delay=2.0)
    sim.start(Strategy(max_unavailable=2, progress_deadline_s=30))
    sim.decide()
    sim.act(ActionKind.PAUSE)
    sim.run(lambda: sim.current().phase is PHASE.PAUSED)
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0"]
    for _ in range(60):  # longer than the progress deadline
        sim.tick(1)
        assert not sim.decide().commands
    sim.act(ActionKind.RESUME)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED, state.message
    assert len(sim.published()) == 3


def test_abort_during_a_pause_rolls_back_the_workers_that_applied() -> None:
    sim = Sim(5)
    sim.start(Strategy(canary=2, steps=["100%"], pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT, reason="looks wrong")
    decision = sim.decide()
    assert [s.phase for s in decision.states] == [PHASE.ROLLING_BACK]
    assert [c.rollout_id for c in decision.commands] == ["r1.rb.b0"]
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "ABORTED_BY_OPERATOR" and "looks wrong" in state.message
    rollbacks = sim.published("r1.rb.")
    assert sorted(sim.receivers(rollbacks)) == ["w00", "w01"]
    assert all(c.spec == ReloadWeightsSpec(path="/ckpt/v1", version="v1") for c in rollbacks)
    assert set(sim.versions().values()) == {"v1"}
    assert not any(c.rollout_id.startswith("r1.w1") for c in sim.published())
    target = sim.control.target("llama")
    assert target is not None and target.stable == V1 and len(target.history) == 1


def test_abort_without_rollback_ends_aborted() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT, rollback=False)
    decision = sim.decide()
    assert not decision.commands
    state = sim.current()
    assert state.phase is PHASE.ABORTED
    assert state.code == LocalCode.ABORTED_BY_OPERATOR.value == "ABORTED_BY_OPERATOR"


def test_an_abort_s_rollback_choice_overrides_the_rollout_s() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1, pause="manual"), rollback=False)
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT, rollback=True)
    sim.run(sim.ended())
    assert sim.current().phase is PHASE.ROLLED_BACK
    assert sim.receivers(sim.published("r1.rb.")) == ["w00"]
    # Without an abort, the rollout's own choice holds: aborted, the canary held on v2.
    other = Sim(3, policy=lambda c, w: "fail" if c.rollout_id == "r1.w1.b0" else "ok")
    other.start(Strategy(canary=1), rollback=False)
    other.run(other.ended())
    state = other.current()
    assert state.phase is PHASE.ABORTED and state.code == "MAX_FAILURES_EXCEEDED"
    assert other.versions()["w00"] == "v2" and not other.published("r1.rb.")
    for _ in range(3):
        other.tick(1)
        assert not other.decide().commands  # held: no sync back to v1


def test_rollouts_of_two_targets_progress_side_by_side() -> None:
    sim = Sim(3)
    for i in range(3):
        sim.workers[f"m{i:02}"] = Worker(f"m{i:02}", labels={"model": "mistral"})
    sim.observe(
        TargetSpec(
            name="mistral", selector={"model": "mistral"}, stable=V1, issued_at=at(0), issuer="o"
        )
    )
    sim.beat()
    sim.start(Strategy(canary=1, max_unavailable=1))
    sim.start(Strategy(canary=2), desired=weights("v3"), rollout_id="r2", target="mistral")
    sim.run(lambda: sim.ended("r1")() and sim.ended("r2")())
    assert sim.current("r1").phase is sim.current("r2").phase is PHASE.SUCCEEDED
    assert sorted(sim.receivers(sim.published("r1."))) == ["w00", "w01", "w02"]
    assert sorted(sim.receivers(sim.published("r2."))) == ["m00", "m01", "m02"]
    assert sim.versions() == {
        **dict.fromkeys(["w00", "w01", "w02"], "v2"),
        **dict.fromkeys(["m00", "m01", "m02"], "v3"),
    }


def test_abort_waits_for_the_commands_already_handed_out() -> None:
    sim = Sim(4, delay=5.0)
    sim.start(Strategy(canary=1, steps=["100%"]))
    sim.run(lambda: len(sim.published()) == 2)  # the second wave is with its workers
    sim.act(ActionKind.ABORT)
    decision = sim.decide()
    assert not decision.commands
    assert sim.current().phase is PHASE.ROLLING_BACK
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert sorted(sim.receivers(sim.published("r1.rb."))) == ["w00", "w01", "w02", "w03"]
    assert set(sim.versions().values()) == {"v1"}


def test_an_abort_without_a_stable_state_to_go_back_to_ends_aborted() -> None:
    sim = Sim(3, stable=None)
    sim.start(Strategy(canary=1, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ABORTED
    assert state.code == "ROLLBACK_UNAVAILABLE"
    assert not sim.published("r1.rb.")


def test_a_failed_rollback_ends_aborted_with_rollback_failed() -> None:
    def policy(command: Command, worker_id: str) -> Outcome:
        return "fail" if ".rb." in command.rollout_id and worker_id == "w01" else "ok"

    sim = Sim(4, policy=policy)
    sim.start(Strategy(canary=2, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ABORTED
    assert state.code == "ROLLBACK_FAILED" and "w01" in state.message
    assert sim.versions() == {"w00": "v1", "w01": "v2", "w02": "v1", "w03": "v1"}


# --------------------------------------------------------------------------- rejected starts


def test_a_rollout_of_an_unknown_target_is_rejected() -> None:
    sim = Sim(2)
    sim.start(Strategy(), target="mistral")
    decision = sim.decide()
    (state,) = decision.states
    assert state.phase is PHASE.REJECTED and state.code == "TARGET_UNKNOWN"
    assert state.revision == 0 and state.ended_at == sim.now
    assert not decision.commands


def test_a_second_rollout_of_a_busy_target_is_rejected() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1, pause="manual"))
    sim.start(Strategy(), rollout_id="r2")
    decision = sim.decide()
    assert [(s.rollout_id, s.phase) for s in decision.states] == [
        ("r1", PHASE.PROGRESSING),
        ("r2", PHASE.REJECTED),
    ]
    r2 = decision.states[1]
    assert r2.code == "TARGET_BUSY" and r2.message == "r1 is in progress on llama"
    assert {c.rollout_id for c in decision.commands} == {"r1.w0.b0"}
    # Once r1 ended, a new rollout starts.
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.PROMOTE)
    sim.run(sim.ended())
    sim.start(Strategy(), desired=weights("v3"), rollout_id="r3")
    sim.run(sim.ended("r3"))
    assert sim.current("r3").phase is PHASE.SUCCEEDED


def test_a_rollout_of_a_target_without_a_live_worker_is_rejected() -> None:
    sim = Sim(2)
    for worker in sim.workers.values():
        worker.alive = False
    sim.tick(60)
    sim.start(Strategy())
    (state,) = sim.decide().states
    assert state.phase is PHASE.REJECTED and state.code == "NO_MATCHING_WORKERS"


def test_a_rejected_rollout_changes_nothing_more() -> None:
    sim = Sim(2)
    sim.start(Strategy(), target="mistral")
    sim.decide()
    sim.observe(
        TargetSpec(
            name="mistral", selector={"model": "llama", "x": "y"}, issued_at=at(1), issuer="o"
        )
    )
    sim.tick(1)
    assert not sim.decide().states


# --------------------------------------------------------------------------- ids


def test_command_ids_are_deterministic() -> None:
    assert batch_rollout_id("r1", 2, 3) == "r1.w2.b3"
    assert rollback_rollout_id("r1", 1) == "r1.rb.b1"
    a = sync_rollout_id("llama", V1, "w1", 3)
    assert a == sync_rollout_id("llama", V1, "w1", 3) and a.startswith("sync-")
    assert (
        len({a, sync_rollout_id("llama", V2, "w1", 3), sync_rollout_id("llama", V1, "w1", 4)}) == 3
    )


def test_a_resumed_controller_decides_what_the_first_one_did() -> None:
    """A new controller reading the same log (a fresh fold of every record and event) decides
    exactly what the first would have."""
    sim = Sim(6, delay=2.0)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], max_unavailable=2))
    for _ in range(7):
        sim.decide()
        sim.tick(1)
    again = Sim(6)
    again.control = type(sim.control)()
    for record in sim.records:
        again.control.observe(record)
    again.fleet = type(sim.fleet)()
    for event in sim.events:
        again.feed(event)
    assert decide(again.control, again.fleet, sim.now) == decide(sim.control, sim.fleet, sim.now)


def test_waves_are_planned_once_at_the_start() -> None:
    sim = Sim(4)
    sim.start(Strategy(canary=1, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    planned = sim.current().waves
    sim.workers["w09"] = Worker("w09")
    sim.beat()
    sim.act(ActionKind.PROMOTE)
    sim.run(sim.ended())
    assert sim.current().waves == planned
    assert planned == plan_waves(["w00", "w01", "w02", "w03"], Strategy(canary=1))
    assert "w09" not in sim.receivers(sim.published("r1"))
