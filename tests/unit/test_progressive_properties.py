"""Properties of the controller's decisions (controlplane/rollout/progressive.py) over random
rollouts of a simulated fleet (tests/unit/progressive_sim.py): an ended rollout never reopens,
batches respect ``max_unavailable``, no worker gets a wave's command twice, and the same acks and
heartbeats folded in any order give the same decision. Pure: no Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.progressive import decide, held
from controlplane.rollout.targets import ControlState
from controlplane.wire.control import ActionKind, ControlPhase, ProbeGate, RolloutState, Strategy
from controlplane.wire.protocol import Ack, Command
from tests.factories import at
from tests.unit.progressive_sim import V1, Outcome, Sim, weights
from tests.unit.strategies import fuzz

STEPS = st.lists(st.sampled_from(["1", "2", "25%", "50%", "75%"]), max_size=3).map(
    lambda s: [*s, "100%"]
)
rollout_strategies = st.builds(
    Strategy,
    canary=st.integers(0, 3),
    steps=STEPS,
    max_unavailable=st.one_of(st.none(), st.integers(1, 3)),
    pause=st.one_of(st.just(0.0), st.just(3.0), st.just("manual")),
    max_failures=st.sampled_from(["0", "1", "2", "50%"]),
    bake_s=st.sampled_from([0.0, 2.0]),
    progress_deadline_s=st.sampled_from([8.0, 30.0]),
    probe=st.one_of(st.none(), st.just(ProbeGate(prompt="p", min_mean_logprob=-2.0))),
)
OUTCOMES: list[Outcome] = ["ok", "ok", "ok", "fail", "reject", "silent"]
ACTIONS = [ActionKind.PAUSE, ActionKind.RESUME, ActionKind.PROMOTE, ActionKind.ABORT]


@dataclass
class Scenario:
    n: int
    strategy: Strategy
    outcomes: dict[str, Outcome]
    rollback_outcomes: dict[str, Outcome]
    logprobs: dict[str, float]
    delay: float
    actions: dict[int, list[ActionKind]]
    deaths: dict[int, str]
    #: tick -> a worker that restarts then, from an old journal (it reports v1 again)
    restarts: dict[int, str]
    #: The simulated coordinator's fleet summarizes ended rollouts beyond this many.
    max_ended_rollouts: int | None


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    n = draw(st.integers(1, 6))
    workers = [f"w{i:02}" for i in range(n)]
    return Scenario(
        n=n,
        strategy=draw(rollout_strategies),
        outcomes={w: draw(st.sampled_from(OUTCOMES)) for w in workers},
        rollback_outcomes={w: draw(st.sampled_from(["ok", "ok", "fail"])) for w in workers},
        logprobs={w: draw(st.sampled_from([-1.0, -1.0, -5.0])) for w in workers},
        delay=draw(st.sampled_from([1.0, 2.0, 4.0])),
        actions=draw(
            st.dictionaries(
                st.integers(0, 40), st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=2)
            )
        ),
        deaths=draw(st.dictionaries(st.integers(1, 40), st.sampled_from(workers), max_size=1)),
        restarts=draw(st.dictionaries(st.integers(1, 40), st.sampled_from(workers), max_size=2)),
        max_ended_rollouts=draw(st.sampled_from([None, 0, 2])),
    )


def simulate(scenario: Scenario) -> Sim:
    def policy(command: Command, worker_id: str) -> Outcome:
        if command.rollout_id.startswith("sync-"):
            return "ok"
        if ".rb." in command.rollout_id:
            return scenario.rollback_outcomes[worker_id]
        return scenario.outcomes[worker_id]

    return Sim(
        scenario.n,
        policy=policy,
        delay=scenario.delay,
        probe=lambda c, w: {"tokens": [1], "mean_logprob": scenario.logprobs[w]},
        max_ended_rollouts=scenario.max_ended_rollouts,
    )


def _step(sim: Sim, scenario: Scenario, tick: int) -> None:
    for kind in scenario.actions.get(tick, []):
        sim.act(kind)
    dead = scenario.deaths.get(tick)
    if dead is not None:
        sim.workers[dead].alive = False
    restarted = scenario.restarts.get(tick)
    if restarted is not None:
        sim.restart(restarted, version="v1")


@fuzz(60)
@given(scenario=scenarios())
def test_an_ended_rollout_never_reopens(scenario: Scenario) -> None:
    sim = simulate(scenario)
    sim.start(scenario.strategy)
    ended: RolloutState | None = None
    seen_batches: set[str] = set()
    revision = -1
    ended_at = 0
    for tick in range(300):
        _step(sim, scenario, tick)
        if tick == 80:
            sim.act(ActionKind.ABORT)  # whatever happened, it ends
        if ended is not None and tick % 7 == 0:
            sim.act(ActionKind.RESUME)
            sim.act(ActionKind.PROMOTE)
        decision = sim.decide()
        limit = scenario.strategy.max_unavailable
        assert limit is None or len(sim.handed_out("r1.")) <= limit, sim.handed_out("r1.")
        for state in decision.states:
            assert ended is None, f"ended {ended.phase} rollout moved again: {state.phase}"
            assert state.revision == revision + 1
            revision = state.revision
        for command in decision.commands:
            if command.rollout_id.startswith("r1."):
                assert ended is None, f"ended {ended.phase} rollout published {command.rollout_id}"
                size = len(command.selector.worker_ids or [])
                assert limit is None or size <= limit
                assert command.rollout_id not in seen_batches
                seen_batches.add(command.rollout_id)
        current = sim.state()
        if ended is None and current is not None and current.phase.terminal:
            ended, ended_at = current, tick
        if ended is not None:
            assert sim.state() == ended
        if ended is not None and tick > ended_at + 30:
            break
        sim.tick(1)
    assert ended is not None, f"never ended: {sim.state()}"
    wave_receivers = sim.receivers(c for c in sim.published("r1.w"))
    assert len(wave_receivers) == len(set(wave_receivers)), "a worker got a wave twice"
    rollback_receivers = sim.receivers(sim.published("r1.rb."))
    assert len(rollback_receivers) == len(set(rollback_receivers))
    assert set(rollback_receivers) <= set(wave_receivers)
    # Then every live worker converged on the target's stable state, but those an aborted
    # rollout left as they were (held).
    target = sim.control.target("llama")
    assert target is not None and target.stable is not None
    hold = held(sim.control, target)
    for worker in sim.workers.values():
        if worker.alive and worker.worker_id not in hold:
            assert worker.version == target.stable.version, (worker, ended.phase)


@fuzz(50)
@given(scenario=scenarios(), ticks=st.integers(0, 40), data=st.data())
def test_any_order_of_the_same_events_redelivered_or_not_gives_the_same_decision(
    scenario: Scenario, ticks: int, data: st.DataObject
) -> None:
    sim = simulate(scenario)
    sim.start(scenario.strategy)
    for tick in range(ticks):
        _step(sim, scenario, tick)
        sim.decide()
        sim.tick(1)
    _step(sim, scenario, ticks)
    redelivered = data.draw(st.lists(st.sampled_from(sim.events), max_size=20))
    events = data.draw(st.permutations(sim.events + redelivered))
    fleet = Fleet(max_ended_rollouts=scenario.max_ended_rollouts)
    for event in events:
        if isinstance(event, Command):
            fleet.observe_command(event)
        elif isinstance(event, Ack):
            fleet.observe_ack(event)
        else:
            fleet.observe_heartbeat(event)
    # Summarized as the simulated coordinator's fleet was, tick after tick (the same rollouts:
    # ended ones beyond the newest few). A batch summarized before any decision saw it end
    # loses which of its workers failed: the same summaries on both sides, then.
    fleet.compact(sim.now)
    control = ControlState()
    for record in sim.records:
        control.observe(record)
    in_order = decide(sim.control, sim.fleet, sim.now, probes=sim.probes)
    shuffled = decide(control, fleet, sim.now, probes=dict(reversed(list(sim.probes.items()))))
    assert shuffled == in_order


_POOL = ["w00", "w01", "w02", "w03", "w09"]
_workers = st.lists(st.sampled_from(_POOL), max_size=4, unique=True)


@st.composite
def logged_states(draw: st.DrawFn) -> RolloutState:
    """Any state record the controller topic may hold for r1 (hand-written ones included)."""
    return RolloutState(
        rollout_id="r1",
        target=draw(st.sampled_from(["llama", "other"])),
        revision=draw(st.integers(0, 5)),
        phase=draw(st.sampled_from(list(ControlPhase))),
        waves=draw(st.lists(_workers, max_size=3)),
        wave=draw(st.integers(0, 4)),
        batch=draw(st.integers(0, 4)),
        wave_done_at=draw(st.one_of(st.none(), st.just(at(0)))),
        wave_started_at=draw(st.one_of(st.none(), st.just(at(0)))),
        promoted=draw(st.integers(0, 2)),
        failed=draw(_workers),
        previous=draw(st.sampled_from([None, V1, weights("v0", top_k=1)])),
        rollback=draw(st.lists(_workers, max_size=2)),
        rollback_batch=draw(st.integers(0, 3)),
        started_at=at(0),
        updated_at=at(0),
    )


@fuzz(100)
@given(state=logged_states(), strategy=rollout_strategies, ticks=st.integers(0, 6))
def test_decide_never_raises_whatever_state_the_log_holds(
    state: RolloutState, strategy: Strategy, ticks: int
) -> None:
    sim = Sim(4)
    sim.start(strategy)
    sim.observe(state)
    for _ in range(ticks):
        sim.decide()
        sim.tick(1)
    for decided in sim.states:
        assert decided.revision > state.revision
