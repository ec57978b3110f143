"""The controller's decisions (controlplane/rollout/progressive.py), driven with a real Fleet fed
real commands, acks and heartbeats, and an injected ``now`` (tests/unit/progressive_sim.py):
waves, batches, pauses, abort and rollback, gates, rejected starts, the progress deadline, and
the reconcile loop. Pure: no Kafka.
"""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.rollout.progressive import (
    batch_rollout_id,
    conflicts,
    decide,
    members,
    reconcile,
    rollback_rollout_id,
    should_run,
    sync_rollout_id,
)
from controlplane.rollout.waves import plan_waves
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    ProbeGate,
    Strategy,
    TargetSpec,
)
from controlplane.wire.errors import LocalCode
from controlplane.wire.protocol import Command, ReloadWeightsSpec, UpdateConfigSpec
from tests.factories import at
from tests.unit.progressive_sim import LABELS, V1, V2, Outcome, Sim, Worker, weights

PHASE = ControlPhase


def _wave_of(sim: Sim, worker_id: str) -> int:
    state = sim.current()
    return next(i for i, wave in enumerate(state.waves) if worker_id in wave)


def _fails(*workers: str) -> Any:
    def policy(command: Command, worker_id: str) -> Outcome:
        return "fail" if worker_id in workers and ".rb." not in command.rollout_id else "ok"

    return policy


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
    spans = []
    for rollout_id in outstanding:
        for detail in sim.fleet.status(rollout_id, sim.now).workers:
            assert detail.state.value == "succeeded"
        command = sim.fleet.command(rollout_id)
        spans.append((command.issued_at, len(command.selector.worker_ids or [])))
    assert max(n for _, n in spans) <= 2


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


def _paused_after_canary(sim: Sim) -> None:
    sim.run(sim.in_phase(PHASE.PAUSED))


def test_a_manual_pause_holds_until_promote() -> None:
    sim = Sim(5)
    sim.start(Strategy(canary=1, steps=["100%"], pause="manual"))
    _paused_after_canary(sim)
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
    _paused_after_canary(sim)
    state = sim.current()
    # One promote releases one pause: the canary's; the next boundary waits again.
    assert state.wave == 1 and state.promoted == 1


def test_a_manual_pause_longer_than_the_progress_deadline_does_not_abort() -> None:
    sim = Sim(3)
    sim.start(Strategy(canary=1, pause="manual", progress_deadline_s=30))
    _paused_after_canary(sim)
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
    _paused_after_canary(sim)
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
    _paused_after_canary(sim)
    sim.act(ActionKind.ABORT, rollback=False)
    decision = sim.decide()
    assert not decision.commands
    state = sim.current()
    assert state.phase is PHASE.ABORTED
    assert state.code == LocalCode.ABORTED_BY_OPERATOR.value == "ABORTED_BY_OPERATOR"


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
    _paused_after_canary(sim)
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
    _paused_after_canary(sim)
    sim.act(ActionKind.ABORT)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ABORTED
    assert state.code == "ROLLBACK_FAILED" and "w01" in state.message
    assert sim.versions() == {"w00": "v1", "w01": "v2", "w02": "v1", "w03": "v1"}


# --------------------------------------------------------------------------- failures and gates


def test_max_failures_exceeded_aborts_and_rolls_back_exactly_the_workers_that_applied() -> None:
    sim = Sim(10, policy=_fails("w01", "w02"))
    sim.start(Strategy(canary=1, steps=["50%", "100%"], max_failures="1"))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "MAX_FAILURES_EXCEEDED"
    assert state.failed == ["w01", "w02"]
    assert sorted(sim.receivers(sim.published("r1.rb."))) == ["w00", "w03", "w04"]
    assert not sim.published("r1.w2.")  # no further wave started
    assert set(sim.versions().values()) == {"v1"}


def test_failures_up_to_max_failures_are_tolerated() -> None:
    sim = Sim(10, policy=_fails("w03"))
    sim.start(Strategy(canary=1, steps=["50%", "100%"], max_failures="10%"))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED, state.message
    assert state.failed == ["w03"]


def test_a_rejected_command_counts_as_a_failure() -> None:
    def policy(command: Command, worker_id: str) -> Outcome:
        return "reject" if worker_id == "w00" and ".rb." not in command.rollout_id else "ok"

    sim = Sim(3, policy=policy)
    sim.start(Strategy(canary=1))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "MAX_FAILURES_EXCEEDED" and state.failed == ["w00"]
    # Nobody had applied it: nothing to roll back.
    assert not sim.published("r1.rb.")
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0"]


def _probe_answer(logprob_of: dict[str, float]) -> Any:
    def probe(command: Command, worker_id: str) -> dict[str, Any]:
        return {"tokens": [5, 6, 7], "mean_logprob": logprob_of.get(worker_id, -0.5)}

    return probe


def test_a_canary_failing_the_probe_gate_is_rolled_back_and_nobody_else_gets_a_command() -> None:
    sim = Sim(10, probe=_probe_answer({"w00": -9.0}))
    gate = ProbeGate(prompt="The capital of France is", max_tokens=3, min_mean_logprob=-2.0)
    sim.start(Strategy(canary=1, steps=["50%", "100%"], probe=gate))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "GATE_FAILED" and "probe" in state.message
    assert [g.gate for g in state.gates if not g.passed] == ["probe"]
    assert sim.receivers(sim.published()) == ["w00", "w00"]
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0", "r1.rb.b0"]
    assert sim.versions()["w00"] == "v1"


