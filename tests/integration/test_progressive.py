"""Progressive rollouts end to end on the real broker: a coordinator's controller, in-process
agents with the fake runner, operator requests on the controller topic (issue 12).

Separate processes (a coordinator SIGKILLed or SIGSTOPped) are in test_controller_process.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from controlplane.coordinator.publisher import publish_control
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.bus import Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.desired import Alignment, TargetStatus, target_status
from controlplane.rollout.models import WorkerState
from controlplane.rollout.progressive import batch_rollout_id
from controlplane.rollout.targets import Rollout
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Desired,
    RolloutAction,
    RolloutSpec,
    Strategy,
    TargetSpec,
    WeightsRef,
)
from controlplane.wire.errors import BusError
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    decode_ack,
    decode_command,
    utcnow,
)
from tests.factories import agent_running, agent_settings
from tests.fleet import wait_for
from tests.integration.test_bus_publish import create_topic
from workers.agent.loop import Agent
from workers.runners.fake_runner import FakeRunner

pytestmark = pytest.mark.kafka

LABELS = {"model": "tiny"}
T = TypeVar("T")


@dataclass
class Fleet:
    kafka: KafkaSettings
    coordinator: Coordinator
    agents: dict[str, Agent]
    runners: dict[str, FakeRunner]
    ckpts: Path
    tasks: dict[str, asyncio.Task[None]]
    killed: list[asyncio.Task[None]] = field(default_factory=list)

    async def start_agent(
        self, worker: str, tmp_path: Path, options: dict[str, Any], initial: str = "v1"
    ) -> Agent:
        """An agent of worker ``worker`` (its journal in ``tmp_path/state-<worker>``: a
        restarted worker finds its old journal), ready."""
        runner = FakeRunner({"initial_version": initial, **options})
        settings = agent_settings(
            self.kafka, tmp_path, worker_id=worker, state_dir=tmp_path / f"state-{worker}"
        )
        agent = Agent(settings, runner)
        task = asyncio.create_task(agent.run(), name=f"agent-{worker}")
        self.agents[worker], self.runners[worker], self.tasks[worker] = agent, runner, task
        await asyncio.wait_for(agent.ready.wait(), 60)
        return agent

    def kill(self, worker: str) -> None:
        """Gone at once, as if SIGKILLed: no drain, no ack, no more heartbeats. (Its runner's
        thread finishes the reload in the background; nothing reports it.)"""
        task = self.tasks.pop(worker)
        task.cancel()
        self.killed.append(task)

    async def stop_all(self) -> None:
        for worker in list(self.tasks):
            self.agents[worker].request_stop()
        await asyncio.gather(*self.tasks.values(), *self.killed, return_exceptions=True)
        self.tasks.clear()

    def weights(self, version: str) -> WeightsRef:
        return WeightsRef(path=str(self.ckpts / "model.safetensors"), version=version)

    async def send(self, record: Any) -> None:
        await publish_control(self.kafka, record)

    async def target(self, name: str = "tiny", stable: str = "v1") -> None:
        await self.send(
            TargetSpec(
                name=name,
                selector=LABELS,
                stable=Desired(weights=self.weights(stable)),
                issued_at=utcnow(),
                issuer="tests",
            )
        )

    async def rollout(self, rollout_id: str, version: str, strategy: Strategy, **kw: Any) -> None:
        await self.send(
            RolloutSpec(
                rollout_id=rollout_id,
                target=kw.pop("target", "tiny"),
                desired=Desired(weights=self.weights(version)),
                strategy=strategy,
                issued_at=utcnow(),
                issuer="tests",
                **kw,
            )
        )

    async def act(self, rollout_id: str, action: ActionKind, n: int = 1) -> None:
        await self.send(
            RolloutAction(
                rollout_id=rollout_id,
                action_id=f"{action.value}-{n}",
                action=action,
                issued_at=utcnow(),
                issuer="tests",
            )
        )

    def rollout_of(self, rollout_id: str) -> Rollout:
        rollout = self.coordinator.control.rollout(rollout_id)
        assert rollout is not None
        return rollout

    async def phase(
        self, rollout_id: str, *phases: ControlPhase, timeout: float = 60.0
    ) -> ControlPhase:
        def reached() -> bool:
            rollout = self.coordinator.control.rollout(rollout_id)
            return rollout is not None and rollout.phase in phases

        await wait_for(reached, timeout)
        phase = self.rollout_of(rollout_id).phase
        assert phase is not None
        return phase


@contextlib.asynccontextmanager
async def fleet_of(
    kafka: KafkaSettings, tmp_path: Path, n: int, *, runner: dict[str, Any] | None = None
) -> AsyncIterator[Fleet]:
    """``n`` in-process agents (fake runner at v1, labels model=tiny), then a coordinator whose
    controller leads; every agent still running is stopped when the block ends."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "model.safetensors").write_bytes(b"\0" * 64)
    settings = CoordinatorSettings(kafka=kafka, controller_session_timeout_ms=6000)
    fleet = Fleet(kafka, None, {}, {}, ckpts, {})  # type: ignore[arg-type]
    try:
        await asyncio.gather(
            *(fleet.start_agent(f"w{i:02d}", tmp_path, runner or {}) for i in range(n))
        )
        async with Coordinator(settings) as coordinator:
            fleet.coordinator = coordinator
            await coordinator.wait_ready(60)
            await wait_for(lambda: len(coordinator.fleet.registry) == n, 60)
            controller = coordinator.controller
            assert controller is not None
            await wait_for(lambda: controller.leading is not None, 60)
            yield fleet
    finally:
        await fleet.stop_all()


