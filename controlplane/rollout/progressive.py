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
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Literal, TypeVar

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutStatus, WorkerState
from controlplane.rollout.targets import ControlState, Rollout, Target, applied
from controlplane.rollout.waves import batches, max_failures, plan_waves
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Desired,
    GateResult,
    ProbeGate,
    RolloutState,
)
from controlplane.wire.errors import LocalCode, WireCode
from controlplane.wire.messages import (
    Command,
    CommandSpec,
    ProbeSpec,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    WorkerStatus,
)

T = TypeVar("T")

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
#: Steps one rollout may take in one decision (each step waits on something else after a few).
_MAX_STEPS: Final = 16
_FAILED_STATES: Final = frozenset({WorkerState.FAILED, WorkerState.REJECTED, WorkerState.LOST})

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


def _agreed_config(ctx: _Context, state: RolloutState) -> str | None:
    """The config digest the updated workers of an ended config rollout report (one, by the
    agreement gate; None when none reports one)."""
    failed = set(state.failed)
    for wave in state.waves:
        for worker in wave:
            view = ctx.fleet.registry.latest(worker)
            if worker not in failed and view is not None and view.config_digest is not None:
                return view.config_digest
    return None


@dataclass
class Decision:
    """What to write, in this order, in one transaction."""

    commands: list[Command] = field(default_factory=list)
    states: list[RolloutState] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.commands or self.states)


@dataclass
class _Context:
    control: ControlState
    fleet: Fleet
    probes: Probes
    now: datetime
    issuer: str
    published: set[str] = field(default_factory=set)
    commands: list[Command] = field(default_factory=list)
    digests: Digests = field(default_factory=dict)
    #: Batch statuses judged in this decision (the fleet does not change during one).
    _statuses: dict[str, RolloutStatus] = field(default_factory=dict)

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
        self.published.add(rollout_id)
        self.commands.append(
            Command(
                command_id=f"{rollout_id}.a1",
                rollout_id=rollout_id,
                issued_at=self.now,
                expires_at=self.now + timedelta(seconds=ttl_s),
                issuer=self.issuer,
                selector=Selector(worker_ids=sorted(workers)),
                spec=spec,
                timeout_s=timeout_s,
            )
        )


def decide(
    control: ControlState,
    fleet: Fleet,
    now: datetime,
    *,
    issuer: str = "controller",
    probes: Probes | None = None,
    digests: Digests | None = None,
) -> Decision:
    """Everything to write now: each open rollout moved as far as the log allows, then every
    drifting worker's command. ``probes`` and ``digests``: what the succeeded acks of the
    rollouts' batches said (``result.probe``, ``result.weights_digest``)."""
    ctx = _Context(control, fleet, probes or {}, now, issuer, digests=digests or {})
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
        except Exception as exc:  # one rollout the log makes odd never stops the others
            state = _broken(rollout, state, exc, now)
        if state != rollout.state:
            revision = 0 if rollout.state is None else rollout.state.revision + 1
            states.append(state.model_copy(update={"revision": revision, "updated_at": now}))
        if state != rollout.state or len(ctx.commands) > published_before:
            moved_targets.add(rollout.spec.target)
    ctx.commands.extend(
        reconcile(control, fleet, now, issuer=issuer, published=ctx.published, skip=moved_targets)
    )
    return Decision(ctx.commands, states)


# ------------------------------------------------------------------ membership


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
    for view in fleet.registry.workers(now):
        if view.alive:
            names = [t.name for t in control.targets_of(view.labels)]
            if len(names) > 1:
                out[view.worker_id] = sorted(names)
    return out


# ------------------------------------------------------------------ one rollout


def _start(ctx: _Context, rollout: Rollout, running: Mapping[str, str]) -> RolloutState:
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


