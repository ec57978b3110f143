"""What the controller's decisions are made of: the context one decision reads (the control
topic's fold, the fleet's, the probe answers and weights digests of batch acks, the instant), the
commands it collects, deterministic rollout ids, and the states a rollout moves through.
Pure, like the rest of the controller (controlplane/rollout/progressive.py has the rules).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Literal, TypeVar

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutStatus, WorkerState
from controlplane.rollout.targets import ControlState, Rollout, Target
from controlplane.rollout.waves import batches
from controlplane.wire.control import (
    ControlPhase,
    Desired,
    ProbeGate,
    RolloutState,
)
from controlplane.wire.errors import CommandRejected
from controlplane.wire.messages import (
    Command,
    CommandSpec,
    ProbeSpec,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
)

T = TypeVar("T")


#: What the controller does to a command before it is published: signs it with the
#: coordinator's key and checks it with its own trust store, raising CommandRejected (with the
#: verifier's code) for one the coordinator would fold as unverified and every worker refuse.
Seal = Callable[[Command], Command]


#: A state's message and a gate's are bounded on the wire (4096 characters): long lists of
#: workers, a worker's own error text, are cut to this.
MESSAGE_CHARS: Final = 1000


#: Workers named in one message; the rest are counted.
NAMED_WORKERS: Final = 10


def clip(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def named(workers: list[str]) -> str:
    """``a, b, c`` for a few workers; the first ``NAMED_WORKERS`` and "and N more" for many."""
    if len(workers) <= NAMED_WORKERS:
        return ", ".join(workers)
    return f"{', '.join(workers[:NAMED_WORKERS])} and {len(workers) - NAMED_WORKERS} more"


#: How long a reconcile (drift) command may wait to be applied before it expires.
SYNC_TTL_S: Final = 3600.0


FAILED_STATES: Final = frozenset({WorkerState.FAILED, WorkerState.REJECTED, WorkerState.LOST})


Gate = Literal["health", "agreement", "probe"]


#: (rollout id, worker id) -> the ``probe`` of the worker's succeeded ack for that rollout.
Probes = Mapping[tuple[str, str], Mapping[str, Any]]


#: (rollout id, worker id) -> the ``weights_digest`` of the worker's succeeded ack for it.
Digests = Mapping[tuple[str, str], str]


def batch_rollout_id(rollout_id: str, wave: int, batch: int) -> str:
    return f"{rollout_id}.w{wave}.b{batch}"


def rollback_rollout_id(rollout_id: str, batch: int) -> str:
    return f"{rollout_id}.rb.b{batch}"


def sync_rollout_id(
    target: str,
    desired: Desired,
    worker_id: str,
    incarnation: int,
    kind: str = "weights",
    reported: str | None = None,
) -> str:
    """One sync per (target state, worker, incarnation, what it changes, what the worker
    reported): a worker that drifts again (a plain reload aimed at it, a stable state that
    came back through undo) gets another."""
    what = "" if kind == "weights" else f"\0{kind}"
    seen = "" if reported is None else f"\0{reported}"
    digest = hashlib.sha256(
        f"{target}\0{desired.model_dump_json()}\0{worker_id}\0{incarnation}{what}{seen}".encode()
    ).hexdigest()
    return f"sync-{digest[:24]}"


@dataclass
class Decision:
    """What to write, in this order, in one transaction."""

    commands: list[Command] = field(default_factory=list)
    states: list[RolloutState] = field(default_factory=list)
    #: Commands not published: the seal refused them (syncs; a progressive rollout whose
    #: command is refused ends aborted with the refusal's code instead).
    refused: list[tuple[Command, CommandRejected]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.commands or self.states)


@dataclass
class Context:
    control: ControlState
    fleet: Fleet
    probes: Probes
    now: datetime
    issuer: str
    published: set[str] = field(default_factory=set)
    commands: list[Command] = field(default_factory=list)
    digests: Digests = field(default_factory=dict)
    #: Applied to each command before it counts as published (None: as built).
    seal: Seal | None = None
    #: Batch statuses judged in this decision (the fleet does not change during one).
    _statuses: dict[str, RolloutStatus] = field(default_factory=dict)
    #: rollout id -> worker -> the rollout id of its batch (waves never change once planned).
    _batch_of: dict[str, dict[str, str]] = field(default_factory=dict)

    def batch_of(self, rollout: Rollout, state: RolloutState) -> dict[str, str]:
        """Each worker of the rollout's waves -> its batch's rollout id, once per decision."""
        index = self._batch_of.get(state.rollout_id)
        if index is None:
            index = {}
            for wave_index, wave in enumerate(state.waves):
                plan = batches(wave, rollout.spec.strategy.max_unavailable)
                for batch_index, members_ in enumerate(plan):
                    batch_id = batch_rollout_id(state.rollout_id, wave_index, batch_index)
                    index.update(dict.fromkeys(members_, batch_id))
            if state.waves:  # not planned yet: nothing to keep
                self._batch_of[state.rollout_id] = index
        return index

    def known(self, rollout_id: str) -> bool:
        return rollout_id in self.published or rollout_id in self.fleet

    def status(self, rollout_id: str) -> RolloutStatus:
        """The fleet's status of a command's rollout, judged once per decision."""
        status = self._statuses.get(rollout_id)
        if status is None:
            status = self._statuses[rollout_id] = self.fleet.status(rollout_id, self.now)
        return status

    def publish(
        self,
        rollout_id: str,
        workers: list[str],
        spec: CommandSpec,
        ttl_s: float,
        timeout_s: float | None,
    ) -> None:
        """Publish a command under ``rollout_id``; CommandRejected (nothing published) when
        the seal refuses it."""
        command = Command(
            command_id=f"{rollout_id}.a1",
            rollout_id=rollout_id,
            issued_at=self.now,
            expires_at=self.now + timedelta(seconds=ttl_s),
            issuer=self.issuer,
            selector=Selector(worker_ids=sorted(workers)),
            spec=spec,
            timeout_s=timeout_s,
        )
        if self.seal is not None:
            command = self.seal(command)
        self.published.add(rollout_id)
        self.commands.append(command)


def members(control: ControlState, fleet: Fleet, target: Target, now: datetime) -> list[str]:
    """Live workers of ``target``, sorted: matched by its selector and by no other target's."""
    registry = fleet.registry
    out = []
    for hb in registry.heartbeats():  # heartbeats, not views: this runs at every decision
        if (
            target.matches(hb.labels)
            and registry.is_alive(hb.worker_id, now)
            and len(control.targets_of(hb.labels)) == 1
        ):
            out.append(hb.worker_id)
    return sorted(out)