async def wait_until_ok(call: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> None:
    """Until ``call()`` stops raising BusError (a topic just created is not in every broker's
    metadata at once)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await call()
            return
        except BusError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def read_all(kafka: KafkaSettings, topic: str, decode: Callable[[bytes], T]) -> list[T]:
    """Every record of ``topic`` up to its end now (read_committed), decoded."""
    items: list[T] = []
    async with Consumer(kafka) as consumer:
        await consumer.assign(topic)
        await consumer.seek_to_beginning()
        ends = await consumer.end_offsets(topic)

        def done() -> bool:
            progress = consumer.progress()
            return all(
                end == 0
                or ((p := progress.get((topic, part))) is not None and (p.position or 0) >= end)
                for part, end in ends.items()
            )

        while not done():
            for record in await consumer.fetch(timeout_s=0.2):
                if record.value is not None:
                    items.append(decode(record.value))
    return items


async def commands_on_the_topic(kafka: KafkaSettings) -> list[Command]:
    return await read_all(kafka, kafka.topics.commands.name, decode_command)


def applying_windows(acks: Sequence[Ack]) -> list[tuple[datetime, datetime]]:
    windows = []
    for ack in acks:
        t = ack.timings
        if ack.state is AckState.SUCCEEDED and t.started_at and t.finished_at:
            windows.append((t.started_at, t.finished_at))
    return windows


async def test_a_four_wave_rollout_updates_every_worker_once_wave_by_wave(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 10) as fleet:
        await fleet.target()
        strategy = Strategy(canary=1, steps=["10%", "50%", "100%"], max_unavailable=2)
        await fleet.rollout("r-four", "v2", strategy)
        assert await fleet.phase("r-four", ControlPhase.SUCCEEDED) is ControlPhase.SUCCEEDED
        state = fleet.rollout_of("r-four").state
        assert state is not None
        assert [len(w) for w in state.waves] == [1, 4, 5]  # 10% of 10 adds nobody after 1
        target = fleet.coordinator.control.target("tiny")
        assert target is not None and target.stable is not None
        assert target.stable.version == "v2"
        assert all(r.history == ["v1", "v2"] for r in fleet.runners.values())
        commands = [
            c for c in await commands_on_the_topic(kafka) if c.rollout_id.startswith("r-four")
        ]
        per_worker: dict[str, int] = {}
        for command in commands:
            for worker in command.selector.worker_ids or []:
                per_worker[worker] = per_worker.get(worker, 0) + 1
            assert len(command.selector.worker_ids or []) <= 2
        assert per_worker == dict.fromkeys(fleet.agents, 1)
        assert commands[0].rollout_id == batch_rollout_id("r-four", 0, 0)
        # max_unavailable=2: never more than 2 applying at once, by the acks' own timings
        acks = await read_all(kafka, kafka.topics.acks.name, decode_ack)
        windows = applying_windows([a for a in acks if a.rollout_id.startswith("r-four")])
        assert len(windows) == 10
        for start, _ in windows:
            overlapping = [w for w in windows if w[0] <= start < w[1]]
            assert len(overlapping) <= 2


def workers_commanded(commands: Sequence[Command], prefix: str) -> dict[str, list[str]]:
    """Worker id -> the rollout ids of the commands (of rollouts starting with ``prefix``) for it."""
    out: dict[str, list[str]] = {}
    for command in commands:
        if command.rollout_id.startswith(prefix):
            for worker in command.selector.worker_ids or []:
                out.setdefault(worker, []).append(command.rollout_id)
    return out


async def test_a_wave_over_max_failures_aborts_and_every_updated_worker_is_back_on_stable(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 10) as fleet:
        for worker in ("w03", "w04"):  # v2 fails on these two (the fake runner's fail prefix)
            fleet.runners[worker].options = fleet.runners[worker].options.model_copy(
                update={"fail_prefix": "v2"}
            )
        await fleet.target()
        strategy = Strategy(steps=["30%", "100%"], max_failures="1")
        await fleet.rollout("r-fail", "v2", strategy)
        assert await fleet.phase("r-fail", ControlPhase.ROLLED_BACK, ControlPhase.ABORTED) is (
            ControlPhase.ROLLED_BACK
        )
        state = fleet.rollout_of("r-fail").state
        assert state is not None
        assert state.code == "MAX_FAILURES_EXCEEDED" and state.failed == ["w03", "w04"]
        applied = sorted(w for w, r in fleet.runners.items() if "v2" in r.history)
        assert applied == ["w00", "w01", "w02", "w05", "w06", "w07", "w08", "w09"]
        rolled_back = sorted(w for batch in state.rollback for w in batch)
        assert rolled_back == applied  # exactly the workers that had applied v2
        for worker, runner in fleet.runners.items():
            assert runner.history[-1] == "v1", worker
        target = fleet.coordinator.control.target("tiny")
        assert target is not None and target.stable is not None
        assert target.stable.version == "v1"  # an aborted rollout never becomes stable


async def test_a_manual_pause_waits_for_promote(kafka: KafkaSettings, tmp_path: Path) -> None:
    async with fleet_of(kafka, tmp_path, 4) as fleet:
        await fleet.target()
        await fleet.rollout("r-manual", "v2", Strategy(canary=1, pause="manual"))
        await fleet.phase("r-manual", ControlPhase.PAUSED)
        commanded = workers_commanded(await commands_on_the_topic(kafka), "r-manual")
        assert commanded == {"w00": [batch_rollout_id("r-manual", 0, 0)]}
        assert [r.history[-1] for r in fleet.runners.values()] == ["v2", "v1", "v1", "v1"]
        await fleet.act("r-manual", ActionKind.PROMOTE)
        await fleet.phase("r-manual", ControlPhase.SUCCEEDED)
        assert [r.history[-1] for r in fleet.runners.values()] == ["v2"] * 4


async def test_abort_during_a_pause_rolls_the_canary_back(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 3) as fleet:
        await fleet.target()
        await fleet.rollout("r-abort", "v2", Strategy(canary=1, pause="manual"))
        await fleet.phase("r-abort", ControlPhase.PAUSED)
        await fleet.act("r-abort", ActionKind.ABORT)
        assert await fleet.phase("r-abort", ControlPhase.ROLLED_BACK) is ControlPhase.ROLLED_BACK
        state = fleet.rollout_of("r-abort").state
        assert state is not None and state.code == "ABORTED_BY_OPERATOR"
        commanded = workers_commanded(await commands_on_the_topic(kafka), "r-abort")
        assert commanded == {"w00": ["r-abort.w0.b0", "r-abort.rb.b0"]}
        assert [r.history for r in fleet.runners.values()] == [["v1", "v2", "v1"], ["v1"], ["v1"]]
        # ended is ended: a promote now changes nothing
        await fleet.act("r-abort", ActionKind.PROMOTE)
        revision = state.revision
        await fleet.target("other-target-to-wake-the-controller")
        await wait_for(
            lambda: (
                fleet.coordinator.control.target("other-target-to-wake-the-controller") is not None
            )
        )
        final = fleet.rollout_of("r-abort").state
        assert final is not None and final.revision == revision


async def test_a_worker_that_joins_later_converges_to_the_stable_state(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 2) as fleet:
        await fleet.target()
        await fleet.rollout("r-join", "v2", Strategy())
        await fleet.phase("r-join", ControlPhase.SUCCEEDED)
        late = FakeRunner({"initial_version": "v1"})
        settings = agent_settings(kafka, tmp_path, worker_id="w-late", state_dir=tmp_path / "late")
        async with agent_running(settings, late):
            await wait_for(lambda: late.history[-1:] == ["v2"], 60)
        assert late.history == ["v1", "v2"]


async def test_38_of_40_applied_2_killed_targets_shows_it_and_the_2_converge_when_restarted(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """The issue's case: the 38 that applied are in sync (not red), the 2 dead ones are lost
    (not "busy" and "in sync"); restarted from their old journals, they converge."""
    dying = ("w07", "w23")
    async with fleet_of(kafka, tmp_path, 40) as fleet:
        for worker in dying:  # slow enough to be killed mid-apply
            fleet.runners[worker].options = fleet.runners[worker].options.model_copy(
                update={"reload_delay_s": 20.0}
            )
        await fleet.target()
        await fleet.rollout("r-38", "v2", Strategy(max_failures="5%"))

        def running(worker: str) -> bool:
            batch = batch_rollout_id("r-38", 0, 0)
            if batch not in fleet.coordinator.fleet:
                return False
            detail = fleet.coordinator.fleet.status(batch, fleet.coordinator.now()).worker(worker)
            return detail is not None and detail.state is WorkerState.RUNNING

        await wait_for(lambda: all(running(w) for w in dying), 60)
        for worker in dying:
            fleet.kill(worker)
        assert await fleet.phase("r-38", ControlPhase.SUCCEEDED, timeout=90) is (
            ControlPhase.SUCCEEDED
        )
        state = fleet.rollout_of("r-38").state
        assert state is not None and state.failed == sorted(dying)

        def status() -> TargetStatus:
            control, coordinator = fleet.coordinator.control, fleet.coordinator
            target = control.target("tiny")
            assert target is not None
            return target_status(control, coordinator.fleet, target, coordinator.now())

        await wait_for(lambda: status().at_stable == 38, 30)
        shown = status()
        assert (shown.stable_version, shown.workers, shown.lost, shown.drifting) == ("v2", 38, 2, 0)
        alignment = {m.worker_id: m.alignment for m in shown.members}
        assert {w for w, a in alignment.items() if a is Alignment.LOST} == set(dying)
        assert {w for w, a in alignment.items() if a is Alignment.IN_SYNC} == (
            set(fleet.runners) - set(dying)
        )

        for worker in dying:  # back from their old journals, still on v1
            await fleet.start_agent(worker, tmp_path, {})
        await wait_for(lambda: status().at_stable == 40, 60)
        assert all(fleet.runners[w].history == ["v1", "v2"] for w in dying)
        assert status().lost == 0 and status().drifting == 0


async def test_a_fleet_without_the_controller_topic_keeps_its_coordinator_serving(
    kafka_bootstrap: str,
) -> None:
    """Topics made before the controller's (an older `topics ensure`): the coordinator follows
    the three channels as before and says the controller is off, instead of failing to start."""
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, topic_prefix=f"old{uuid.uuid4().hex[:8]}"
    )
    for spec in settings.topics.all():
        await create_topic(kafka_bootstrap, spec.name, spec.config, partitions=spec.partitions)
    async with Consumer(settings) as consumer:  # until every broker's metadata has them
        for spec in settings.topics.all():
            await wait_until_ok(functools.partial(consumer.partitions, spec.name))
    async with Coordinator(CoordinatorSettings(kafka=settings)) as coordinator:
        await coordinator.wait_ready(60)
        assert coordinator.follower.control_missing
        assert coordinator.ready and coordinator.control.targets() == []


async def test_a_fenced_controller_steps_down_and_leads_again_from_the_log(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """Another producer inits the controller's transactional id (a coordinator that believes it
    leads): the controller's next transaction is refused, it says CONTROLLER_FENCED, steps down
    and, elected again, carries the rollout on from the log."""
    from controlplane.kafka.transactions import TransactionalProducer

    async with fleet_of(kafka, tmp_path, 2) as fleet:
        controller = fleet.coordinator.controller
        assert controller is not None
        await fleet.target()
        usurper = TransactionalProducer(kafka, kafka.topics.controller_transactional_id)
        await usurper.start()  # fences the controller's producer
        try:
            await fleet.rollout("r-fenced", "v2", Strategy())
            await wait_for(lambda: controller.fenced >= 1, 60)
            assert controller.last_error is not None
            assert controller.last_error.startswith("CONTROLLER_FENCED")
        finally:
            await usurper.stop()
        assert await fleet.phase("r-fenced", ControlPhase.SUCCEEDED, timeout=90) is (
            ControlPhase.SUCCEEDED
        )
        assert [r.history for r in fleet.runners.values()] == [["v1", "v2"]] * 2
