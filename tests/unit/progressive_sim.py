"""A simulated fleet for the controller's pure decisions (tests/unit/test_progressive*.py).

:class:`Sim` holds what the controller reads (the controller topic's fold, a real
:class:`~controlplane.rollout.fleet.Fleet`) and plays the rest: every decision's commands go into
the fleet and its states into the fold, as the controller does once its transaction commits;
workers answer each command with real acks (succeeded, failed, or nothing) some ticks later and
send real heartbeats every tick, reporting the version they run. Time is injected: ``now`` is
``at(sim.t)``. Pure: no Kafka, no clock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.progressive import Decision, decide
from controlplane.rollout.targets import ControlState
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    ControlRecord,
    Desired,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    Strategy,
    TargetSpec,
    WeightsRef,
)
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    CommandKind,
    Heartbeat,
    ReloadWeightsSpec,
    UpdateConfigSpec,
)
from tests.factories import A, F, R, S, X, ack, at, heartbeat

LABELS = {"model": "llama"}
Outcome = Literal["ok", "fail", "reject", "silent"]
#: (command, worker id) -> how the worker answers it.
Policy = Callable[[Command, str], Outcome]
FleetEvent = Command | Ack | Heartbeat


def weights(version: str, **config: Any) -> Desired:
    return Desired(weights=WeightsRef(path=f"/ckpt/{version}", version=version), config=config)


V1, V2 = weights("v1"), weights("v2")


def always_ok(command: Command, worker_id: str) -> Outcome:
    return "ok"


def digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


@dataclass
class Worker:
    worker_id: str
    version: str | None = "v1"
    config: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=lambda: dict(LABELS))
    alive: bool = True
    incarnation: int = 1
    started: float = -100.0
    degraded: bool = False
    seq: int = 0


@dataclass
class _Reply:
    due: float
    command: Command
    worker_id: str
    outcome: Outcome


class Sim:
    """A target ``llama`` (stable ``stable``) over workers ``w00``.. and a controller's inputs."""

    def __init__(
        self,
        n: int = 10,
        *,
        stable: Desired | None = V1,
        policy: Policy = always_ok,
        delay: float = 1.0,
        probe: Callable[[Command, str], dict[str, Any] | None] | None = None,
        digest: Callable[[Command, str], str | None] | None = None,
        max_ended_rollouts: int | None = None,
    ) -> None:
        """``max_ended_rollouts``: the fleet keeps that many ended rollouts in full and
        summarizes the others at every tick, as the coordinator does."""
        self.t = 0.0
        self.control = ControlState()
        self.fleet = Fleet(max_ended_rollouts=max_ended_rollouts)
        self.workers = {f"w{i:02}": Worker(f"w{i:02}") for i in range(n)}
        self.policy = policy
        self.delay = delay
        self.probe = probe
        self.probes: dict[tuple[str, str], dict[str, Any]] = {}
        self.digest = digest
        self.digests: dict[tuple[str, str], str] = {}
        #: Every command decided, in order, with the time it was published.
        self.commands: list[tuple[float, Command]] = []
        self.states: list[RolloutState] = []
        #: Every record the fleet was fed, in order (commands, acks, heartbeats).
        self.events: list[FleetEvent] = []
        self.records: list[ControlRecord] = []
        self._pending: list[_Reply] = []
        self._actions = 0
        self.observe(
            TargetSpec(name="llama", selector=LABELS, stable=stable, issued_at=at(0), issuer="ops")
        )
        self.beat()

    @property
    def now(self) -> datetime:
        return at(self.t)

    # ------------------------------------------------------------------ inputs

    def observe(self, record: ControlRecord) -> None:
        self.records.append(record)
        self.control.observe(record)

    def feed(self, event: FleetEvent) -> None:
        self.events.append(event)
        if isinstance(event, Command):
            self.fleet.observe_command(event)
        elif isinstance(event, Ack):
            self.fleet.observe_ack(event)
        else:
            self.fleet.observe_heartbeat(event)

    def start(
        self, strategy: Strategy, desired: Desired = V2, rollout_id: str = "r1", **kw: Any
    ) -> RolloutSpec:
        spec = RolloutSpec(
            rollout_id=rollout_id,
            target=kw.pop("target", "llama"),
            desired=desired,
            strategy=strategy,
            issued_at=self.now,
            issuer="ops",
            **kw,
        )
        self.observe(spec)
        return spec

    def act(self, kind: ActionKind, rollout_id: str = "r1", **kw: Any) -> None:
        self._actions += 1
        self.observe(
            RolloutAction(
                rollout_id=rollout_id,
                action_id=f"a{self._actions}",
                action=kind,
                issued_at=self.now,
                issuer="ops",
                **kw,
            )
        )

    def heartbeat_of(self, worker: Worker) -> Heartbeat:
        worker.seq += 1
        hb = heartbeat(
            worker.worker_id,
            self.t,
            started=worker.started,
            seq=worker.seq,
            labels=worker.labels,
            version=worker.version,
            degraded=worker.degraded,
            incarnation=worker.incarnation,
        )
        if worker.config:
            hb = hb.model_copy(update={"config_digest": digest(worker.config)})
        return hb

    def beat(self) -> None:
        for worker in self.workers.values():
            if worker.alive:
                self.feed(self.heartbeat_of(worker))

    def restart(self, worker_id: str, version: str | None = None) -> None:
        """The worker restarts (its next incarnation), optionally from an older journal."""
        worker = self.workers[worker_id]
        worker.incarnation += 1
        worker.started = self.t
        worker.seq = 0
        if version is not None:
            worker.version = version

    # ------------------------------------------------------------------ the controller

    def decide(self, *, commit: bool = True) -> Decision:
        """The controller's decision now; committed (fed back) unless told not to."""
        decision = decide(
            self.control, self.fleet, self.now, probes=self.probes, digests=self.digests
        )
        if commit:
            for command in decision.commands:
                self.commands.append((self.t, command))
                self.feed(command)
                for worker_id in command.selector.worker_ids or []:
                    if worker_id not in self.workers:
                        continue  # no such worker: nobody answers
                    outcome = self.policy(command, worker_id)
                    self._pending.append(_Reply(self.t + self.delay, command, worker_id, outcome))
            for state in decision.states:
                self.states.append(state)
                self.observe(state)
        return decision

    # ------------------------------------------------------------------ the workers

    def tick(self, seconds: float = 1.0) -> None:
        """Time passes: due answers are sent, then every live worker's heartbeat."""
        self.t += seconds
        due = [r for r in self._pending if r.due <= self.t]
        self._pending = [r for r in self._pending if r.due > self.t]
        for reply in due:
            self._answer(reply)
        self.beat()
        self.fleet.compact(self.now)

    def _answer(self, reply: _Reply) -> None:
        worker = self.workers[reply.worker_id]
        if reply.outcome == "silent" or not worker.alive:
            return
        command, spec = reply.command, reply.command.spec
        kind = (
            CommandKind.RELOAD_WEIGHTS
            if isinstance(spec, ReloadWeightsSpec)
            else CommandKind.UPDATE_CONFIG
        )
        terminal: AckState = {"ok": S, "fail": F, "reject": X}[reply.outcome]
        if terminal is S:
            if isinstance(spec, ReloadWeightsSpec):
                worker.version = spec.version
            elif isinstance(spec, UpdateConfigSpec):
                worker.config = {**worker.config, **spec.overrides}
            answer = None if self.probe is None else self.probe(command, worker.worker_id)
            if answer is not None and isinstance(spec, ReloadWeightsSpec):
                self.probes[(command.rollout_id, worker.worker_id)] = answer
            held = None if self.digest is None else self.digest(command, worker.worker_id)
            if held is not None and isinstance(spec, ReloadWeightsSpec):
                self.digests[(command.rollout_id, worker.worker_id)] = held
        start = reply.due - 0.9
        steps = [(A, start), (R, start + 0.1), (terminal, start + 0.5)]
        for state, sent in steps if terminal is not X else [(X, start)]:
            self.feed(
                ack(
                    worker.worker_id,
                    state,
                    sent,
                    rollout_id=command.rollout_id,
                    command_id=command.command_id,
                    version=worker.version if state is S else None,
                    started=start + 0.1 if state in (R, S, F) else None,
                ).model_copy(update={"kind": kind})
            )

    # ------------------------------------------------------------------ driving

    def run(self, until: Callable[[], bool], *, limit: int = 200, step: float = 1.0) -> None:
        """Decide and tick until ``until()`` holds (checked after every decision)."""
        for _ in range(limit):
            self.decide()
            if until():
                return
            self.tick(step)
        raise AssertionError(f"not reached in {limit} steps; last state: {self.state()}")

    def state(self, rollout_id: str = "r1") -> RolloutState | None:
        rollout = self.control.rollout(rollout_id)
        return None if rollout is None else rollout.state

    def current(self, rollout_id: str = "r1") -> RolloutState:
        """The rollout's state (it must have one)."""
        state = self.state(rollout_id)
        assert state is not None, f"{rollout_id} has no state"
        return state

    def in_phase(self, phase: ControlPhase, rollout_id: str = "r1") -> Callable[[], bool]:
        def check() -> bool:
            state = self.state(rollout_id)
            return state is not None and state.phase is phase

        return check

    def ended(self, rollout_id: str = "r1") -> Callable[[], bool]:
        def check() -> bool:
            rollout = self.control.rollout(rollout_id)
            return rollout is not None and rollout.ended

        return check

    def published(self, prefix: str = "") -> list[Command]:
        return [c for _, c in self.commands if c.rollout_id.startswith(prefix)]

    def receivers(self, commands: Iterable[Command]) -> list[str]:
        return [w for c in commands for w in c.selector.worker_ids or []]

    def handed_out(self, prefix: str = "") -> set[str]:
        """Workers holding a command they have not answered yet and that has not expired
        (silent ones included), of the commands whose rollout id starts with ``prefix``."""
        now = self.now
        return {
            r.worker_id
            for r in self._pending
            if r.command.expires_at > now and r.command.rollout_id.startswith(prefix)
        }

    def most_applying(self, prefix: str = "") -> int:
        """From the acks' timings: the most workers applying a command at once (of the
        commands whose rollout id starts with ``prefix``)."""
        edges: list[tuple[datetime, int]] = []
        for event in self.events:
            if isinstance(event, Ack) and event.rollout_id.startswith(prefix):
                timings = event.timings
                if event.state.terminal and timings.started_at and timings.finished_at:
                    edges += [(timings.started_at, 1), (timings.finished_at, -1)]
        most = applying = 0
        for _, change in sorted(edges):  # an end before a start at the same instant
            applying += change
            most = max(most, applying)
        return most

    def versions(self) -> dict[str, str | None]:
        return {w.worker_id: w.version for w in self.workers.values()}