def _advance(ctx: _Context, rollout: Rollout, state: RolloutState) -> RolloutState:
    if state.phase.terminal:
        return state
    if state.phase is ControlPhase.ROLLING_BACK:
        return _roll_back(ctx, rollout, state)
    spec = rollout.spec
    abort = rollout.abort
    if abort is not None:
        rollback = spec.rollback if abort.rollback is None else abort.rollback
        why = abort.reason or f"aborted by {abort.issuer}"
        return _aborting(state, LocalCode.ABORTED_BY_OPERATOR, why, rollback, ctx.now)
    failed = _failed(ctx, state)
    if failed != state.failed:
        state = state.model_copy(update={"failed": failed})
    total = sum(len(wave) for wave in state.waves)
    tolerated = max_failures(spec.strategy, total)
    if len(failed) > tolerated:
        why = f"{len(failed)} worker(s) failed, more than max_failures {tolerated}: {named(failed)}"
        return _aborting(state, LocalCode.MAX_FAILURES_EXCEEDED, why, spec.rollback, ctx.now)
    if state.wave >= len(state.waves):
        target = ctx.control.target(spec.target)
        result = applied(None if target is None else target.stable, spec.desired)
        if spec.desired.config:  # what the updated workers report now (the agreement gate)
            result = result.model_copy(update={"config_digest": _agreed_config(ctx, state)})
        done = _ended(state, ControlPhase.SUCCEEDED, None, "every wave passed", ctx.now)
        return done.model_copy(update={"result": result})
    strategy = spec.strategy
    started = state.wave_started_at or state.started_at
    # The deadline is for applying and baking: a pause (an operator's, or at a wave boundary
    # once the gates passed) does not count, and a resume restarts it (Kubernetes does so too).
    waiting = state.phase is ControlPhase.PAUSED or _gates_passed(state)
    if not waiting and ctx.now - started > timedelta(seconds=strategy.progress_deadline_s):
        why = f"wave {state.wave} did not pass its gates within {strategy.progress_deadline_s:g} s"
        return _aborting(state, LocalCode.PROGRESS_DEADLINE_EXCEEDED, why, spec.rollback, ctx.now)
    wave = state.waves[state.wave]
    plan = batches(wave, strategy.max_unavailable)
    if state.batch < len(plan):
        batch_id = batch_rollout_id(spec.rollout_id, state.wave, state.batch)
        if not ctx.known(batch_id):
            if rollout.operator_paused:
                return _paused(state, "paused by an operator (rollout resume continues)")
            ctx.publish(
                batch_id,
                plan[state.batch],
                _change_spec(spec.desired, strategy.probe),
                strategy.progress_deadline_s,
                strategy.command_timeout_s,
            )
            if state.phase is ControlPhase.PAUSED:  # resumed: the deadline starts again
                state = state.model_copy(update={"wave_started_at": ctx.now})
            return _progressing(state, f"wave {state.wave} batch {state.batch} published")
        if _batch_over(ctx, batch_id):
            return state.model_copy(update={"batch": state.batch + 1})
        return state
    if state.wave_done_at is None:
        return state.model_copy(update={"wave_done_at": ctx.now})
    return _after_wave(ctx, rollout, state)


def _after_wave(ctx: _Context, rollout: Rollout, state: RolloutState) -> RolloutState:
    """Gates once the bake is over, then the pause, then the next wave (or success)."""
    spec, strategy = rollout.spec, rollout.spec.strategy
    done_at = state.wave_done_at
    assert done_at is not None
    if not _gates_passed(state):
        updated = [
            w for wave in state.waves[: state.wave + 1] for w in wave if w not in state.failed
        ]
        failure = _gate_failure(ctx, spec.desired, spec.rollout_id, updated, state, rollout)
        if failure is not None:
            return _gate_failed(state, *failure, spec.rollback, ctx.now)
        lost = [w for w in updated if not ctx.fleet.registry.is_alive(w, ctx.now)]
        if lost:  # failed, as one lost before its ack: counted against max_failures, not waited for
            return state.model_copy(update={"failed": sorted({*state.failed, *lost})})
        waiting = _not_healthy(ctx, spec.desired, updated)
        if state.healthy_at is None:  # the bake starts once the wave is first seen healthy
            if waiting:
                return _progressing(state, f"wave {state.wave}: waiting for {waiting}")
            return state.model_copy(update={"healthy_at": ctx.now})
        # Baking: the wave's workers must stay healthy (ready, idle, on the new version).
        wave = [w for w in state.waves[state.wave] if w not in state.failed]
        unhealthy = _not_healthy(ctx, spec.desired, wave)
        if unhealthy:
            why = f"{unhealthy} during the bake"
            return _gate_failed(state, "health", why, spec.rollback, ctx.now)
        if ctx.now < state.healthy_at + timedelta(seconds=strategy.bake_s):
            return state
        if waiting:  # a worker of an earlier wave, busy with a sync say: wait for it
            return _progressing(state, f"wave {state.wave}: waiting for {waiting}")
        results = [GateResult(wave=state.wave, gate="health", passed=True)]
        results.append(GateResult(wave=state.wave, gate="agreement", passed=True))
        if strategy.probe is not None:
            results.append(GateResult(wave=state.wave, gate="probe", passed=True))
        done_at = ctx.now
        state = state.model_copy(
            update={"gates": [*state.gates, *results], "wave_done_at": done_at}
        )
    if state.wave + 1 >= len(state.waves):
        return state.model_copy(update={"wave": state.wave + 1})
    if rollout.operator_paused:
        return _paused(state, "paused by an operator (rollout resume continues)")
    promoted = state.promoted
    if strategy.manual:
        promotes = [a for a in rollout.actions if a.action is ActionKind.PROMOTE]
        # A promote says which wave's pause it releases (a retried one releases nothing more);
        # one that does not (hand-written) releases the next pause not released yet.
        if not any(a.wave == state.wave for a in promotes):
            if sum(1 for a in promotes if a.wave is None) <= promoted:
                return _paused(state, f"wave {state.wave} passed; waiting for `rollout promote`")
            promoted += 1
    elif ctx.now < done_at + timedelta(seconds=strategy.pause_s):
        return _progressing(state, f"wave {state.wave} passed; pausing {strategy.pause_s:g} s")
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
    return _aborting(state, LocalCode.GATE_FAILED, f"{gate} gate: {why}", rollback, now)


