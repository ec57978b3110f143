"""Desired against actual, per target and per worker: what `controlplane targets` and the API show.

Pure (no I/O, time comes in as ``now``). A worker of a target should run the target's stable
state, or the rollout's new state once its wave has passed (:func:`~controlplane.rollout.
reconcile.ShouldRun`); what it runs is what its latest heartbeat reports. Drift is shown,
never silently accepted: a live, idle worker that runs something else is ``drifting`` (the
controller sends it a command for exactly what it should run), one whose heartbeats stopped is
``lost`` (whatever version it last reported), one matched by two targets is ``conflict``
(TARGET_CONFLICT: left alone).

Digest agreement: the target's live members (not lost, not in conflict) grouped by the version
and weights digest their heartbeats report (:class:`DigestGroup`, largest first: "98 at abc…,
2 at def…"); ``digests_disagree`` counts the versions whose live workers report more than one
digest (two versions are two groups, not a disagreement; workers that report no digest form a
group with ``digest`` None, which disagrees with no one).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.reconcile import ShouldRun, held
from controlplane.rollout.targets import ControlState, Target
from controlplane.wire.control import ControlPhase, Desired, RolloutState
from controlplane.wire.errors import LocalCode
from controlplane.wire.messages import WorkerStatus


class Alignment(StrEnum):
    IN_SYNC = "in_sync"
    #: Applying a command, or its wave is in progress.
    UPDATING = "updating"
    DRIFTING = "drifting"
    LOST = "lost"
    CONFLICT = "conflict"


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class WorkerAlignment(_Out):
    worker_id: str
    alive: bool
    reported_version: str | None
    #: The digest of the weights it holds, as its latest heartbeat reports (None: not reported).
    weights_digest: str | None = None
    #: None while a rollout is handling it (its wave is in progress).
    desired_version: str | None
    degraded: bool
    alignment: Alignment
    #: TARGET_CONFLICT for a worker two targets match (``targets``: their names).
    code: str | None = None
    targets: tuple[str, ...] = ()


class RolloutSummary(_Out):
    rollout_id: str
    phase: ControlPhase | None
    version: str | None
    wave: int
    waves: int
    code: str | None = None
    message: str = ""


class DigestGroup(_Out):
    """Live workers of a target that report the same version and the same weights digest."""

    version: str | None
    digest: str | None
    workers: int
    #: Their ids, sorted.
    worker_ids: tuple[str, ...]


class TargetStatus(_Out):
    name: str
    selector: dict[str, str]
    stable: Desired | None
    stable_version: str | None
    rollout: RolloutSummary | None
    workers: int
    at_stable: int
    at_new: int
    updating: int
    drifting: int
    lost: int
    conflicts: int
    members: tuple[WorkerAlignment, ...]
    as_of: AwareDatetime
    #: The live members by (version, weights digest), largest group first.
    digests: tuple[DigestGroup, ...] = ()
    #: How many versions the live members report with more than one weights digest (0: agree).
    digests_disagree: int = 0


def digest_groups(members: Iterable[WorkerAlignment]) -> tuple[DigestGroup, ...]:
    """``members`` grouped by (reported version, weights digest): the largest group first, then
    by version and digest (None last)."""
    by: dict[tuple[str | None, str | None], list[str]] = {}
    for m in members:
        by.setdefault((m.reported_version, m.weights_digest), []).append(m.worker_id)
    groups = [
        DigestGroup(version=v, digest=d, workers=len(ids), worker_ids=tuple(sorted(ids)))
        for (v, d), ids in by.items()
    ]
    groups.sort(
        key=lambda g: (
            -g.workers,
            g.version is None,
            g.version or "",
            g.digest is None,
            g.digest or "",
        )
    )
    return tuple(groups)


def disagreeing_versions(groups: Iterable[DigestGroup]) -> int:
    """How many versions appear in ``groups`` with two or more different (known) digests."""
    seen: dict[str | None, set[str]] = {}
    for g in groups:
        if g.digest is not None:
            seen.setdefault(g.version, set()).add(g.digest)
    return sum(1 for digests in seen.values() if len(digests) > 1)


def summary(state: RolloutState | None, rollout_id: str, version: str | None) -> RolloutSummary:
    return RolloutSummary(
        rollout_id=rollout_id,
        phase=None if state is None else state.phase,
        version=version,
        wave=0 if state is None else min(state.wave, len(state.waves)),
        waves=0 if state is None else len(state.waves),
        code=None if state is None else state.code,
        message="waiting for a controller" if state is None else state.message,
    )


def target_status(
    control: ControlState, fleet: Fleet, target: Target, now: datetime
) -> TargetStatus:
    stable = target.stable
    stable_version = None if stable is None else stable.version
    active = control.active(target.name)
    pending = next((r for r in control.rollouts(target.name) if r.state is None), None)
    shown = active or pending
    new_version = None
    rollout = None
    if shown is not None:
        new_version = shown.spec.desired.version
        rollout = summary(shown.state, shown.rollout_id, new_version)
    members: list[WorkerAlignment] = []
    hold = held(control, target)
    run = ShouldRun(target, active)
    for view in fleet.registry.matching(target.selector, now, alive_only=False):
        claims = tuple(sorted(t.name for t in control.targets_of(view.labels)))
        conflict = len(claims) > 1
        desired = stable if view.worker_id in hold else run(view.worker_id)
        version = None if desired is None else desired.version
        if conflict:
            alignment = Alignment.CONFLICT
        elif not view.alive:
            alignment = Alignment.LOST
        elif desired is None or view.in_flight is not None or view.status is WorkerStatus.BUSY:
            alignment = Alignment.UPDATING
        elif (
            view.degraded is not None
            or (desired.weights is not None and view.weights_version != version)
            or (desired.config_digest is not None and view.config_digest != desired.config_digest)
        ):
            alignment = Alignment.DRIFTING
        else:
            alignment = Alignment.IN_SYNC
        members.append(
            WorkerAlignment(
                worker_id=view.worker_id,
                alive=view.alive,
                reported_version=view.weights_version,
                weights_digest=view.weights_digest,
                desired_version=version,
                degraded=view.degraded is not None,
                alignment=alignment,
                code=LocalCode.TARGET_CONFLICT.value if conflict else None,
                targets=claims if conflict else (),
            )
        )
    live = [m for m in members if m.alive and m.alignment is not Alignment.CONFLICT]
    groups = digest_groups(live)
    return TargetStatus(
        name=target.name,
        selector=dict(target.spec.selector),
        stable=stable,
        stable_version=stable_version,
        rollout=rollout,
        workers=len(live),
        at_stable=sum(1 for m in live if stable_version and m.reported_version == stable_version),
        at_new=sum(
            1
            for m in live
            if new_version and new_version != stable_version and m.reported_version == new_version
        ),
        updating=sum(1 for m in members if m.alignment is Alignment.UPDATING),
        drifting=sum(1 for m in members if m.alignment is Alignment.DRIFTING),
        lost=sum(1 for m in members if m.alignment is Alignment.LOST),
        conflicts=sum(1 for m in members if m.alignment is Alignment.CONFLICT),
        members=tuple(members),
        as_of=now,
        digests=groups,
        digests_disagree=disagreeing_versions(groups),
    )


def targets_status(control: ControlState, fleet: Fleet, now: datetime) -> list[TargetStatus]:
    return [target_status(control, fleet, t, now) for t in control.targets()]
