"""Judges one rollout: expected workers, per-worker states and the phase, as a pure function of
its command, its ack ledger, the latest heartbeats, an optional abort and ``now``.

No I/O, no clock. The rules are documented in :mod:`controlplane.rollout`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.protocol import (
    AckState,
    Command,
    Heartbeat,
    ReloadWeightsSpec,
    UpdateConfigSpec,
)
from controlplane.registry import Registry, is_alive, lost_at, was_alive_at
from controlplane.rollout_ledger import CommandLedger, Report, WorkerLedger
from controlplane.rollout_models import (
    Anomaly,
    AnomalyCode,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
    WorkerDetail,
    WorkerState,
)

_TERMINAL_STATES = {
    AckState.SUCCEEDED: WorkerState.SUCCEEDED,
    AckState.FAILED: WorkerState.FAILED,
    AckState.REJECTED: WorkerState.REJECTED,
}


@dataclass(frozen=True, slots=True)
class Abort:
    at: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class _End:
    at: datetime
    phase: RolloutPhase
    reason: RolloutReason | None


class _Track:
    """One worker's evidence in one rollout: its ledger, the terminal report that counts, and
    (only when it is not alive at ``now``) when its heartbeats stopped proving it alive."""

    __slots__ = ("counted", "in_flight", "ledger", "lost", "terminal", "worker_id")

    def __init__(
        self,
        worker_id: str,
        ledger: WorkerLedger | None,
        hb: Heartbeat | None,
        command: Command,
        now: datetime,
        *,
        expected: bool = True,
    ) -> None:
        self.worker_id = worker_id
        self.ledger = ledger
        self.terminal: Report | None = ledger.terminal() if ledger is not None else None
        self.lost: datetime | None = None
        self.in_flight: tuple[datetime, datetime] | None = None
        if expected:  # an unexpected worker is never waited for, so never lost
            if hb is None:
                # Never heard from: lost from the start, unless its acks prove it exists.
                if ledger is None:
                    self.lost = command.issued_at
            else:
                if not is_alive(hb, now):
                    self.lost = max(lost_at(hb), command.issued_at)
                flight = hb.in_flight
                if (
                    flight is not None
                    and flight.command_id == command.command_id
                    and flight.rollout_id == command.rollout_id
                ):
                    self.in_flight = (flight.since, hb.sent_at)
        t = self.terminal
        #: The terminal report, unless the worker was already lost when it was sent.
        self.counted = (
            t if t is not None and (self.lost is None or t.sent_at <= self.lost) else None
        )

    @property
    def resolved_at(self) -> datetime | None:
        """When this worker stopped needing to be waited for: its terminal ack, or its loss."""
        t = self.counted
        return t.sent_at if t is not None else self.lost

    def state_at(self, cut: datetime | None) -> WorkerState:
        """The state on the evidence sent up to ``cut`` (None: all evidence)."""
        t = self.counted
        if t is not None and (cut is None or t.sent_at <= cut):
            return _TERMINAL_STATES[t.state]
        if self.lost is not None and (cut is None or self.lost <= cut):
            return WorkerState.LOST
        ledger = self.ledger
        if ledger is not None:
            if ledger.running_sent is not None and (cut is None or ledger.running_sent <= cut):
                return WorkerState.RUNNING
            if ledger.accepted_sent is not None and (cut is None or ledger.accepted_sent <= cut):
                return WorkerState.ACCEPTED
        return WorkerState.PENDING

    def progress(self, out: list[tuple[datetime, datetime]]) -> None:
        """Add the spans during which this worker demonstrably made progress on the command."""
        ledger = self.ledger
        if ledger is not None:
            if ledger.accepted_sent is not None:
                out.append((ledger.accepted_sent, ledger.accepted_sent))
            if ledger.running_sent is not None:
                out.append((ledger.running_sent, ledger.running_sent))
        t = self.counted
        if t is not None:
            out.append(((t.started_at or t.sent_at), t.sent_at))
        if self.in_flight is not None:
            out.append(self.in_flight)

    def detail(self, cut: datetime | None) -> WorkerDetail:
        state = self.state_at(cut)
        now_state = self.state_at(None) if cut is not None else state
        ledger, t = self.ledger, self.terminal
        return WorkerDetail(
            worker_id=self.worker_id,
            state=state,
            late_state=now_state if cut is not None and now_state != state else None,
            error=t.error if t is not None else None,
            weights_version=t.weights_version if t is not None else None,
            config_digest=t.config_digest if t is not None else None,
            attempt=t.attempt if t is not None else (ledger.max_attempt if ledger else None),
            acks=ledger.acks if ledger is not None else 0,
            accepted_at=ledger.received_at if ledger is not None else None,
            started_at=ledger.started_at if ledger is not None else None,
            finished_at=(t.finished_at or t.sent_at) if t is not None else None,
            duration_s=t.duration_s if t is not None else None,
            last_ack_at=ledger.last_sent if ledger is not None else None,
            lost_at=self.lost if state is WorkerState.LOST else None,
        )


def first_stall(
    intervals: Iterable[tuple[datetime, datetime]],
    start: datetime,
    now: datetime,
    deadline: timedelta,
) -> datetime | None:
    """The first instant at which nothing had progressed for longer than ``deadline``."""
    reach = start
    for begin, end in sorted(intervals):
        if begin > now:
            break
        if end < start:
            continue
        if begin - reach > deadline:
            return reach + deadline
        reach = max(reach, end)
    if now - reach > deadline:
        return reach + deadline
    return None


def _ending(
    tracks: Iterable[_Track],
    command: Command,
    now: datetime,
    deadline: timedelta,
    abort: Abort | None,
) -> _End | None:
    """The earliest of: all resolved, expiry, abort, progress deadline; None while none happened."""
    tracks = list(tracks)
    candidates: list[tuple[datetime, int, RolloutPhase, RolloutReason | None]] = []
    resolved = [t.resolved_at for t in tracks]
    if all(r is not None for r in resolved):
        at = max([command.issued_at, *(r for r in resolved if r is not None)])
        ok = all(t.state_at(None) is WorkerState.SUCCEEDED for t in tracks)
        phase = RolloutPhase.SUCCEEDED if ok else RolloutPhase.FAILED
        candidates.append((at, 2, phase, None))
    if now >= command.expires_at:
        candidates.append((command.expires_at, 0, RolloutPhase.TIMED_OUT, RolloutReason.EXPIRED))
    if abort is not None and abort.at <= now:
        candidates.append(
            (max(abort.at, command.issued_at), 1, RolloutPhase.ABORTED, RolloutReason.ABORTED)
        )
    intervals: list[tuple[datetime, datetime]] = []
    for t in tracks:
        t.progress(intervals)
    stall = first_stall(intervals, command.issued_at, now, deadline)
    if stall is not None:
        candidates.append(
            (stall, 3, RolloutPhase.TIMED_OUT, RolloutReason.PROGRESS_DEADLINE_EXCEEDED)
        )
    if not candidates:
        return None
    at, _, phase, reason = min(candidates, key=lambda c: (c[0], c[1]))
    return _End(at, phase, reason)


@dataclass(slots=True)
class Verdict:
    """A rollout judged, before it is dressed as a :class:`RolloutStatus` (cheaper to get)."""

    command: Command
    ledger: CommandLedger
    tracks: dict[str, _Track]
    unexpected: list[str]
    end: _End | None

    @property
    def phase(self) -> RolloutPhase:
        if self.end is not None:
            return self.end.phase
        if any(t.ledger is not None for t in self.tracks.values()):
            return RolloutPhase.PROGRESSING
        return RolloutPhase.PENDING


def evaluate(
    command: Command,
    ledger: CommandLedger | None,
    registry: Registry,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None = None,
) -> Verdict:
    """Expected workers, their evidence, and how (and whether) the rollout ended by ``now``."""
    if ledger is None:
        ledger = CommandLedger(command.rollout_id, command.command_id)
    issued = command.issued_at
    selector = command.selector
    unexpected: list[str] = []
    joiners: list[tuple[datetime, str]] = []
    if selector.worker_ids is not None:
        base = set(selector.worker_ids)
        unexpected = [w for w in ledger.workers if w not in base]
    else:
        base = {
            hb.worker_id
            for hb in registry.heartbeats()
            if selector.matches(hb.worker_id, hb.labels) and was_alive_at(hb, issued)
        }
        for worker_id, wl in ledger.workers.items():
            if worker_id in base:
                continue
            hb = registry.latest(worker_id)
            if hb is None or selector.matches(worker_id, hb.labels):
                joiners.append((wl.first_sent, worker_id))
            else:
                unexpected.append(worker_id)
        joiners.sort()

    tracks = {w: _Track(w, ledger.workers.get(w), registry.latest(w), command, now) for w in base}
    end: _End | None
    if not tracks:
        end = _End(issued, RolloutPhase.FAILED, RolloutReason.NO_MATCHING_WORKERS)
        unexpected.extend(w for _, w in joiners)
    else:
        # A matching worker that acks joins the expected set, unless it first acked after the
        # rollout had already ended: then it is listed as unexpected and the phase stands.
        joined = 0
        while True:
            end = _ending(tracks.values(), command, now, progress_deadline, abort)
            before = joined
            while joined < len(joiners) and (end is None or joiners[joined][0] <= end.at):
                worker_id = joiners[joined][1]
                tracks[worker_id] = _Track(
                    worker_id, ledger.workers[worker_id], registry.latest(worker_id), command, now
                )
                joined += 1
            if joined == before:
                break
        unexpected.extend(w for _, w in joiners[joined:])
    return Verdict(command, ledger, tracks, unexpected, end)


def judge(
    command: Command,
    ledger: CommandLedger | None,
    registry: Registry,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None = None,
    anomalies: Iterable[Anomaly] = (),
) -> RolloutStatus:
    """The status of the rollout that ``command`` started, as of ``now``."""
    verdict = evaluate(
        command, ledger, registry, now=now, progress_deadline=progress_deadline, abort=abort
    )
    tracks, end, issued = verdict.tracks, verdict.end, command.issued_at
    cut = end.at if end is not None else None
    ordered = [tracks[w] for w in sorted(tracks)]
    details = tuple(t.detail(cut) for t in ordered)
    counts = StateCounts.of(d.state for d in details)
    firsts = [
        t.ledger.first_sent
        for t in ordered
        if t.ledger is not None and (cut is None or t.ledger.first_sent <= cut)
    ]
    if end is not None:
        phase, reason = end.phase, end.reason
        if phase is RolloutPhase.FAILED and reason is None:
            bad = counts.failed + counts.rejected
            reason = RolloutReason.WORKERS_FAILED if bad else RolloutReason.WORKERS_LOST
    else:
        phase = RolloutPhase.PROGRESSING if firsts else RolloutPhase.PENDING
        reason = None
    spec = command.spec
    workers = verdict.ledger.workers
    extra = [
        _Track(w, workers[w], None, command, now, expected=False)
        for w in sorted(verdict.unexpected)
    ]
    return RolloutStatus(
        rollout_id=command.rollout_id,
        command_id=command.command_id,
        kind=command.kind,
        target_version=spec.version if isinstance(spec, ReloadWeightsSpec) else None,
        overrides=dict(spec.overrides) if isinstance(spec, UpdateConfigSpec) else None,
        issuer=command.issuer,
        selector=command.selector,
        issued_at=issued,
        expires_at=command.expires_at,
        as_of=now,
        phase=phase,
        reason=reason,
        message=_message(phase, reason, counts, len(details), end, progress_deadline, abort),
        expected=len(details),
        counts=counts,
        workers=details,
        unexpected=tuple(t.detail(None) for t in extra),
        anomalies=tuple(
            sorted(
                [*anomalies, *_ack_anomalies(command, ordered, extra)],
                key=lambda a: (a.code.value, a.worker_id or "", a.command_id or "", a.message),
            )
        ),
        started_at=min(firsts, default=None),
        finished_at=cut,
        duration_s=(cut - issued).total_seconds() if cut is not None else None,
    )


def _ack_anomalies(
    command: Command, expected: list[_Track], unexpected: list[_Track]
) -> Iterator[Anomaly]:
    for track in [*expected, *unexpected]:
        if track.ledger is None or len(track.ledger.terminals) < 2:
            continue
        kept = track.terminal
        if kept is None:
            continue
        others = ", ".join(
            f"{r.state.value} at {r.sent_at.isoformat()}" for r in track.ledger.conflicts()
        )
        yield Anomaly(
            code=AnomalyCode.CONFLICTING_TERMINAL_ACKS,
            worker_id=track.worker_id,
            command_id=command.command_id,
            message=(
                f"kept {kept.state.value} sent at {kept.sent_at.isoformat()} "
                f"(first terminal wins); ignored {others}"
            ),
        )
    spec = command.spec
    if isinstance(spec, ReloadWeightsSpec):
        for track in expected:
            t = track.terminal
            if (
                t is not None
                and t.state is AckState.SUCCEEDED
                and t.weights_version != spec.version
            ):
                yield Anomaly(
                    code=AnomalyCode.VERSION_MISMATCH,
                    worker_id=track.worker_id,
                    command_id=command.command_id,
                    message=(
                        f"succeeded reporting weights version {t.weights_version!r}, "
                        f"expected {spec.version!r}"
                    ),
                )


def _message(
    phase: RolloutPhase,
    reason: RolloutReason | None,
    counts: StateCounts,
    expected: int,
    end: _End | None,
    deadline: timedelta,
    abort: Abort | None,
) -> str:
    done = counts.succeeded + counts.failed + counts.rejected + counts.lost
    if phase is RolloutPhase.PENDING:
        return f"waiting for {expected} worker(s) to acknowledge"
    if phase is RolloutPhase.PROGRESSING:
        return f"{done} of {expected} worker(s) finished"
    if phase is RolloutPhase.SUCCEEDED:
        return f"all {expected} worker(s) succeeded"
    if reason is RolloutReason.NO_MATCHING_WORKERS:
        return "no worker matched the selector when the command was issued"
    if reason is RolloutReason.ABORTED and abort is not None:
        return f"aborted: {abort.reason}"
    if reason is RolloutReason.EXPIRED:
        return f"command expired with {expected - done} of {expected} worker(s) unfinished"
    if reason is RolloutReason.PROGRESS_DEADLINE_EXCEEDED and end is not None:
        since = (end.at - deadline).isoformat()
        return (
            f"no progress for {deadline.total_seconds():g}s since {since}; "
            f"{expected - done} of {expected} worker(s) unfinished"
        )
    parts = [
        f"{n} {state.value}"
        for state, n in (
            (WorkerState.FAILED, counts.failed),
            (WorkerState.REJECTED, counts.rejected),
            (WorkerState.LOST, counts.lost),
        )
        if n
    ]
    return f"{expected - counts.succeeded} of {expected} worker(s) did not succeed: " + ", ".join(
        parts
    )
