"""The controller's decisions on failures and gates (controlplane/rollout/progressive.py), over a
simulated fleet (tests/unit/progressive_sim.py): max_failures, lost workers, the health,
agreement and probe gates, bake and pause times, the progress deadline. Pure: no Kafka.
"""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.progressive import decide
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    ProbeGate,
    Strategy,
)
from controlplane.wire.protocol import Ack, Command, ReloadWeightsSpec, UpdateConfigSpec
from tests.factories import feed
from tests.unit.progressive_sim import Outcome, Sim, digest, weights

PHASE = ControlPhase


def _fails(*workers: str) -> Any:
    def policy(command: Command, worker_id: str) -> Outcome:
        return "fail" if worker_id in workers and ".rb." not in command.rollout_id else "ok"

    return policy


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


def test_later_waves_are_judged_against_what_earlier_waves_agreed_on_without_their_acks() -> None:
    """A wave's passed gates record what it agreed on (weights digest, probe tokens); a later
    wave is judged against that, so the earlier waves' acks may be gone (30 days of retention
    during a long manual pause) without failing the gate, and a late worker that disagrees with
    the canary still fails it."""
    tokens = {"w00": [1, 2], "w01": [1, 2], "w02": [1, 3]}

    def probe(command: Command, worker_id: str) -> dict[str, Any]:
        return {"tokens": tokens[worker_id], "mean_logprob": -1.0}

    def held(command: Command, worker_id: str) -> str:
        return "d-" + str(tokens[worker_id])

    for late, passes in (([1, 2], True), ([1, 3], False)):
        tokens["w02"] = late
        sim = Sim(3, probe=probe, digest=held)
        sim.start(Strategy(canary=2, pause="manual", probe=ProbeGate(prompt="p", max_tokens=2)))
        sim.run(sim.in_phase(PHASE.PAUSED))
        assert [(g.gate, g.value) for g in sim.current().gates] == [
            ("health", None),
            ("agreement", "d-[1, 2]"),
            ("probe", "[1, 2]"),
        ]
        sim.probes.clear()  # the canary's acks are gone from the log
        sim.digests.clear()
        sim.act(ActionKind.PROMOTE, wave=0)
        sim.run(sim.ended())
        state = sim.current()
        if passes:
            assert state.phase is PHASE.SUCCEEDED, state.message
        else:
            assert state.phase is PHASE.ROLLED_BACK and state.code == "GATE_FAILED"
            # the digest differs first: w02 holds other weights than the earlier waves
            assert "earlier waves" in state.message and "w02" in state.message, state.message


def test_a_probe_answer_longer_than_asked_fails_the_gate_and_never_the_decision() -> None:
    """Every worker answered the same 600 tokens to a probe asking for 3: the runner ignored
    max_tokens. The gate fails with that said (a passed gate would record the answer, bounded
    on the wire: recording 600 tokens made the decision raise, aborting as INTERNAL)."""
    sim = Sim(2, probe=lambda c, w: {"tokens": list(range(600)), "mean_logprob": -1.0})
    sim.start(Strategy(probe=ProbeGate(prompt="p", max_tokens=3)))
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == "GATE_FAILED", state.message
    assert "answered 600 tokens, more than max_tokens 3" in state.message


def test_a_runner_that_cannot_probe_fails_the_probe_gate() -> None:
    sim = Sim(2, probe=lambda c, w: {"unsupported": True})
    sim.start(Strategy(probe=ProbeGate(prompt="p")))
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == "GATE_FAILED" and "cannot run a probe" in state.message


def test_a_worker_that_applied_without_answering_the_probe_fails_the_probe_gate() -> None:
    """The gate runs on each updated worker: one that gave no answer (a runner that ignored the
    probe, an answer lost) cannot be judged, so the gate fails rather than pass on the others."""
    answers = {"w01": {"tokens": [1], "mean_logprob": -0.1}}
    sim = Sim(4, probe=lambda c, w: answers.get(w))
    sim.start(Strategy(canary=1, probe=ProbeGate(prompt="p")))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "GATE_FAILED" and "probe answer" in state.message
    assert "w00" in state.message
    assert [(g.wave, g.gate, g.passed) for g in state.gates] == [(0, "probe", False)]
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0", "r1.rb.b0"]


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
    assert target is not None and target.stable == weights("v1", top_k=4).model_copy(
        update={"config_digest": digest({"top_k": 4})}  # learnt from the updated workers
    )


