"""Abort and rollback (rule 6 of controlplane/rollout/progressive.py): once the commands handed
out are over, every worker that applied the rollout's change gets the target's previous stable
state back, in batches of ``max_unavailable``, tracked as part of the same rollout. Pure.
"""

from __future__ import annotations

from datetime import datetime

from controlplane.rollout.decisions import (
    Context,
    batch_over,
    batch_rollout_id,
    clip,
    end_state,
    named,
    over,
    reload_spec,
    rollback_rollout_id,
)
from controlplane.rollout.models import WorkerState
from controlplane.rollout.targets import Rollout
from controlplane.rollout.waves import batches
from controlplane.wire.control import (
    ControlPhase,
    Desired,
    RolloutState,
)
from controlplane.wire.errors import LocalCode
from controlplane.wire.messages import (
    CommandSpec,
    UpdateConfigSpec,
)


def updated_workers(
    ctx: Context, state: RolloutState, max_unavailable: int | None
) -> tuple[list[str], bool]:
    """Workers that applied this rollout's change, and whether every batch handed out ended."""
    done: set[str] = set()
    ended = True
    for wave_index, wave in enumerate(state.waves):
        plan = batches(wave, max_unavailable)
        for batch_index, members_ in enumerate(plan):
            batch_id = batch_rollout_id(state.rollout_id, wave_index, batch_index)
            passed = (wave_index, batch_index) < (state.wave, state.batch)
            if batch_id not in ctx.fleet:
                if ctx.known(batch_id):
                    ended = False  # published in this very decision
                elif passed:  # gone from the log (retention), but it was over: as summarized
                    done.update(w for w in members_ if w not in state.failed)
                continue
            status = ctx.status(batch_id)
            ended = ended and over(status)
            if status.details_dropped:  # summarized: each worker of it not counted failed applied
                done.update(w for w in members_ if w not in state.failed)
                continue
            done.update(d.worker_id for d in status.workers if d.state is WorkerState.SUCCEEDED)
    return sorted(done), ended


def aborting(
    state: RolloutState, code: LocalCode, why: str, rollback: bool, now: datetime
) -> RolloutState:
    if not rollback:
        return end_state(state, ControlPhase.ABORTED, code, why, now)
    return state.model_copy(
        update={"phase": ControlPhase.ROLLING_BACK, "code": code.value, "message": clip(why)}
    )


def roll_back(ctx: Context, rollout: Rollout, state: RolloutState) -> RolloutState:
    spec = rollout.spec
    if not state.rollback:
        updated, ended = updated_workers(ctx, state, spec.strategy.max_unavailable)
        if not ended:
            return state  # commands already handed out finish first
        # Lost before it acked, with its batch's command still live: back before the command
        # expires, it would apply the change. Its rollback command comes after that command on
        # the (one-partition) commands topic, so it applies the rollback right after.
        late = _may_still_apply(ctx, state)
        back = rollback_spec(state.previous, spec.desired)
        if not updated and (not late or back is None):
            why = f"{state.message}; no worker had applied it"
            if late:
                why += f" ({named(late)} lost with its command live: see `targets`)"
            return end_state(state, ControlPhase.ROLLED_BACK, state.code, why, ctx.now)
        if back is None:
            return _unavailable(state, spec.desired, ctx.now)
        # A worker lost since it applied cannot take a command now; back from the dead, it
        # reports the new state and the reconciler gives it the stable one (not held: rolled back).
        alive = [w for w in updated if ctx.fleet.registry.is_alive(w, ctx.now)]
        if not alive and not late:
            why = f"{state.message}; the workers that had applied it are lost: " + (
                "each gets the stable state back when it returns"
            )
            return end_state(state, ControlPhase.ROLLED_BACK, state.code, why, ctx.now)
        plan = batches(sorted({*alive, *late}), spec.strategy.max_unavailable)
        return state.model_copy(update={"rollback": plan, "rollback_batch": 0})
    if state.rollback_batch >= len(state.rollback):
        failed = _rollback_failures(ctx, state)
        if failed:
            why = f"{state.message}; rollback failed on {named(failed)}"
            return end_state(state, ControlPhase.ABORTED, LocalCode.ROLLBACK_FAILED, why, ctx.now)
        why = f"{state.message}; rolled back"
        lost = _lost_in_rollback(ctx, state)
        if lost:
            why += f" ({named(lost)} lost: each applies its rollback command when it returns)"
        return end_state(state, ControlPhase.ROLLED_BACK, state.code, why, ctx.now)
    batch_id = rollback_rollout_id(spec.rollout_id, state.rollback_batch)
    if not ctx.known(batch_id):
        back = rollback_spec(state.previous, spec.desired)
        if back is None:  # checked when the rollback was planned, unless the log says otherwise
            return _unavailable(state, spec.desired, ctx.now)
        ctx.publish(
            batch_id,
            state.rollback[state.rollback_batch],
            back,
            spec.strategy.progress_deadline_s,
            spec.strategy.command_timeout_s,
        )
        return state
    if batch_over(ctx, batch_id):
        return state.model_copy(update={"rollback_batch": state.rollback_batch + 1})
    return state