def _gates_passed(state: RolloutState) -> bool:
    """Whether the wave in progress passed its gates (it waits at its boundary)."""
    return any(g.wave == state.wave and g.gate == "health" and g.passed for g in state.gates)


def _gate_failure(
    ctx: _Context,
    desired: Desired,
    rollout_id: str,
    updated: list[str],
    state: RolloutState,
    rollout: Rollout,
) -> tuple[Gate, str] | None:
    """A gate that failed for good: a degraded worker, disagreeing digests, a bad probe."""
    registry = ctx.fleet.registry
    digests: dict[str, list[str]] = {}
    for worker in updated:
        view = registry.get(worker, ctx.now)
        if view is None:
            continue
        if view.degraded is not None:
            degraded = view.degraded
            return "health", clip(f"{worker} is degraded: {degraded.code}: {degraded.message}", 300)
        if desired.config and view.config_digest is not None and view.in_flight is None:
            digests.setdefault(view.config_digest, []).append(worker)
    if len(digests) > 1:
        shown = "; ".join(f"{d[:12]}: {named(ws)}" for d, ws in sorted(digests.items())[:5])
        return "agreement", (
            f"updated workers report {len(digests)} different config digests ({shown})"
        )
    weights: dict[str, list[str]] = {}
    for worker in updated:
        digest = _batch_fact(ctx.digests, rollout_id, state, worker)
        if digest is not None:  # runners that cannot say (vLLM) are not judged on it
            weights.setdefault(digest, []).append(worker)
    if len(weights) > 1:
        shown = "; ".join(f"{d[:12]}: {named(ws)}" for d, ws in sorted(weights.items())[:5])
        return "agreement", f"updated workers hold {len(weights)} different weights ({shown})"
    probe = rollout.spec.strategy.probe
    if probe is None:
        return None
    answers: dict[tuple[int, ...], list[str]] = {}
    for worker in updated:
        answer = _probe_of(ctx, rollout_id, state, worker)
        if answer is None:  # its reload succeeded, so its ack would carry the answer
            return "probe", f"{worker} applied the weights but sent no probe answer"
        if "unsupported" in answer:
            return "probe", f"{worker}'s runner cannot run a probe"
        if "error" in answer:
            return "probe", clip(f"{worker}'s probe failed: {answer['error']}", 300)
        reading = _reading(answer)
        if reading is None:
            return "probe", f"{worker}'s probe answer is malformed: {str(dict(answer))[:200]}"
        tokens, logprob = reading
        if probe.expect_tokens is not None and list(tokens) != probe.expect_tokens:
            return "probe", clip(
                f"{worker} answered {list(tokens)}, expected {probe.expect_tokens}", 500
            )
        if probe.min_mean_logprob is not None and not logprob >= probe.min_mean_logprob:
            return "probe", (
                f"{worker}'s mean log-prob {logprob:.4g} is below {probe.min_mean_logprob:g}"
            )
        answers.setdefault(tokens, []).append(worker)
    if len(answers) > 1:
        shown = "; ".join(f"{list(t)[:16]}: {named(ws)}" for t, ws in list(answers.items())[:5])
        return "probe", f"updated workers answered the probe differently ({shown})"
    return None


