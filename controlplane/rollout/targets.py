"""The fold of the controller topic: targets, their stable state and history, progressive rollouts.

Pure: no I/O, no clock. Every reader (the controller, the coordinator's API, the CLI) folds the
same records in the same order (one partition) and gets the same answer. Records are
idempotent: a rollout's state keeps the highest ``revision`` seen, so the controller may fold
its own writes before a reader's fetch brings them back.

A target's stable state is the fold's result, in log order: its spec's ``stable`` when one is
given, then each of its rollouts that ended ``succeeded`` (weights replaced when the rollout
changed them, config keys overlaid). Its history is that sequence; ``rollout undo`` rolls out
the entry before the last.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    ControlRecord,
    Desired,
    LeaderRecord,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    TargetSpec,
)
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.messages import Selector


def applied(stable: Desired | None, change: Desired) -> Desired:
    """``stable`` with ``change`` applied: its weights when it has some, its config keys overlaid
    (the config's digest is then the change's: unknown until workers report it)."""
    if stable is None:
        return change
    return Desired(
        weights=change.weights if change.weights is not None else stable.weights,
        config={**stable.config, **change.config},
        config_digest=change.config_digest if change.config else stable.config_digest,
    )


def reverting(current: Desired, previous: Desired) -> Desired | None:
    """The one change (a rollout changes weights or config) that takes ``current`` back to
    ``previous``: the previous weights when they differ, else the previous value of each config
    key that differs. None when nothing would (a key ``previous`` lacks cannot be unset)."""
    if previous.weights is not None and previous.weights != current.weights:
        return Desired(weights=previous.weights)
    back = {
        k: v
        for k, v in previous.config.items()
        if k not in current.config or current.config[k] != v
    }
    return Desired(config=back) if back else None


@dataclass(frozen=True, slots=True)
class StableEntry:
    """One stable state a target had, and what made it stable (a spec, or a rollout)."""

    desired: Desired
    rollout_id: str | None
    since: datetime


@dataclass(slots=True)
class Target:
    spec: TargetSpec
    history: list[StableEntry] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stable(self) -> Desired | None:
        return self.history[-1].desired if self.history else None

    def undo(self) -> tuple[Desired, str | None]:
        """What `rollout undo` rolls out: the one change back to the previous stable state, and
        the rollout it reverts. ROLLBACK_UNAVAILABLE when there is none."""
        previous = self.previous
        change = None if previous is None else reverting(self.history[-1].desired, previous.desired)
        if previous is None or change is None:
            raise ControlPlaneError(
                f"target {self.name} has no previous stable state to go back to"
                if previous is None
                else f"nothing takes target {self.name} back to its previous stable state (it "
                "differs only by config keys the previous state did not set)",
                code=LocalCode.ROLLBACK_UNAVAILABLE,
            )
        return change, self.history[-1].rollout_id

    @property
    def previous(self) -> StableEntry | None:
        """The stable state before the current one (what ``undo`` goes back to)."""
        return self.history[-2] if len(self.history) >= 2 else None

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.spec.selector.items())

    @property
    def selector(self) -> Selector:
        return Selector(labels=dict(self.spec.selector))


@dataclass(slots=True)
class Rollout:
    spec: RolloutSpec
    #: Position among the rollouts in log order (the controller starts them in this order).
    seq: int
    actions: list[RolloutAction] = field(default_factory=list)
    state: RolloutState | None = None

    @property
    def rollout_id(self) -> str:
        return self.spec.rollout_id

    @property
    def phase(self) -> ControlPhase | None:
        """None: not started by a controller yet."""
        return None if self.state is None else self.state.phase

    @property
    def ended(self) -> bool:
        return self.state is not None and self.state.phase.terminal

    def count(self, kind: ActionKind) -> int:
        return sum(1 for action in self.actions if action.action is kind)

    @property
    def abort(self) -> RolloutAction | None:
        """The first abort asked for, if any."""
        return next((a for a in self.actions if a.action is ActionKind.ABORT), None)

    def action_wave(self, kind: ActionKind) -> int | None:
        """The wave an action of ``kind`` sent now is about: for a promote, the wave in
        progress (its pause is the one released); None for the others."""
        if kind is not ActionKind.PROMOTE:
            return None
        return 0 if self.state is None else self.state.wave

    @property
    def operator_paused(self) -> bool:
        """Whether the last pause or resume asked for was a pause."""
        for action in reversed(self.actions):
            if action.action is ActionKind.PAUSE:
                return True
            if action.action is ActionKind.RESUME:
                return False
        return False


class ControlState:
    """Everything the controller topic says. Feed it records in log order; ask it questions."""

    def __init__(self) -> None:
        self._targets: dict[str, Target] = {}
        self._rollouts: dict[str, Rollout] = {}
        self.leader: LeaderRecord | None = None
        self.records = 0
        #: Actions for a rollout not seen (yet): kept until it comes (a compacted log keeps order,
        #: so it should not happen; a hand-written record might).
        self._early_actions: dict[str, list[RolloutAction]] = {}
        #: Stable states made by rollouts of a target whose spec comes later in the log.
        self._early_stables: dict[str, list[StableEntry]] = {}

    def observe(self, record: ControlRecord) -> None:
        self.records += 1
        match record:
            case TargetSpec():
                self._observe_target(record)
            case RolloutSpec():
                if record.rollout_id not in self._rollouts:
                    rollout = Rollout(record, seq=len(self._rollouts))
                    rollout.actions.extend(self._early_actions.pop(record.rollout_id, []))
                    self._rollouts[record.rollout_id] = rollout
            case RolloutAction():
                self._observe_action(record)
            case RolloutState():
                self._observe_state(record)
            case LeaderRecord():
                if self.leader is None or record.generation >= self.leader.generation:
                    self.leader = record

    def _observe_target(self, spec: TargetSpec) -> None:
        target = self._targets.get(spec.name)
        if target is None:
            target = self._targets[spec.name] = Target(spec)
            target.history.extend(self._early_stables.pop(spec.name, []))
        else:
            target.spec = spec
        if spec.stable is not None:
            stable = applied(target.stable, spec.stable)  # weights replaced, config overlaid
            if stable != target.stable:
                target.history.append(StableEntry(stable, None, spec.issued_at))

    def _observe_action(self, action: RolloutAction) -> None:
        rollout = self._rollouts.get(action.rollout_id)
        actions = (
            rollout.actions
            if rollout is not None
            else self._early_actions.setdefault(action.rollout_id, [])
        )
        if all(a.action_id != action.action_id for a in actions):
            actions.append(action)

    def _observe_state(self, state: RolloutState) -> None:
        rollout = self._rollouts.get(state.rollout_id)
        if rollout is None:
            return  # a state without its rollout: nothing to attach it to
        if rollout.state is not None and state.revision <= rollout.state.revision:
            return  # already folded (the controller's own write, read back)
        if rollout.ended:
            return  # ended is ended, whatever a later record says
        was_ended = rollout.ended
        rollout.state = state
        if state.phase is ControlPhase.SUCCEEDED and not was_ended:
            target = self._targets.get(rollout.spec.target)
            base = None if target is None else target.stable
            desired = state.result or applied(base, rollout.spec.desired)
            entry = StableEntry(desired, rollout.rollout_id, state.ended_at or state.updated_at)
            if target is not None:
                target.history.append(entry)
            else:  # compaction kept this, not the target's older spec: its spec comes later
                self._early_stables.setdefault(rollout.spec.target, []).append(entry)

    # ------------------------------------------------------------------ questions

    def target(self, name: str) -> Target | None:
        return self._targets.get(name)

    def targets(self) -> list[Target]:
        return sorted(self._targets.values(), key=lambda t: t.name)

    def rollout(self, rollout_id: str) -> Rollout | None:
        return self._rollouts.get(rollout_id)

    def known_target(self, name: str, *, create: str) -> Target:
        """The target ``name``, or TARGET_UNKNOWN saying how to ``create`` it."""
        target = self._targets.get(name)
        if target is None:
            raise ControlPlaneError(
                f"no target {name!r}; create it with {create}", code=LocalCode.TARGET_UNKNOWN
            )
        return target

    def known_rollout(self, rollout_id: str, *, hint: str = "") -> Rollout:
        """The progressive rollout ``rollout_id``, or ROLLOUT_UNKNOWN (``hint``: where to look)."""
        rollout = self._rollouts.get(rollout_id)
        if rollout is None:
            raise ControlPlaneError(
                f"no progressive rollout {rollout_id!r} in the log{hint}",
                code=LocalCode.ROLLOUT_UNKNOWN,
            )
        return rollout

    def actionable(self, rollout_id: str, action: str, *, hint: str = "") -> Rollout:
        """The rollout an operator's ``action`` is for: known, and not ended (ROLLOUT_ENDED)."""
        rollout = self.known_rollout(rollout_id, hint=hint)
        if rollout.ended:
            phase = rollout.phase.value if rollout.phase else "ended"
            raise ControlPlaneError(
                f"rollout {rollout_id} has ended ({phase}): nothing to {action}",
                code=LocalCode.ROLLOUT_ENDED,
            )
        return rollout

    def rollouts(self, target: str | None = None) -> list[Rollout]:
        """In log order; of one target when ``target`` is given."""
        every = sorted(self._rollouts.values(), key=lambda r: r.seq)
        return [r for r in every if target is None or r.spec.target == target]

    def open_rollouts(self) -> Iterator[Rollout]:
        """Rollouts not ended, in log order (those not started yet included)."""
        return (r for r in self.rollouts() if not r.ended)

    def busy(self, target: str) -> Rollout | None:
        """The rollout that keeps another one of ``target`` from starting: the one started and
        not ended, else the first one requested and not started yet."""
        return self.active(target) or next(
            (r for r in self.rollouts(target) if r.state is None), None
        )

    def check_start(self, spec: RolloutSpec) -> None:
        """What `rollout start` (CLI and API) checks before it appends ``spec``: its target
        exists (TARGET_UNKNOWN), its id is new (ROLLOUT_EXISTS), no other rollout of the target
        runs or waits (TARGET_BUSY). The controller checks again when it starts the rollout (two
        operators may race)."""
        if self.target(spec.target) is None:
            raise ControlPlaneError(
                f"no target {spec.target!r}; create it first (`controlplane targets set`)",
                code=LocalCode.TARGET_UNKNOWN,
            )
        if self.rollout(spec.rollout_id) is not None:
            raise ControlPlaneError(
                f"rollout {spec.rollout_id!r} already exists in the log",
                code=LocalCode.ROLLOUT_EXISTS,
            )
        busy = self.busy(spec.target)
        if busy is not None:
            raise ControlPlaneError(
                f"rollout {busy.rollout_id} is in progress on target {spec.target}; wait for "
                "it to end, or abort it",
                code=LocalCode.TARGET_BUSY,
            )

    def active(self, target: str) -> Rollout | None:
        """The target's started, not ended rollout, if any."""
        for rollout in self.rollouts(target):
            if rollout.state is not None and not rollout.ended:
                return rollout
        return None

    def targets_of(self, labels: dict[str, str]) -> list[Target]:
        """Every target whose selector matches these labels (more than one: a conflict)."""
        return [t for t in self._targets.values() if t.matches(labels)]
