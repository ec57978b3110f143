"""One worker's evidence in one rollout (:class:`Track`), and when a rollout ends (:func:`ending`).

No I/O, no clock. The rules are documented in :mod:`controlplane.rollout.fleet`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from controlplane.rollout.ledger import Report, WorkerLedger
from controlplane.rollout.models import RolloutPhase, RolloutReason, WorkerDetail, WorkerState
from controlplane.rollout.registry import Registry, shift
from controlplane.wire.protocol import AckState, Command, Heartbeat

#: The worker state a terminal ack reports.
TERMINAL_STATES: Final = {
    AckState.SUCCEEDED: WorkerState.SUCCEEDED,
    AckState.FAILED: WorkerState.FAILED,
    AckState.REJECTED: WorkerState.REJECTED,
}

Entry = tuple[Heartbeat, datetime | None]
Span = tuple[datetime, datetime]
#: worker id -> spans during which its heartbeats showed the command in flight (one per incarnation).
Flights = Mapping[str, Sequence[Span]]


@dataclass(frozen=True, slots=True)
class Abort:
    at: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class End:
    at: datetime
    phase: RolloutPhase
    reason: RolloutReason | None


class Track:
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
        hb = entry[0]
        times = registry.lost_times(worker_id)
        assert times is not None  # it has an entry
        self.lost_from = max(times[0], command.issued_at)
        self.silent_from = max(times[1], command.issued_at)
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
            return TERMINAL_STATES[t.state]
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

    def states(self, cut: datetime | None) -> tuple[WorkerState, WorkerState | None]:
        """The state at ``cut`` (None: now), and the state now when it differs (a late state)."""
        state = self.state_at(cut)
        if cut is None:
            return state, None
        now_state = self.state_at(None)
        return state, (now_state if now_state != state else None)

    def detail(self, cut: datetime | None) -> WorkerDetail:
        state, late_state = self.states(cut)
        ledger, t = self.ledger, self.terminal
        lost: datetime | None = None
        if state is WorkerState.LOST and self.lost_from is not None:
            when = self.now if cut is None else cut
            lost = self.lost_from if self.lost_from <= when else None
        return WorkerDetail(
            worker_id=self.worker_id,
            state=state,
            late_state=late_state,
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


def state_now(
    worker_id: str, ledger: WorkerLedger | None, registry: Registry, now: datetime
) -> WorkerState:
    """``Track(worker_id, ledger, registry, command, now).state_at(None)`` of an expected
    worker, without making the :class:`Track` (a tally of 10,000 workers)."""
    terminal = ledger.terminal() if ledger is not None else None
    if terminal is not None:
        return TERMINAL_STATES[terminal.state]
    if worker_id not in registry:  # never seen: lost unless known from its acks
        if ledger is None:
            return WorkerState.LOST
    elif not registry.was_alive_at(worker_id, now):
        return WorkerState.LOST
    if ledger is not None:
        if ledger.running_sent is not None:
            return WorkerState.RUNNING
        if ledger.accepted_sent is not None:
            return WorkerState.ACCEPTED
    return WorkerState.PENDING


def first_stall(
    intervals: Iterable[tuple[datetime, datetime]],
    start: datetime,
    now: datetime,
    deadline: timedelta,
) -> datetime | None:
    """The first instant at which nothing had progressed for longer than ``deadline``."""
    if now - start <= deadline:  # no gap can be longer than the time since the start
        return None
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


def ending(
    tracks: Iterable[Track],
    command: Command,
    now: datetime,
    deadline: timedelta,
    abort: Abort | None,
) -> End | None:
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
    return End(at, phase, reason)