def conflicts(control: ControlState, fleet: Fleet, now: datetime) -> dict[str, list[str]]:
    """Live workers matched by two targets or more (left alone: ``TARGET_CONFLICT``)."""
    out = {}
    registry = fleet.registry
    for hb in registry.heartbeats():  # heartbeats, not views: this runs at every decision
        names = [t.name for t in control.targets_of(hb.labels)]
        if len(names) > 1 and registry.is_alive(hb.worker_id, now):
            out[hb.worker_id] = sorted(names)
    return out


def over(status: RolloutStatus) -> bool:
    """Whether a batch is over for the controller: it ended, or each of its workers acked an
    end or is lost. Lost is provisional for the fleet (the command ends only when it expires),
    but a dead worker must not hold a wave until its deadline: it counts as failed, against
    ``max_failures``, from then on."""
    return status.terminal or all(d.state.terminal for d in status.workers)


def batch_over(ctx: Context, batch_id: str) -> bool:
    return batch_id in ctx.fleet and over(ctx.status(batch_id))


def end_state(
    state: RolloutState, phase: ControlPhase, code: str | None, why: str, now: datetime
) -> RolloutState:
    """``code``: why it ended other than in success (a rolled back rollout keeps its abort's)."""
    return state.model_copy(
        update={
            "phase": phase,
            "code": None if code is None else str(code),
            "message": clip(why),
            "ended_at": now,
        }
    )


def paused_state(state: RolloutState, why: str) -> RolloutState:
    return state.model_copy(update={"phase": ControlPhase.PAUSED, "message": clip(why)})


def progressing_state(state: RolloutState, why: str) -> RolloutState:
    return state.model_copy(update={"phase": ControlPhase.PROGRESSING, "message": clip(why)})


def reload_spec(desired: Desired) -> ReloadWeightsSpec:
    """The reload to ``desired``'s weights, with their drain and cache policy (each omitted on
    the wire when the desired state does not give it)."""
    assert desired.weights is not None
    w = desired.weights
    return ReloadWeightsSpec(
        path=w.path,
        version=w.version,
        sha256=dict(w.sha256),
        strict=w.strict,
        drain=w.drain,
        reset_cache=w.reset_cache,
    )


def change_spec(change: Desired, probe: ProbeGate | None = None) -> CommandSpec:
    """The command of a rollout's change: a reload when it changes weights (asking for the
    strategy's probe), else the config."""
    if change.weights is not None:
        reload = reload_spec(change)
        if probe is None:
            return reload
        asked = ProbeSpec(prompt=probe.prompt, max_tokens=probe.max_tokens)
        return reload.model_copy(update={"probe": asked})
    return UpdateConfigSpec(overrides=dict(change.config))
