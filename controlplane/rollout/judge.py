"""Judges one rollout: expected workers, per-worker states and the phase, as a pure function of
its command, its ack ledger, the latest heartbeats, an optional abort and ``now``.

No I/O, no clock. The rules are documented in :mod:`controlplane.rollout.fleet`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.rollout.ledger import CommandLedger, Report, WorkerLedger
from controlplane.rollout.models import (
    Anomaly,
    AnomalyCode,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
    WorkerDetail,
    WorkerState,
)
from controlplane.rollout.registry import Registry, lost_at, shift
from controlplane.wire.errors import ErrorCode
from controlplane.wire.protocol import (
    AckState,
    Command,
    Heartbeat,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
)

_TERMINAL_STATES = {
    AckState.SUCCEEDED: WorkerState.SUCCEEDED,
    AckState.FAILED: WorkerState.FAILED,
    AckState.REJECTED: WorkerState.REJECTED,
}

#: At most this many per-worker anomalies about unreadable NACKs are listed (then one summary).
MAX_UNREADABLE_ANOMALIES = 20

Entry = tuple[Heartbeat, datetime | None]
Span = tuple[datetime, datetime]
#: worker id -> spans during which its heartbeats showed the command in flight (one per incarnation).
Flights = Mapping[str, Sequence[Span]]
_NO_FLIGHTS: Flights = {}


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
    """One worker's evidence in one rollout: its ledger, the terminal report that counts, its
    latest heartbeat (with when the reader received it) and ``now``.

    Lost is provisional: a worker is ``lost`` at an instant when its latest heartbeat does not
    prove it alive then (or it was never seen and never acked); it may come back, and its
    terminal ack counts whenever it is sent before the rollout ends.
    """

    __slots__ = (
        "entry",
        "flights",
        "ledger",
        "lost_from",
        "now",
        "registry",
        "silent_from",
        "terminal",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: str,
        ledger: WorkerLedger | None,
        registry: Registry,
        command: Command,
        now: datetime,
        *,
        expected: bool = True,
        flights: Sequence[Span] = (),
    ) -> None:
        self.worker_id = worker_id
        self.ledger = ledger
        self.registry = registry
        self.now = now
        entry = registry.entry(worker_id) if expected else None
        self.terminal: Report | None = ledger.terminal() if ledger is not None else None
        #: From when its latest heartbeat stops proving it alive (never seen, never acked: from
        #: the issue); None: never judged lost (unexpected, or known only from its acks).
        self.lost_from: datetime | None = None
        #: The same on the worker's own clock (``sent_at``), which its acks' times share: what
        #: a verdict may depend on (a function of the log alone, whoever reads it and when).
        self.silent_from: datetime | None = None
        self.entry: Entry | None = None
        self.flights: list[Span] = []
        if not expected:  # an unexpected worker is never waited for, so never lost
            return
        if entry is None:
            if ledger is None:
                self.lost_from = self.silent_from = command.issued_at
            return
        self.entry = entry
        hb, received = entry
        self.lost_from = max(lost_at(hb, received), command.issued_at)
        self.silent_from = max(lost_at(hb), command.issued_at)
        self.flights.extend(flights)
        flight = hb.in_flight
        if (
            flight is not None
            and flight.command_id == command.command_id
            and flight.rollout_id == command.rollout_id
        ):
            self.flights.append((flight.since, hb.sent_at))

    def lost(self, when: datetime) -> bool:
        """Whether its heartbeats do not prove it alive at ``when`` (the reader's clock)."""
        if self.entry is None:
            return self.lost_from is not None
        return not self.registry.was_alive_at(self.worker_id, when)

    @property
    def resolved_at(self) -> datetime | None:
        """When this worker stopped needing to be waited for: its terminal ack."""
        t = self.terminal
        return t.sent_at if t is not None else None

    def state_at(self, cut: datetime | None) -> WorkerState:
        """The state on the evidence sent up to ``cut`` (None: all evidence, liveness at now)."""
        t = self.terminal
        if t is not None and (cut is None or t.sent_at <= cut):
            return _TERMINAL_STATES[t.state]
        if self.lost(self.now if cut is None else cut):
            return WorkerState.LOST
        ledger = self.ledger
        if ledger is not None:
            if ledger.running_sent is not None and (cut is None or ledger.running_sent <= cut):
                return WorkerState.RUNNING
            if ledger.accepted_sent is not None and (cut is None or ledger.accepted_sent <= cut):
                return WorkerState.ACCEPTED
        return WorkerState.PENDING

    def progress(self, out: list[tuple[datetime, datetime]]) -> None:
        """Add the spans during which this worker demonstrably made progress on the command.

        A terminal ack's span (its own ``timings.started_at`` to ``sent_at``) counts only when
        it was sent while the worker's heartbeats still proved it alive; otherwise only the
        instant it was sent does: a silent worker's late report never fills a gap backwards.
        """
        ledger = self.ledger
        if ledger is not None:
            if ledger.accepted_sent is not None:
                out.append((ledger.accepted_sent, ledger.accepted_sent))
            if ledger.running_sent is not None:
                out.append((ledger.running_sent, ledger.running_sent))
        t = self.terminal
        if t is not None:
            if self.silent_from is None or t.sent_at < self.silent_from:
                out.append(((t.started_at or t.sent_at), t.sent_at))
            else:
                out.append((t.sent_at, t.sent_at))
        out.extend(self.flights)

    def detail(self, cut: datetime | None) -> WorkerDetail:
        state = self.state_at(cut)
        now_state = self.state_at(None) if cut is not None else state
        ledger, t = self.ledger, self.terminal
        lost: datetime | None = None
        if state is WorkerState.LOST and self.lost_from is not None:
            when = self.now if cut is None else cut
            lost = self.lost_from if self.lost_from <= when else None
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
            lost_at=lost,
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
            return shift(reach, deadline)
        reach = max(reach, end)
    if now - reach > deadline:
        return shift(reach, deadline)
    return None


def _ending(
    tracks: Iterable[_Track],
    command: Command,
    now: datetime,
    deadline: timedelta,
    abort: Abort | None,
) -> _End | None:
    """The earliest of: all terminal, expiry, abort, progress deadline; None while none happened.

    Lost workers end nothing by themselves (they may come back). At a deadline the phase
    depends on acks only, so it never changes: ``failed`` when a worker had reported a failure
    by then, else ``timed_out``.
    """
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
    if phase is RolloutPhase.TIMED_OUT and any(
        t.terminal is not None
        and t.terminal.sent_at <= at
        and t.terminal.state is not AckState.SUCCEEDED
        for t in tracks
    ):
        phase, reason = RolloutPhase.FAILED, RolloutReason.WORKERS_FAILED
    return _End(at, phase, reason)


@dataclass(slots=True)
class Verdict:
    """A rollout judged, before it is dressed as a :class:`RolloutStatus` (cheaper to get)."""

    command: Command
    ledger: CommandLedger
    tracks: dict[str, _Track]
    unexpected: list[str]
    end: _End | None
    #: No worker was expected and the workers that read the command refused it as expired.
    expired_unread: bool = False

    @property
    def phase(self) -> RolloutPhase:
        if self.end is not None:
            return self.end.phase
        if any(t.ledger is not None for t in self.tracks.values()):
            return RolloutPhase.PROGRESSING
        return RolloutPhase.PENDING


def _expired_nack(ledger: WorkerLedger) -> bool:
    t = ledger.terminal()
    return (
        t is not None
        and t.state is AckState.REJECTED
        and t.error is not None
        and t.error.code == ErrorCode.EXPIRED.value
    )


def evaluate(
    command: Command,
    ledger: CommandLedger | None,
    registry: Registry,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None = None,
    flights: Flights = _NO_FLIGHTS,
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
            if selector.matches(hb.worker_id, hb.labels)
            and registry.was_alive_at(hb.worker_id, issued, own_clock=True)
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

    def track(w: str) -> _Track:
        return _Track(w, ledger.workers.get(w), registry, command, now, flights=flights.get(w, ()))

    tracks = {w: track(w) for w in base}
    end: _End | None
    expired_unread = False
    if not tracks:
        if any(_expired_nack(ledger.workers[w]) for _, w in joiners):
            # A command published after it expired: the workers that read it said so.
            expired_unread = True
            for _, worker_id in joiners:
                tracks[worker_id] = track(worker_id)
            at = max(issued, command.expires_at)
            end = _End(at, RolloutPhase.TIMED_OUT, RolloutReason.EXPIRED)
        else:
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
                tracks[worker_id] = track(worker_id)
                joined += 1
            if joined == before:
                break
        unexpected.extend(w for _, w in joiners[joined:])
    return Verdict(command, ledger, tracks, unexpected, end, expired_unread)


def judge(
    command: Command,
    ledger: CommandLedger | None,
    registry: Registry,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None = None,
    anomalies: Iterable[Anomaly] = (),
    flights: Flights = _NO_FLIGHTS,
) -> RolloutStatus:
    """The status of the rollout that ``command`` started, as of ``now``."""
    verdict = evaluate(
        command,
        ledger,
        registry,
        now=now,
        progress_deadline=progress_deadline,
        abort=abort,
        flights=flights,
    )
    tracks, end, issued = verdict.tracks, verdict.end, command.issued_at
    cut = end.at if end is not None else None
    ordered = [tracks[w] for w in sorted(tracks)]
    # A command that expired before anyone read it: show what the workers said (all of it).
    details = tuple(t.detail(None if verdict.expired_unread else cut) for t in ordered)
    counts = StateCounts.of(d.state for d in details)
    firsts = [
        t.ledger.first_sent
        for t in ordered
        if t.ledger is not None and (cut is None or t.ledger.first_sent <= cut)
    ]
    if end is not None:
        phase, reason = end.phase, end.reason
        if phase is RolloutPhase.FAILED and reason is None:
            reason = RolloutReason.WORKERS_FAILED
    else:
        phase = RolloutPhase.PROGRESSING if firsts else RolloutPhase.PENDING
        reason = None
    spec = command.spec
    workers = verdict.ledger.workers
    extra = [
        _Track(w, workers[w], registry, command, now, expected=False)
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
        message=_message(
            phase, reason, counts, len(details), end, progress_deadline, abort, command
        ),
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


def unreadable_anomalies(rollout_id: str, nacks: Mapping[tuple[str, str], Report]) -> list[Anomaly]:
    """NACKs of records that carried this rollout's ids but did not decode (``kind`` null),
    while a readable command exists: garbage or forged, they never count as a worker's state."""
    out = []
    for (command_id, worker_id), report in sorted(nacks.items())[:MAX_UNREADABLE_ANOMALIES]:
        code = report.error.code if report.error is not None else report.state.value
        out.append(
            Anomaly(
                code=AnomalyCode.UNREADABLE_COMMAND_NACK,
                worker_id=worker_id,
                command_id=command_id,
                message=(
                    f"{worker_id} refused an unreadable record carrying rollout {rollout_id} "
                    f"({code}); ignored: the worker's state comes from the readable command"
                ),
            )
        )
    if len(nacks) > MAX_UNREADABLE_ANOMALIES:
        out.append(
            Anomaly(
                code=AnomalyCode.UNREADABLE_COMMAND_NACK,
                message=f"{len(nacks) - MAX_UNREADABLE_ANOMALIES} more such NACK(s) not listed",
            )
        )
    return out


def rejected(
    rollout_id: str, nacks: Mapping[tuple[str, str], Report], now: datetime
) -> RolloutStatus:
    """A rollout known only from NACKs of a command no worker could read (refused by the
    schema): ``failed`` / ``COMMAND_REJECTED`` from its first NACK, each worker ``rejected``
    with its code. Nothing is expected of it beyond the workers that said so."""
    first: dict[str, tuple[str, Report]] = {}
    for (command_id, worker_id), report in nacks.items():
        held = first.get(worker_id)
        if held is None or (report.order(), command_id) < (held[1].order(), held[0]):
            first[worker_id] = (command_id, report)
    details = tuple(
        WorkerDetail(
            worker_id=w,
            state=WorkerState.REJECTED,
            error=first[w][1].error,
            attempt=first[w][1].attempt,
            acks=1,
            finished_at=first[w][1].sent_at,
            last_ack_at=first[w][1].sent_at,
        )
        for w in sorted(first)
    )
    at = min(r.sent_at for _, r in first.values())
    codes: dict[str, int] = {}
    for _, r in first.values():
        code = r.error.code if r.error is not None else r.state.value
        codes[code] = codes.get(code, 0) + 1
    said = ", ".join(f"{c} x{n}" for c, n in sorted(codes.items()))
    return RolloutStatus(
        rollout_id=rollout_id,
        command_id=min(c for c, _ in nacks),
        kind=None,
        issuer=None,
        selector=Selector(),
        issued_at=at,
        expires_at=None,
        as_of=now,
        phase=RolloutPhase.FAILED,
        reason=RolloutReason.COMMAND_REJECTED,
        message=f"no worker could read the command; {len(details)} refused it: {said}",
        expected=len(details),
        counts=StateCounts(rejected=len(details)),
        workers=details,
        started_at=at,
        finished_at=at,
        duration_s=0.0,
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
    command: Command,
) -> str:
    done = counts.succeeded + counts.failed + counts.rejected
    lost = f" ({counts.lost} lost)" if counts.lost else ""
    if phase is RolloutPhase.PENDING:
        return f"waiting for {expected} worker(s) to acknowledge{lost}"
    if phase is RolloutPhase.PROGRESSING:
        if counts.lost:
            return (
                f"{done} of {expected} worker(s) finished; {counts.lost} lost, waited for until "
                "the command expires or progress stalls"
            )
        return f"{done} of {expected} worker(s) finished"
    if phase is RolloutPhase.SUCCEEDED:
        return f"all {expected} worker(s) succeeded"
    if reason is RolloutReason.NO_MATCHING_WORKERS:
        return "no worker matched the selector when the command was issued"
    if reason is RolloutReason.ABORTED and abort is not None:
        return f"aborted: {abort.reason}"
    if reason is RolloutReason.EXPIRED:
        if expected and done == expected:
            return (
                f"command had expired ({command.expires_at.isoformat()}) when the "
                f"{expected} worker(s) read it"
            )
        return f"command expired with {expected - done} of {expected} worker(s) unfinished{lost}"
    if reason is RolloutReason.PROGRESS_DEADLINE_EXCEEDED and end is not None:
        since = shift(end.at, -deadline).isoformat()
        return (
            f"no progress for {deadline.total_seconds():g}s since {since}; "
            f"{expected - done} of {expected} worker(s) unfinished{lost}"
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
