"""The controller's decisions: progressive rollouts wave by wave, and targets kept at their state.

Pure: no I/O; time comes in as ``now`` (judge it as the coordinator does). :func:`decide` reads
what the log says (the controller topic's fold, the fleet's fold, the probe answers in the acks)
and returns what to write next: commands, and the new state of each rollout it moved. Level-
triggered, like a Kubernetes controller: it looks at the whole state every time, never at the
event that woke it, so any order of the same events gives the same decision, and a restarted
controller, reading the same log, decides what the one before it would have.

Command ids are deterministic: ``<rollout>.w<wave>.b<batch>`` (a rollout's batch),
``<rollout>.rb.b<batch>`` (its rollback), ``sync-<hash>`` (a drifting worker, per target state
and worker incarnation), each with command id ``<rollout id>.a1``. A decision never re-issues a
command whose rollout id is in the log, so a resumed controller cannot apply anything twice.

The rules, wave by wave (docs/rollouts.md, "Progressive rollouts"):

1. A rollout starts when no other of its target runs; its waves are planned over the live workers
   of the target (:mod:`controlplane.rollout.waves`) and written into its state.
2. A wave's batches are published one at a time; the next once the previous one is over: it
   ended, or each of its workers acked an end or is lost (a dead worker is not waited for).
3. Failed workers (failed, rejected, or lost when their batch was over) count against
   ``max_failures``; one more aborts the rollout.
4. When a wave's last batch ended: during ``bake_s``, a degraded worker fails the health gate; at
   the end of it an updated worker that is lost counts as failed (rule 3), and every other one
   must be ready, not degraded and on the new version (health), agree on its config digest
   (agreement) and, with a probe, have answered it alike and as the strategy expects (probe; no
   answer, or a malformed one, fails it). A failed gate aborts. A wave that has not passed its
   gates within ``progress_deadline_s`` of its start aborts (time paused does not count: an
   operator's pause, or at the boundary once its gates passed; a resume restarts the clock).
5. Between waves: ``pause`` seconds, or until a ``promote`` (manual). An operator's pause holds
   the next batch; resume releases it.
6. Abort (an operator, a gate, ``max_failures``, the deadline): no further batch starts; commands
   already handed out finish; then, with rollback, every worker that applied the new state gets
   the previous stable state back, in batches, and the rollout ends ``rolled_back`` (``aborted``
   without rollback, or when a rollback fails: code ``ROLLBACK_FAILED``).
7. Ended is ended: a rollout whose state is terminal is never looked at again.
8. A command the coordinator's own trust store refuses (``decide``'s ``seal``) is never
   published: its rollout ends ``aborted`` with the refusal's code (``SCOPE_DENIED``,
   ``SIGNATURE_MISSING``), a sync is left out (``Decision.refused``).
9. A dry run (``Command.dry_run``) under a batch's or a rollback batch's rollout id (they are
   predictable) applied nothing: never a batch applied. The rollout aborts with ``ROLLOUT_EXISTS``
   (a batch; rolled back as any abort) or ``ROLLBACK_FAILED`` (a rollback batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import Final

from controlplane.rollout.decisions import (
    FAILED_STATES,
    SYNC_TTL_S,
    Context,
    Decision,
    Digests,
    Gate,
    Probes,
    Seal,
    batch_over,
    batch_rollout_id,
    change_spec,
    clip,
    conflicts,
    end_state,
    members,
    named,
    over,
    paused_state,
    progressing_state,
    rollback_rollout_id,
    sync_rollout_id,
)
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.gates import (
    agreement_now,
    gate_failure,
    not_healthy,
)
from controlplane.rollout.models import WorkerState
from controlplane.rollout.reconcile import (
    held,
    reconcile,
    should_run,
)
from controlplane.rollout.rollback import (
    aborting,
    roll_back,
)
from controlplane.rollout.targets import ControlState, Rollout, applied
from controlplane.rollout.waves import batches, max_failures, plan_waves
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    GateResult,
    RolloutState,
)
from controlplane.wire.errors import CommandRejected, LocalCode, WireCode
from controlplane.wire.messages import Command

#: Steps one rollout may take in one decision (each step waits on something else after a few).
_MAX_STEPS: Final = 16

#: The controller's interface (the parts live in decisions, gates, rollback and reconcile).
__all__ = [
    "SYNC_TTL_S",
    "Decision",
    "batch_rollout_id",
    "conflicts",
    "decide",
    "held",
    "members",
    "reconcile",
    "rollback_rollout_id",
    "should_run",
    "sync_rollout_id",
]


def _agreed_config(ctx: Context, state: RolloutState) -> str | None:
    """The config digest the updated workers of an ended config rollout report (one, by the
    agreement gate; None when none reports one)."""
    failed = set(state.failed)
    for wave in state.waves:
        for worker in wave:
            view = ctx.fleet.registry.latest(worker)
            if worker not in failed and view is not None and view.config_digest is not None:
                return view.config_digest
    return None


def decide(
    control: ControlState,
    fleet: Fleet,
    now: datetime,
    *,
    issuer: str = "controller",
    probes: Probes | None = None,
    digests: Digests | None = None,
    seal: Seal | None = None,
) -> Decision:
    """Everything to write now: each open rollout moved as far as the log allows, then every
    drifting worker's command. ``probes`` and ``digests``: what the succeeded acks of the
    rollouts' batches said (``result.probe``, ``result.weights_digest``). ``seal``: signs and
    checks each command (the coordinator's key and trust store); a rollout whose command it
    refuses ends ``aborted`` with the refusal's code, a sync it refuses is left out
    (``Decision.refused``): published, either would be refused by every worker, and never be a
    rollout here, so the next decision would publish it again."""
    ctx = Context(control, fleet, probes or {}, now, issuer, digests=digests or {}, seal=seal)
    refused: list[tuple[Command, CommandRejected]] = []
    states: list[RolloutState] = []
    #: target -> its rollout in progress (one started in this very decision included)
    running = {
        r.spec.target: r.rollout_id
        for r in control.rollouts()
        if r.state is not None and not r.ended
    }
    #: Targets whose rollout moved in this decision: their drift waits for the next one, which
    #: sees the moved state (a sync now could apply beside a batch just handed out).
    moved_targets: set[str] = set()
    for rollout in list(control.open_rollouts()):
        published_before = len(ctx.commands)
        state = rollout.state
        if state is None:
            state = _start(ctx, rollout, running)
            if not state.phase.terminal:
                running[rollout.spec.target] = rollout.rollout_id
        try:
            for _ in range(_MAX_STEPS):
                moved = _advance(ctx, rollout, state)
                if moved == state:
                    break
                state = moved
            state = RolloutState.model_validate(state.model_dump())  # what readers accept
        except CommandRejected as exc:
            state = _unsigned(state, exc, now)
        except Exception as exc:  # one rollout the log makes odd never stops the others
            state = _broken(rollout, state, exc, now)
        if state != rollout.state:
            revision = 0 if rollout.state is None else rollout.state.revision + 1
            states.append(state.model_copy(update={"revision": revision, "updated_at": now}))
        if state != rollout.state or len(ctx.commands) > published_before:
            moved_targets.add(rollout.spec.target)
    for sync in reconcile(
        control, fleet, now, issuer=issuer, published=ctx.published, skip=moved_targets
    ):
        try:
            ctx.commands.append(sync if seal is None else seal(sync))
        except CommandRejected as exc:
            refused.append((sync, exc))
    return Decision(ctx.commands, states, refused)


def _start(ctx: Context, rollout: Rollout, running: Mapping[str, str]) -> RolloutState:
    spec = rollout.spec
    base = RolloutState(
        rollout_id=spec.rollout_id,
        target=spec.target,
        revision=0,
        phase=ControlPhase.PROGRESSING,
        started_at=ctx.now,
        updated_at=ctx.now,
        wave_started_at=ctx.now,
    )
    target = ctx.control.target(spec.target)
    if target is None:
        return _rejected(base, LocalCode.TARGET_UNKNOWN, f"no target {spec.target!r}", ctx.now)
    if spec.target in running:
        other = running[spec.target]
        return _rejected(
            base, LocalCode.TARGET_BUSY, f"{other} is in progress on {spec.target}", ctx.now
        )
    workers = members(ctx.control, ctx.fleet, target, ctx.now)
    if not workers:
        return _rejected(
            base,
            LocalCode.NO_MATCHING_WORKERS,
            f"no live worker belongs to target {spec.target} ({dict(target.spec.selector)})",
            ctx.now,
        )
    return base.model_copy(
        update={"waves": plan_waves(workers, spec.strategy), "previous": target.stable}
    )


def _rejected(base: RolloutState, code: LocalCode, message: str, now: datetime) -> RolloutState:
    return base.model_copy(
        update={
            "phase": ControlPhase.REJECTED,
            "code": code.value,
            "message": message,
            "ended_at": now,
            "wave_started_at": None,
        }
    )


def _advance(ctx: Context, rollout: Rollout, state: RolloutState) -> RolloutState:
    if state.phase.terminal:
        return state
    spec = rollout.spec
    if state.phase is ControlPhase.ROLLING_BACK:
        rollback_ids = (rollback_rollout_id(spec.rollout_id, i) for i in range(len(state.rollback)))
        dry = _dry_run_among(ctx, rollback_ids)
        if dry is not None:
            why = f"{state.message}; rollback failed: {_dry_run_holds(dry)}"
            return end_state(state, ControlPhase.ABORTED, LocalCode.ROLLBACK_FAILED, why, ctx.now)
        return roll_back(ctx, rollout, state)
    abort = rollout.abort
    if abort is not None:
        rollback = spec.rollback if abort.rollback is None else abort.rollback
        why = abort.reason or f"aborted by {abort.issuer}"
        return aborting(state, LocalCode.ABORTED_BY_OPERATOR, why, rollback, ctx.now)
    dry = _dry_run_among(ctx, _batch_ids(state, spec.strategy.max_unavailable))
    if dry is not None:
        return aborting(
            state, LocalCode.ROLLOUT_EXISTS, _dry_run_holds(dry), spec.rollback, ctx.now
        )
    failed = _failed(ctx, state)
    if failed != state.failed:
        state = state.model_copy(update={"failed": failed})
    total = sum(len(wave) for wave in state.waves)
    tolerated = max_failures(spec.strategy, total)
    if len(failed) > tolerated:
        why = f"{len(failed)} worker(s) failed, more than max_failures {tolerated}: {named(failed)}"
        return aborting(state, LocalCode.MAX_FAILURES_EXCEEDED, why, spec.rollback, ctx.now)
    if state.wave >= len(state.waves):
        target = ctx.control.target(spec.target)
        result = applied(None if target is None else target.stable, spec.desired)
        if spec.desired.config:  # what the updated workers report now (the agreement gate)
            result = result.model_copy(update={"config_digest": _agreed_config(ctx, state)})
        done = end_state(state, ControlPhase.SUCCEEDED, None, "every wave passed", ctx.now)
        return done.model_copy(update={"result": result})
    strategy = spec.strategy
    started = state.wave_started_at or state.started_at
    # The deadline is for applying and baking: a pause (an operator's, or at a wave boundary
    # once the gates passed) does not count, and a resume restarts it (Kubernetes does so too).
    waiting = state.phase is ControlPhase.PAUSED or _gates_passed(state)
    if not waiting and ctx.now - started > timedelta(seconds=strategy.progress_deadline_s):
        why = f"wave {state.wave} did not pass its gates within {strategy.progress_deadline_s:g} s"
        return aborting(state, LocalCode.PROGRESS_DEADLINE_EXCEEDED, why, spec.rollback, ctx.now)
    wave = state.waves[state.wave]
    plan = batches(wave, strategy.max_unavailable)
    if state.batch < len(plan):
        batch_id = batch_rollout_id(spec.rollout_id, state.wave, state.batch)
        if not ctx.known(batch_id):
            if rollout.operator_paused:
                return paused_state(state, "paused by an operator (rollout resume continues)")
            ctx.publish(
                batch_id,
                plan[state.batch],
                change_spec(spec.desired, strategy.probe),
                strategy.progress_deadline_s,
                strategy.command_timeout_s,
            )
            if state.phase is ControlPhase.PAUSED:  # resumed: the deadline starts again
                state = state.model_copy(update={"wave_started_at": ctx.now})
            return progressing_state(state, f"wave {state.wave} batch {state.batch} published")
        if batch_over(ctx, batch_id):
            return state.model_copy(update={"batch": state.batch + 1})
        return state
    if state.wave_done_at is None:
        return state.model_copy(update={"wave_done_at": ctx.now})
    return _after_wave(ctx, rollout, state)


def _after_wave(ctx: Context, rollout: Rollout, state: RolloutState) -> RolloutState:
    """Gates once the bake is over, then the pause, then the next wave (or success)."""
    spec, strategy = rollout.spec, rollout.spec.strategy
    done_at = state.wave_done_at
    assert done_at is not None
    if not _gates_passed(state):
        updated = [
            w for wave in state.waves[: state.wave + 1] for w in wave if w not in state.failed
        ]
        failure = gate_failure(ctx, spec.desired, spec.rollout_id, updated, state, rollout)
        if failure is not None:
            return _gate_failed(state, *failure, spec.rollback, ctx.now)
        lost = [w for w in updated if not ctx.fleet.registry.is_alive(w, ctx.now)]
        if lost:  # failed, as one lost before its ack: counted against max_failures, not waited for
            return state.model_copy(update={"failed": sorted({*state.failed, *lost})})
        waiting = not_healthy(ctx, spec.desired, updated)
        if state.healthy_at is None:  # the bake starts once the wave is first seen healthy
            if waiting:
                return progressing_state(state, f"wave {state.wave}: waiting for {waiting}")
            return state.model_copy(update={"healthy_at": ctx.now})
        # Baking: the wave's workers must stay healthy (ready, idle, on the new version).
        wave = [w for w in state.waves[state.wave] if w not in state.failed]
        unhealthy = not_healthy(ctx, spec.desired, wave)
        if unhealthy:
            why = f"{unhealthy} during the bake"
            return _gate_failed(state, "health", why, spec.rollback, ctx.now)
        if ctx.now < state.healthy_at + timedelta(seconds=strategy.bake_s):
            return state
        if waiting:  # a worker of an earlier wave, busy with a sync say: wait for it
            return progressing_state(state, f"wave {state.wave}: waiting for {waiting}")
        values = agreement_now(ctx, rollout, state, wave)
        results = [GateResult(wave=state.wave, gate="health", passed=True)]
        results.append(
            GateResult(
                wave=state.wave, gate="agreement", passed=True, value=values.get("agreement")
            )
        )
        if strategy.probe is not None:
            results.append(
                GateResult(wave=state.wave, gate="probe", passed=True, value=values.get("probe"))
            )
        done_at = ctx.now
        state = state.model_copy(
            update={"gates": [*state.gates, *results], "wave_done_at": done_at}
        )
    if state.wave + 1 >= len(state.waves):
        return state.model_copy(update={"wave": state.wave + 1})
    if rollout.operator_paused:
        return paused_state(state, "paused by an operator (rollout resume continues)")
    promoted = state.promoted
    if strategy.manual:
        promotes = [a for a in rollout.actions if a.action is ActionKind.PROMOTE]
        # A promote says which wave's pause it releases (a retried one releases nothing more);
        # one that does not (hand-written) releases the next pause not released yet.
        if not any(a.wave == state.wave for a in promotes):
            if sum(1 for a in promotes if a.wave is None) <= promoted:
                return paused_state(
                    state, f"wave {state.wave} passed; waiting for `rollout promote`"
                )
            promoted += 1
    elif ctx.now < done_at + timedelta(seconds=strategy.pause_s):
        return progressing_state(state, f"wave {state.wave} passed; pausing {strategy.pause_s:g} s")
    return state.model_copy(
        update={
            "phase": ControlPhase.PROGRESSING,
            "wave": state.wave + 1,
            "batch": 0,
            "wave_started_at": ctx.now,
            "wave_done_at": None,
            "healthy_at": None,
            "promoted": promoted,
            "message": f"wave {state.wave + 1} started",
        }
    )


def _gate_failed(
    state: RolloutState, gate: Gate, why: str, rollback: bool, now: datetime
) -> RolloutState:
    why = clip(why)
    result = GateResult(wave=state.wave, gate=gate, passed=False, message=why)
    state = state.model_copy(update={"gates": [*state.gates, result]})
    return aborting(state, LocalCode.GATE_FAILED, f"{gate} gate: {why}", rollback, now)


def _gates_passed(state: RolloutState) -> bool:
    """Whether the wave in progress passed its gates (it waits at its boundary)."""
    return any(g.wave == state.wave and g.gate == "health" and g.passed for g in state.gates)


def _batch_ids(state: RolloutState, max_unavailable: int | None) -> Iterator[str]:
    """The rollout id of each batch of the waves begun (the wave in progress included)."""
    for wave_index, wave in enumerate(state.waves[: state.wave + 1]):
        for batch_index in range(len(batches(wave, max_unavailable))):
            yield batch_rollout_id(state.rollout_id, wave_index, batch_index)


def _dry_run_among(ctx: Context, batch_ids: Iterable[str]) -> str | None:
    """The first of ``batch_ids`` whose command in the log is a dry run (``Command.dry_run``):
    ids are predictable, so anyone may publish one under a batch's id, before the controller
    (which then never publishes its own: the id is in the log) or after it, issued earlier
    (the fleet's command of the rollout is then the dry run). Its ``succeeded`` acks applied
    nothing: never a batch applied, a wave passed or a rollback done."""
    for batch_id in batch_ids:
        if batch_id in ctx.fleet and ctx.status(batch_id).dry_run:
            return batch_id
    return None


def _dry_run_holds(batch_id: str) -> str:
    return (
        f"a dry run (Command.dry_run) holds the rollout id {batch_id}: it applied nothing, "
        "and the controller's command for it is not published under a rollout id in the log"
    )


def _failed(ctx: Context, state: RolloutState) -> list[str]:
    """Workers of this rollout's ended batches that failed, were rejected or were lost, and
    those it counted before: a worker counted failed stays so (the fleet summarizes old ended
    batches, dropping their per-worker details, while a long rollout still runs)."""
    failed: set[str] = set(state.failed)
    for wave_index, wave in enumerate(state.waves[: state.wave + 1]):
        for batch_index in range(len(wave)):
            batch_id = batch_rollout_id(state.rollout_id, wave_index, batch_index)
            if batch_id not in ctx.fleet:
                break
            status = ctx.status(batch_id)
            for detail in status.workers:
                if detail.state in (WorkerState.FAILED, WorkerState.REJECTED) or (
                    over(status) and detail.state in FAILED_STATES
                ):
                    failed.add(detail.worker_id)
    return sorted(failed)


def _unsigned(state: RolloutState, exc: CommandRejected, now: datetime) -> RolloutState:
    """A rollout whose next command the coordinator's own trust store refuses (its key's scope
    leaves out the target's selector or the path, or it has no key): ended ``aborted`` with the
    refusal's code, nothing published. Not rolled back: a rollback's commands would be signed
    by the same key; the workers that applied earlier waves are held for an operator."""
    why = f"its command is not published: the coordinator's trust store refuses it: {exc.message}"
    ended = end_state(state, ControlPhase.ABORTED, exc.code, why, now)
    return RolloutState.model_validate(ended.model_dump())


def _broken(rollout: Rollout, state: RolloutState, exc: Exception, now: datetime) -> RolloutState:
    """A rollout whose decision raised (a bug, or records no controller wrote): ended
    ``aborted`` with code INTERNAL and why, so that the controller carries on with the others;
    its workers are held for an operator to look at."""
    why = clip(f"the controller could not decide on it: {type(exc).__name__}: {exc}")
    base = rollout.state or state
    return RolloutState(
        rollout_id=base.rollout_id,
        target=base.target,
        revision=base.revision,
        phase=ControlPhase.ABORTED,
        waves=base.waves,
        wave=base.wave,
        code=WireCode.INTERNAL.value,
        message=why,
        started_at=base.started_at,
        updated_at=now,
        ended_at=now,
    )