def _reading(answer: Mapping[str, Any]) -> tuple[tuple[int, ...], float] | None:
    """(tokens, mean log-prob) of a probe answer, as a worker's ack carries it; None when it is
    not one (it is the worker's JSON: a bad one fails the gate, never the decision)."""
    tokens = answer.get("tokens")
    logprob = answer.get("mean_logprob")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        return None
    if isinstance(logprob, bool) or not isinstance(logprob, int | float):
        return None
    return tuple(tokens), float(logprob)


def _probe_of(
    ctx: _Context, rollout_id: str, state: RolloutState, worker: str
) -> Mapping[str, Any] | None:
    return _batch_fact(ctx.probes, rollout_id, state, worker)


def _batch_fact(
    facts: Mapping[tuple[str, str], T], rollout_id: str, state: RolloutState, worker: str
) -> T | None:
    """What ``worker``'s succeeded ack for its batch of this rollout said (a probe, a digest)."""
    for wave, members_ in enumerate(state.waves[: state.wave + 1]):
        if worker in members_:
            for batch in range(len(members_)):
                fact = facts.get((batch_rollout_id(rollout_id, wave, batch), worker))
                if fact is not None:
                    return fact
    return None


def _not_healthy(ctx: _Context, desired: Desired, updated: list[str]) -> str | None:
    """Who keeps the health gate from passing yet (None: nobody)."""
    version = desired.version
    for worker in updated:
        view = ctx.fleet.registry.get(worker, ctx.now)
        if view is None or not view.alive:
            return f"{worker} (not alive)"
        if view.status is not WorkerStatus.READY or view.in_flight is not None:
            return f"{worker} ({view.status.value})"
        if version is not None and view.weights_version != version:
            return f"{worker} (reports {view.weights_version}, not {version})"
    return None


def _over(status: RolloutStatus) -> bool:
    """Whether a batch is over for the controller: it ended, or each of its workers acked an
    end or is lost. Lost is provisional for the fleet (the command ends only when it expires),
    but a dead worker must not hold a wave until its deadline: it counts as failed, against
    ``max_failures``, from then on."""
    return status.terminal or all(d.state.terminal for d in status.workers)


def _batch_over(ctx: _Context, batch_id: str) -> bool:
    return batch_id in ctx.fleet and _over(ctx.status(batch_id))


def _failed(ctx: _Context, state: RolloutState) -> list[str]:
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
                    _over(status) and detail.state in _FAILED_STATES
                ):
                    failed.add(detail.worker_id)
    return sorted(failed)