def test_the_progress_deadline_aborts_a_wave_that_does_not_finish() -> None:
    sim = Sim(3, policy=lambda c, w: "silent")
    sim.start(Strategy(canary=1, progress_deadline_s=30))
    sim.run(sim.ended(), limit=100)
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "PROGRESS_DEADLINE_EXCEEDED"
    assert sim.t >= 30
    assert [c.rollout_id for c in sim.published()] == ["r1.w0.b0"]


def _lose_in_second_wave(sim: Sim, worker_id: str) -> None:
    """Run until the second wave's first batch is published, then ``worker_id`` dies."""
    sim.run(lambda: len(sim.published()) == 2)
    sim.workers[worker_id].alive = False


def test_a_lost_worker_is_a_tolerated_failure_not_a_stalled_wave() -> None:
    """A worker that died with its batch counts as failed once it is lost (three missed
    heartbeats), and the wave goes on: waiting for its command to expire would hold the wave
    until the progress deadline aborts it, whatever ``max_failures`` says."""
    sim = Sim(6)
    sim.start(Strategy(canary=1, max_unavailable=2, max_failures="1", progress_deadline_s=120))
    _lose_in_second_wave(sim, "w01")
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED, state.message
    assert state.failed == ["w01"]
    assert sim.t < 60
    assert sorted(sim.receivers(sim.published())) == sorted(sim.workers)
    assert not sim.published("r1.rb.")


def test_a_lost_worker_beyond_max_failures_aborts_at_once() -> None:
    sim = Sim(6)
    sim.start(Strategy(canary=1, max_unavailable=2, progress_deadline_s=600))
    _lose_in_second_wave(sim, "w01")
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "MAX_FAILURES_EXCEEDED" and state.failed == ["w01"]
    assert sim.t < 60
    # w02 (its batch mate) applied: rolled back with the canary. w01 never acked, but its
    # command is live: back before it expires, it would apply v2, so its rollback is queued
    # behind that command (one partition: it applies both, in order).
    assert sorted(sim.receivers(sim.published("r1.rb."))) == ["w00", "w01", "w02"]
    assert "w01 lost: each applies its rollback command when it returns" in state.message
    assert not sim.published("r1.w1.b1")


def test_a_worker_lost_once_its_command_expired_gets_no_rollback() -> None:
    """Once its batch's command expired (the fleet judged that batch over), a lost worker can
    no longer apply the change: the rollback leaves it alone."""
    sim = Sim(6)
    strategy = Strategy(
        canary=1,
        steps=["50%", "100%"],
        max_unavailable=2,
        max_failures="1",
        progress_deadline_s=120,
        pause="manual",
    )
    sim.start(strategy)
    sim.act(ActionKind.PROMOTE, wave=0)
    _lose_in_second_wave(sim, "w01")
    sim.run(lambda: sim.t > 130)  # w01 counted failed, tolerated; its batch's command expires
    assert sim.current().phase is PHASE.PAUSED and sim.current().wave == 1
    sim.act(ActionKind.ABORT)
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK, state.message
    rolled = sim.receivers(sim.published("r1.rb."))
    assert "w01" not in rolled and "w00" in rolled and "w02" in rolled
    assert "lost" not in state.message


def test_failures_and_rollback_survive_the_fleet_summarizing_ended_batches() -> None:
    """The coordinator's fleet keeps only the last ``max_ended_rollouts`` ended rollouts in
    full: a long rollout's first batches lose their per-worker details while it runs. Its
    failures must still count, and its rollback still reach every worker that applied."""

    def policy(command: Command, worker_id: str) -> Outcome:
        if command.rollout_id.startswith("r1.w"):
            return "fail" if worker_id in ("w01", "w06") else "ok"
        return "ok"

    sim = Sim(7, policy=policy, max_ended_rollouts=1)
    sim.start(Strategy(max_unavailable=1, max_failures="1"))
    sim.run(sim.ended())
    state = sim.current()
    assert state.code == "MAX_FAILURES_EXCEEDED", state.message
    assert state.failed == ["w01", "w06"]
    assert sorted(sim.receivers(sim.published("r1.rb."))) == ["w00", "w02", "w03", "w04", "w05"]
    assert state.phase is PHASE.ROLLED_BACK