def _may_still_apply(ctx: Context, state: RolloutState) -> list[str]:
    """Workers lost before acking a batch of this rollout whose command has not expired (its
    rollout is not over for the fleet): each may still come back and apply the change."""
    out: set[str] = set()
    for wave_index, wave in enumerate(state.waves):
        for batch_index in range(len(wave)):
            batch_id = batch_rollout_id(state.rollout_id, wave_index, batch_index)
            if batch_id not in ctx.fleet:
                continue
            status = ctx.status(batch_id)
            if not status.terminal:
                out.update(d.worker_id for d in status.workers if d.state is WorkerState.LOST)
    return sorted(out)


def _lost_in_rollback(ctx: Context, state: RolloutState) -> list[str]:
    lost: list[str] = []
    for index in range(len(state.rollback)):
        batch_id = rollback_rollout_id(state.rollout_id, index)
        if batch_id in ctx.fleet:
            status = ctx.status(batch_id)
            lost.extend(d.worker_id for d in status.workers if d.state is WorkerState.LOST)
    return sorted(lost)


def _unavailable(state: RolloutState, change: Desired, now: datetime) -> RolloutState:
    previous = state.previous
    if change.weights is not None or previous is None:
        what = "the target had no stable weights"
    else:
        missing = sorted(k for k in change.config if k not in previous.config)
        what = f"the target's stable state has no value for {', '.join(missing)}"
    why = f"{state.message}; nothing to roll back to ({what})"
    return end_state(state, ControlPhase.ABORTED, LocalCode.ROLLBACK_UNAVAILABLE, why, now)


def _rollback_failures(ctx: Context, state: RolloutState) -> list[str]:
    failed: list[str] = []
    for index, members_ in enumerate(state.rollback):
        batch_id = rollback_rollout_id(state.rollout_id, index)
        if batch_id not in ctx.fleet:  # never seen: nothing says these went back
            failed.extend(members_)
            continue
        status = ctx.status(batch_id)
        if status.details_dropped:  # summarized: only its counts are left
            missing = status.expected - status.counts.succeeded
            if missing:
                failed.append(f"{missing} of {', '.join(members_)}")
            continue
        # A worker lost meanwhile is not a failed rollback: back, it reports the aborted
        # change and the reconciler gives it the stable state (the rollout is not held).
        failed.extend(
            d.worker_id
            for d in status.workers
            if d.state is not WorkerState.SUCCEEDED and d.state is not WorkerState.LOST
        )
    return sorted(failed)


def rollback_spec(previous: Desired | None, change: Desired) -> CommandSpec | None:
    """What puts a worker back: the previous weights, or the previous values of changed keys."""
    if previous is None:
        return None
    if change.weights is not None:
        return None if previous.weights is None else reload_spec(previous)
    back = {k: previous.config[k] for k in change.config if k in previous.config}
    return UpdateConfigSpec(overrides=back) if back else None