def _updated(
    ctx: _Context, state: RolloutState, max_unavailable: int | None
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
            ended = ended and _over(status)
            if status.details_dropped:  # summarized: each worker of it not counted failed applied
                done.update(w for w in members_ if w not in state.failed)
                continue
            done.update(d.worker_id for d in status.workers if d.state is WorkerState.SUCCEEDED)
    return sorted(done), ended


# ------------------------------------------------------------------ abort and rollback


def _aborting(
    state: RolloutState, code: LocalCode, why: str, rollback: bool, now: datetime
) -> RolloutState:
    if not rollback:
        return _ended(state, ControlPhase.ABORTED, code, why, now)
    return state.model_copy(
        update={"phase": ControlPhase.ROLLING_BACK, "code": code.value, "message": clip(why)}
    )


def _roll_back(ctx: _Context, rollout: Rollout, state: RolloutState) -> RolloutState:
    spec = rollout.spec
    if not state.rollback:
        updated, ended = _updated(ctx, state, spec.strategy.max_unavailable)
        if not ended:
            return state  # commands already handed out finish first
        if not updated:
            return _ended(
                state,
                ControlPhase.ROLLED_BACK,
                state.code,
                f"{state.message}; no worker had applied it",
                ctx.now,
            )
        if _rollback_spec(state.previous, spec.desired) is None:
            return _unavailable(state, spec.desired, ctx.now)
        # A worker lost since it applied cannot take a command now; back from the dead, it
        # reports the new state and the reconciler gives it the stable one (not held: rolled back).
        alive = [w for w in updated if ctx.fleet.registry.is_alive(w, ctx.now)]
        if not alive:
            why = f"{state.message}; the workers that had applied it are lost: " + (
                "each gets the stable state back when it returns"
            )
            return _ended(state, ControlPhase.ROLLED_BACK, state.code, why, ctx.now)
        plan = batches(alive, spec.strategy.max_unavailable)
        return state.model_copy(update={"rollback": plan, "rollback_batch": 0})
    if state.rollback_batch >= len(state.rollback):
        failed = _rollback_failures(ctx, state)
        if failed:
            why = f"{state.message}; rollback failed on {named(failed)}"
            return _ended(state, ControlPhase.ABORTED, LocalCode.ROLLBACK_FAILED, why, ctx.now)
        return _ended(
            state, ControlPhase.ROLLED_BACK, state.code, f"{state.message}; rolled back", ctx.now
        )
    batch_id = rollback_rollout_id(spec.rollout_id, state.rollback_batch)
    if not ctx.known(batch_id):
        back = _rollback_spec(state.previous, spec.desired)
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
    if _batch_over(ctx, batch_id):
        return state.model_copy(update={"rollback_batch": state.rollback_batch + 1})
    return state


def _unavailable(state: RolloutState, change: Desired, now: datetime) -> RolloutState:
    previous = state.previous
    if change.weights is not None or previous is None:
        what = "the target had no stable weights"
    else:
        missing = sorted(k for k in change.config if k not in previous.config)
        what = f"the target's stable state has no value for {', '.join(missing)}"
    why = f"{state.message}; nothing to roll back to ({what})"
    return _ended(state, ControlPhase.ABORTED, LocalCode.ROLLBACK_UNAVAILABLE, why, now)


def _rollback_failures(ctx: _Context, state: RolloutState) -> list[str]:
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


def _rollback_spec(previous: Desired | None, change: Desired) -> CommandSpec | None:
    """What puts a worker back: the previous weights, or the previous values of changed keys."""
    if previous is None:
        return None
    if change.weights is not None:
        return None if previous.weights is None else _reload(previous)
    back = {k: previous.config[k] for k in change.config if k in previous.config}
    return UpdateConfigSpec(overrides=back) if back else None


# ------------------------------------------------------------------ states


def _ended(
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


def _paused(state: RolloutState, why: str) -> RolloutState:
    return state.model_copy(update={"phase": ControlPhase.PAUSED, "message": clip(why)})


def _progressing(state: RolloutState, why: str) -> RolloutState:
    return state.model_copy(update={"phase": ControlPhase.PROGRESSING, "message": clip(why)})


def _reload(desired: Desired) -> ReloadWeightsSpec:
    assert desired.weights is not None
    w = desired.weights
    return ReloadWeightsSpec(path=w.path, version=w.version, sha256=dict(w.sha256), strict=w.strict)


def _change_spec(change: Desired, probe: ProbeGate | None = None) -> CommandSpec:
    """The command of a rollout's change: a reload when it changes weights (asking for the
    strategy's probe), else the config."""
    if change.weights is not None:
        reload = _reload(change)
        if probe is None:
            return reload
        asked = ProbeSpec(prompt=probe.prompt, max_tokens=probe.max_tokens)
        return reload.model_copy(update={"probe": asked})
    return UpdateConfigSpec(overrides=dict(change.config))


# ------------------------------------------------------------------ reconcile


def should_run(control: ControlState, target: Target, worker_id: str) -> Desired | None:
    """What a worker of ``target`` should run now (None: a rollout is handling it)."""
    return _should_run(target, control.active(target.name), worker_id)


def _should_run(target: Target, active: Rollout | None, worker_id: str) -> Desired | None:
    stable = target.stable
    if active is None or active.state is None:
        return stable
    state = active.state
    if state.phase is ControlPhase.ROLLING_BACK:
        return None if any(worker_id in w for w in state.waves) else stable
    for index, wave in enumerate(state.waves):
        if worker_id in wave:
            if index < state.wave:
                return applied(stable, active.spec.desired)
            return None if index == state.wave else stable
    return stable


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
    ctx = _Context(control, fleet, {}, now, issuer, published if published is not None else set())
    for target in control.targets():
        if target.name in skip:
            continue
        hold = held(control, target)
        active = control.active(target.name)
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
            desired = _should_run(target, active, worker_id)
            if desired is None:
                continue
            view = fleet.registry.latest(worker_id)
            if view is None or view.in_flight is not None or view.status is not WorkerStatus.READY:
                continue
            spec: CommandSpec
            reported: str | None
            if desired.weights is not None and view.weights_version != desired.weights.version:
                spec, kind, reported = _reload(desired), "weights", view.weights_version
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


def _applying(ctx: _Context, active: Rollout, workers: list[str]) -> set[str]:
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
    if batch_id is not None and ctx.known(batch_id) and not _batch_over(ctx, batch_id):
        out.update(batch)
    return out