def test_a_failed_rollback_batch_counts_once_the_fleet_summarized_it() -> None:
    def policy(command: Command, worker_id: str) -> Outcome:
        return "fail" if ".rb." in command.rollout_id and worker_id == "w00" else "ok"

    sim = Sim(4, policy=policy, max_ended_rollouts=1)
    sim.start(Strategy(canary=3, max_unavailable=1, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT)
    sim.run(sim.ended())
    state = sim.current()
    assert len(sim.published("r1.rb.")) == 3
    assert state.phase is PHASE.ABORTED and state.code == "ROLLBACK_FAILED"
    assert "w00" in state.message


@pytest.mark.parametrize(
    "answer",
    [
        {"tokens": ["x"], "mean_logprob": -1.0},
        {"tokens": [1, None], "mean_logprob": -1.0},
        {"tokens": 7, "mean_logprob": -1.0},
        {"tokens": [1], "mean_logprob": "high"},
        {"tokens": [1], "mean_logprob": None},
        {"tokens": [1], "mean_logprob": [1]},
        {"tokens": [1.5], "mean_logprob": -1.0},
        {"tokens": [True], "mean_logprob": -1.0},
    ],
)
def test_a_malformed_probe_answer_fails_the_gate_without_breaking_the_decision(
    answer: dict[str, Any],
) -> None:
    """Probe answers come from the workers' acks: whatever one says, the decision is made and
    the gate fails with the reason (an exception here would stop the controller for good)."""
    sim = Sim(3, probe=lambda c, w: answer if w == "w00" else {"tokens": [1], "mean_logprob": -1})
    sim.start(Strategy(canary=1, probe=ProbeGate(prompt="p", min_mean_logprob=-2.0)))
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.ROLLED_BACK
    assert state.code == "GATE_FAILED" and "w00" in state.message, state.message


def test_a_worker_lost_after_it_applied_is_a_tolerated_failure_not_a_stalled_wave() -> None:
    """Dead before its wave's gates: it counts as failed, as one lost before its ack does; not a
    wait for it until the progress deadline aborts the rollout, whatever ``max_failures`` says."""
    sim = Sim(6)
    sim.start(Strategy(canary=1, max_failures="1", bake_s=20, progress_deadline_s=120))
    sim.run(lambda: sim.workers["w00"].version == "v2")
    sim.workers["w00"].alive = False
    sim.run(sim.ended())
    state = sim.current()
    assert state.phase is PHASE.SUCCEEDED, state.message
    assert state.failed == ["w00"]
    assert sim.t < 60
    assert sorted(sim.receivers(sim.published())) == sorted(sim.workers)


def test_a_worker_lost_after_it_applied_beyond_max_failures_aborts() -> None:
    sim = Sim(6)
    sim.start(Strategy(canary=2, bake_s=20, progress_deadline_s=600))
    sim.run(lambda: sim.workers["w01"].version == "v2")
    sim.workers["w01"].alive = False
    sim.run(sim.ended())
    state = sim.current()
    assert state.failed == ["w01"] and "more than max_failures 0" in state.message
    assert sim.t < 60
    assert not sim.published("r1.w1.")
    # w01 applied, but dead it cannot take a command: the rollback is for w00 alone, and w01
    # is left to the reconciler (it gets the stable state back when it returns).
    assert sorted(sim.receivers(sim.published("r1.rb."))) == ["w00"]
    assert state.phase is PHASE.ROLLED_BACK and state.code == "MAX_FAILURES_EXCEEDED"


def test_a_rollback_reaches_the_workers_of_batches_gone_from_the_log() -> None:
    """Commands and acks have a retention time: after a long pause, a restarted controller may
    no longer read the first batches. It moved past them, so they were over, and their workers
    not counted failed had applied the change: they are rolled back, not forgotten."""
    sim = Sim(4)
    sim.start(Strategy(canary=1, pause="manual"))
    sim.run(sim.in_phase(PHASE.PAUSED))
    sim.act(ActionKind.ABORT)
    fleet = Fleet()  # what a restarted controller reads once the canary's records expired
    for event in sim.events:
        if not isinstance(event, Command | Ack) or event.rollout_id != "r1.w0.b0":
            feed(fleet, [event])
    decision = decide(sim.control, fleet, sim.now)
    assert [(c.rollout_id, c.selector.worker_ids) for c in decision.commands] == [
        ("r1.rb.b0", ["w00"])
    ]
    assert decision.states[-1].phase is PHASE.ROLLING_BACK
