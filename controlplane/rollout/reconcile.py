"""The reconcile loop: every live, idle worker of a target that runs something other than what it
should (the stable state, or the rollout's change once its wave is past) gets a command for
exactly that, once per (target state, worker incarnation, what it reported). Level-triggered,
like a Kubernetes controller. Pure.
"""

from __future__ import annotations

from collections.abc import Container
from datetime import datetime

from controlplane.rollout.decisions import (
    SYNC_TTL_S,
    Context,
    batch_over,
    batch_rollout_id,
    members,
    reload_spec,
    rollback_rollout_id,
    sync_rollout_id,
)
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.targets import ControlState, Rollout, Target, applied
from controlplane.rollout.waves import batches
from controlplane.wire.control import (
    ControlPhase,
    Desired,
)
from controlplane.wire.messages import (
    Command,
    CommandSpec,
    UpdateConfigSpec,
    WorkerStatus,
)


def should_run(control: ControlState, target: Target, worker_id: str) -> Desired | None:
    """What a worker of ``target`` should run now (None: a rollout is handling it)."""
    return ShouldRun(target, control.active(target.name))(worker_id)


class ShouldRun:
    """What each worker of ``target`` should run now, given its rollout in progress (if any):
    the stable state, the rollout's change once the worker's wave is past, or None while the
    rollout handles it. Built once per target per decision: each worker is then a dict lookup."""

    def __init__(self, target: Target, active: Rollout | None) -> None:
        self.stable = target.stable
        state = None if active is None else active.state
        self.state = state
        #: worker -> its wave, for a rollout in progress
        self.wave_of: dict[str, int] = {}
        self.change: Desired | None = None
        self.current_over = False
        if active is None or state is None:
            return
        for index, wave in enumerate(state.waves):
            self.wave_of.update(dict.fromkeys(wave, index))
        self.change = applied(self.stable, active.spec.desired)
        if state.wave < len(state.waves):
            plan = batches(state.waves[state.wave], active.spec.strategy.max_unavailable)
            self.current_over = state.batch >= len(plan)

    def __call__(self, worker_id: str) -> Desired | None:
        state = self.state
        index = self.wave_of.get(worker_id)
        if state is None or index is None:
            return self.stable
        if state.phase is ControlPhase.ROLLING_BACK:
            return None
        if index < state.wave:
            return self.change
        if index > state.wave:
            return self.stable
        # The wave in progress: its batches are the rollout's to hand out; once every one is
        # over, its workers run the change (one restarted from an old journal while its wave
        # waits to be healthy gets it back, rather than hold the wave to its deadline).
        return self.change if self.current_over else None


def held(control: ControlState, target: Target) -> frozenset[str]:
    """Workers the controller leaves as they are: those the target's latest rollout reached,
    when it ended ``aborted`` (``--no-rollback``, or a rollback that failed or had nothing to
    go back to): an operator said not to touch them, or has to look. Shown as drifting; a new
    rollout of the target (``rollout undo``, say) releases them."""
    started = [
        r.state
        for r in control.rollouts(target.name)
        if r.state is not None and r.state.phase is not ControlPhase.REJECTED
    ]
    if not started:
        return frozenset()
    last = started[-1]
    if last.phase is not ControlPhase.ABORTED:
        return frozenset()
    return frozenset(w for wave in last.waves[: last.wave + 1] for w in wave)


def reconcile(
    control: ControlState,
    fleet: Fleet,
    now: datetime,
    *,
    issuer: str = "controller",
    published: set[str] | None = None,
    skip: Container[str] = (),
) -> list[Command]:
    """A command for every live, idle worker of a target whose weights (or, once the target's
    config digest is known, config) differ from what it should run, once per (target state,
    worker incarnation, weights or config); nothing for one that conflicts,
    nor for one its rollout in progress counts as failed (retried once the rollout ended: a
    command now would apply beside the batches, beyond ``max_unavailable``). During a rollout
    with ``max_unavailable``, syncs only use what its batches leave of it. Targets in ``skip``
    are left for the next decision."""
    ctx = Context(control, fleet, {}, now, issuer, published if published is not None else set())
    for target in control.targets():
        if target.name in skip:
            continue
        hold = held(control, target)
        active = control.active(target.name)
        run = ShouldRun(target, active)
        #: During a rollout, syncs share its max_unavailable with its batches.
        budget: int | None = None
        workers = members(control, fleet, target, now)
        if active is not None and active.state is not None:
            hold = hold | frozenset(active.state.failed)
            limit = active.spec.strategy.max_unavailable
            if limit is not None:
                budget = max(0, limit - len(_applying(ctx, active, workers)))
        for worker_id in workers:
            if worker_id in hold:
                continue
            desired = run(worker_id)
            if desired is None:
                continue
            view = fleet.registry.latest(worker_id)
            if view is None or view.in_flight is not None or view.status is not WorkerStatus.READY:
                continue
            spec: CommandSpec
            reported: str | None
            if desired.weights is not None and view.weights_version != desired.weights.version:
                spec, kind, reported = reload_spec(desired), "weights", view.weights_version
            elif desired.config_digest is not None and view.config_digest != desired.config_digest:
                spec, kind = UpdateConfigSpec(overrides=dict(desired.config)), "config"
                reported = view.config_digest
            else:
                continue
            sync_id = sync_rollout_id(
                target.name, desired, worker_id, view.incarnation, kind, reported or "-"
            )
            if ctx.known(sync_id):
                continue
            if budget is not None:
                if budget <= 0:
                    continue  # the rollout's batches use its max_unavailable now
                budget -= 1
            ctx.publish(sync_id, [worker_id], spec, SYNC_TTL_S, None)
    return ctx.commands


def _applying(ctx: Context, active: Rollout, workers: list[str]) -> set[str]:
    """Workers of a target applying something now: busy ones, and those of the rollout's
    current batch (or rollback batch) once handed out and not over."""
    state = active.state
    assert state is not None
    out = set()
    for worker_id in workers:
        view = ctx.fleet.registry.latest(worker_id)
        if view is not None and (view.in_flight is not None or view.status is WorkerStatus.BUSY):
            out.add(worker_id)
    batch_id, batch = None, []
    if state.phase is ControlPhase.ROLLING_BACK:
        if state.rollback_batch < len(state.rollback):
            batch_id = rollback_rollout_id(state.rollout_id, state.rollback_batch)
            batch = state.rollback[state.rollback_batch]
    elif state.wave < len(state.waves):
        plan = batches(state.waves[state.wave], active.spec.strategy.max_unavailable)
        if state.batch < len(plan):
            batch_id = batch_rollout_id(state.rollout_id, state.wave, state.batch)
            batch = plan[state.batch]
    if batch_id is not None and ctx.known(batch_id) and not batch_over(ctx, batch_id):
        out.update(batch)
    return out