def test_the_probe_gate_is_asked_of_the_workers_in_their_commands() -> None:
    """The workers run the probe only when the command asks for it (ReloadWeightsSpec.probe):
    without it, no answer ever comes back and the gate would judge nothing."""
    sim = Sim(3)
    gate = ProbeGate(prompt="The capital of France is", max_tokens=4, expect_tokens=[1, 2, 3, 4])
    sim.start(Strategy(canary=1, probe=gate))
    sim.decide()
    (command,) = sim.published()
    assert isinstance(command.spec, ReloadWeightsSpec)
    assert command.spec.probe is not None
    assert (command.spec.probe.prompt, command.spec.probe.max_tokens) == (gate.prompt, 4)


def test_expected_probe_tokens_and_agreement() -> None:
    tokens = {"w00": [1, 2], "w01": [1, 2], "w02": [1, 3]}

    def probe(command: Command, worker_id: str) -> dict[str, Any]:
        return {"tokens": tokens[worker_id], "mean_logprob": -1.0}

    sim = Sim(3, probe=probe)
    sim.start(Strategy(canary=2, probe=ProbeGate(prompt="p", max_tokens=2)))
    sim.run(sim.ended())
    state = sim.current()
    # w00 and w01 agree: the canary passes; w02 disagrees with them: the second wave fails.
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "GATE_FAILED" and "differently" in state.message
    assert [(g.wave, g.gate, g.passed) for g in state.gates][-1] == (1, "probe", False)

    expect = Sim(2, probe=probe)
    expect.start(Strategy(probe=ProbeGate(prompt="p", max_tokens=2, expect_tokens=[9, 9])))
    expect.run(expect.ended())
    assert expect.current().code == "GATE_FAILED"
    assert "expected [9, 9]" in expect.current().message


def test_a_runner_that_cannot_probe_fails_the_probe_gate() -> None:
    sim = Sim(2, probe=lambda c, w: {"unsupported": True})
    sim.start(Strategy(probe=ProbeGate(prompt="p")))
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == "GATE_FAILED" and "cannot run a probe" in state.message


def test_a_degraded_worker_during_the_bake_fails_the_health_gate() -> None:
    sim = Sim(4)
    sim.start(Strategy(canary=1, bake_s=10))
    sim.run(lambda: sim.workers["w00"].version == "v2")
    sim.workers["w00"].degraded = True
    sim.tick(1)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "GATE_FAILED" and "health gate" in state.message
    assert not sim.published("r1.w1.")


def test_the_bake_time_passes_before_the_next_wave() -> None:
    sim = Sim(4)
    sim.start(Strategy(canary=1, bake_s=10))
    sim.run(lambda: len(sim.published()) == 2)
    canary_done = min(t for t, c in sim.commands if c.rollout_id == "r1.w0.b0") + sim.delay
    second = next(t for t, c in sim.commands if c.rollout_id == "r1.w1.b0")
    assert second >= canary_done + 10


def test_a_pause_in_seconds_passes_between_waves() -> None:
    sim = Sim(4)
    sim.start(Strategy(canary=1, pause=20))
    sim.run(sim.ended())
    first, second = (t for t, _ in sim.commands)
    assert second - first >= 20
    assert sim.current().phase is PHASE.SUCCEEDED


def test_a_config_rollout_checks_the_workers_agree_on_their_config() -> None:
    sim = Sim(3)
    sim.start(
        Strategy(canary=1), desired=weights("v1", top_k=4).model_copy(update={"weights": None})
    )
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED, state.message
    assert all(isinstance(c.spec, UpdateConfigSpec) for c in sim.published())
    target = sim.control.target("llama")
    assert target is not None and target.stable == weights("v1", top_k=4)


def test_the_progress_deadline_aborts_a_wave_that_does_not_finish() -> None:
    sim = Sim(3, policy=lambda c, w: "silent")
    sim.start(Strategy(canary=1, progress_deadline_s=30))
    sim.run(sim.ended(), limit=100)
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "PROGRESS_DEADLINE_EXCEEDED"
    assert sim.t >= 30
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0"]


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
    _paused_after_canary(sim)
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
    assert command.rollout_id == sync_rollout_id("llama", V1, "w01", 1)
    # Not applied yet (the worker still reports v0): no second command for the same incarnation.
    for _ in range(5):
        sim.tick(1)
        assert not sim.decide().commands
    sim.restart("w01", version="v0")
    sim.tick(1)
    (again,) = sim.decide().commands
    assert again.selector.worker_ids == ["w01"] and again.rollout_id != command.rollout_id
    assert again.rollout_id == sync_rollout_id("llama", V1, "w01", 2)


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
    _paused_after_canary(sim)
    assert should_run(sim.control, target, "w00") is None  # in the wave being judged
    sim.act(ActionKind.PROMOTE)
    sim.decide()
    assert should_run(sim.control, target, "w00") == V2
    assert should_run(sim.control, target, "w01") is None
    assert should_run(sim.control, target, "w04") == V1
    assert should_run(sim.control, target, "new") == V1


def test_reconcile_alone_leaves_workers_in_sync_alone() -> None:
    sim = Sim(3)
    assert reconcile(sim.control, sim.fleet, sim.now) == []


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
    _paused_after_canary(sim)
    planned = sim.current().waves
    sim.workers["w09"] = Worker("w09")
    sim.beat()
    sim.act(ActionKind.PROMOTE)
    sim.run(sim.ended())
    assert sim.current().waves == planned
    assert planned == plan_waves(["w00", "w01", "w02", "w03"], Strategy(canary=1))
    assert "w09" not in sim.receivers(sim.published("r1"))


@pytest.mark.parametrize("code", ["TARGET_UNKNOWN", "TARGET_BUSY", "NO_MATCHING_WORKERS"])
def test_rejections_carry_a_local_code(code: str) -> None:
    assert LocalCode(code).value == code
