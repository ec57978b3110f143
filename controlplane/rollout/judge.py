"""Judges one rollout: expected workers, per-worker states and the phase, as a pure function of
its command, its ack ledger, the latest heartbeats, an optional abort and ``now``.

No I/O, no clock. The rules are documented in :mod:`controlplane.rollout.fleet`; one worker's
evidence is a :class:`~controlplane.rollout.track.Track`, what a status says beyond the states
is in :mod:`controlplane.rollout.anomalies`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.rollout.anomalies import ack_anomalies, message
from controlplane.rollout.ledger import CommandLedger, WorkerLedger
from controlplane.rollout.models import (
    Anomaly,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
    WorkerDetail,
    WorkerState,
)
from controlplane.rollout.registry import Registry
from controlplane.rollout.track import (
    Abort,
    End,
    Flights,
    Track,
    ending,
    first_stall,
    state_now,
)
from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import AckState, Command, ReloadWeightsSpec, UpdateConfigSpec

_NO_FLIGHTS: Flights = {}


@dataclass(slots=True)
class Verdict:
    """A rollout judged, before it is dressed as a :class:`RolloutStatus` (cheaper to get)."""

    command: Command
    ledger: CommandLedger
    tracks: dict[str, Track]
    unexpected: list[str]
    end: End | None
    #: What it was judged against: the heartbeats, the instant, the deadline and an abort.
    registry: Registry
    now: datetime
    progress_deadline: timedelta
    abort: Abort | None
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
        and t.error.code == WireCode.EXPIRED.value
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

    def track(w: str) -> Track:
        return Track(w, ledger.workers.get(w), registry, command, now, flights=flights.get(w, ()))

    tracks = {w: track(w) for w in base}
    end: End | None
    expired_unread = False
    if not tracks:
        if any(_expired_nack(ledger.workers[w]) for _, w in joiners):
            # A command published after it expired: the workers that read it said so.
            expired_unread = True
            for _, worker_id in joiners:
                tracks[worker_id] = track(worker_id)
            at = max(issued, command.expires_at)
            end = End(at, RolloutPhase.TIMED_OUT, RolloutReason.EXPIRED)
        else:
            end = End(issued, RolloutPhase.FAILED, RolloutReason.NO_MATCHING_WORKERS)
            unexpected.extend(w for _, w in joiners)
    else:
        # A matching worker that acks joins the expected set, unless it first acked after the
        # rollout had already ended: then it is listed as unexpected and the phase stands.
        joined = 0
        while True:
            end = ending(tracks.values(), command, now, progress_deadline, abort)
            before = joined
            while joined < len(joiners) and (end is None or joiners[joined][0] <= end.at):
                worker_id = joiners[joined][1]
                tracks[worker_id] = track(worker_id)
                joined += 1
            if joined == before:
                break
        unexpected.extend(w for _, w in joiners[joined:])
    return Verdict(
        command,
        ledger,
        tracks,
        unexpected,
        end,
        registry,
        now,
        progress_deadline,
        abort,
        expired_unread,
    )


@dataclass(frozen=True, slots=True)
class Tally:
    """A rollout judged in counts: its status without per-worker lists (``workers`` and
    ``unexpected`` empty), and what those lists would have said, counted. :func:`tally` makes
    it without building a detail per worker (a 10,000-worker rollout judged for a summary)."""

    status: RolloutStatus
    #: Expected workers with a terminal report, by its error code and by its weights version.
    errors: dict[str, int]
    versions: dict[str, int]
    #: Expected workers that reported a different state after the end.
    late: int
    unexpected: int

    @classmethod
    def of(cls, status: RolloutStatus) -> Tally:
        """The tally of a status judged in full (its lists counted, then left out)."""
        errors: collections.Counter[str] = collections.Counter()
        versions: collections.Counter[str] = collections.Counter()
        late = 0
        for detail in status.workers:
            if detail.error is not None:
                errors[detail.error.code] += 1
            if detail.weights_version is not None:
                versions[detail.weights_version] += 1
            late += detail.late_state is not None
        bare = status.model_copy(update={"workers": (), "unexpected": ()})
        return cls(bare, dict(errors), dict(versions), late, len(status.unexpected))


def judge(verdict: Verdict, anomalies: Iterable[Anomaly] = ()) -> RolloutStatus:
    """The status of the rollout :func:`evaluate` judged, dressed for the API, dashboard and
    CLI; ``anomalies`` are the fleet's own about it (duplicate commands, unreadable NACKs)."""
    ordered, extra = _ordered(verdict)
    details = tuple(t.detail(_shown_cut(verdict)) for t in ordered)
    return _dress(
        verdict,
        anomalies,
        ordered,
        extra,
        [d.state for d in details],
        details,
        tuple(t.detail(None) for t in extra),
    )


def details(
    command: Command,
    ledger: CommandLedger | None,
    registry: Registry,
    worker_ids: Iterable[str],
    *,
    now: datetime,
    cut: datetime | None,
    expected: bool = True,
) -> list[WorkerDetail]:
    """The details :func:`judge` lists for ``worker_ids`` of a rollout judged at ``now`` whose
    workers' states are shown at ``cut`` (its end; None while it has none), without judging
    its other workers: a page of a 10,000-worker rollout costs the page. ``expected``: the ids
    are expected workers (else unexpected ones, with a report each: shown as of now, never
    lost). Equal to judge's own details for those ids when ``cut`` is the end that judgment
    found (its ``finished_at``; a command no worker read before it expired aside)."""
    workers = ledger.workers if ledger is not None else {}
    shown = cut if expected else None
    return [
        Track(w, workers.get(w), registry, command, now, expected=expected).detail(shown)
        for w in worker_ids
    ]


def tally(verdict: Verdict, anomalies: Iterable[Anomaly] = ()) -> Tally:
    """:func:`judge` in counts: equal to ``Tally.of(judge(verdict, anomalies))``, cheaper."""
    ordered, extra = _ordered(verdict)
    cut = _shown_cut(verdict)
    errors: collections.Counter[str] = collections.Counter()
    versions: collections.Counter[str] = collections.Counter()
    states = []
    late = 0
    for track in ordered:
        state, late_state = track.states(cut)
        states.append(state)
        late += late_state is not None
        t = track.terminal
        if t is not None:
            if t.error is not None:
                errors[t.error.code] += 1
            if t.weights_version is not None:
                versions[t.weights_version] += 1
    status = _dress(verdict, anomalies, ordered, extra, states, (), ())
    return Tally(status, dict(errors), dict(versions), late, len(extra))


def _shown_cut(verdict: Verdict) -> datetime | None:
    """The instant workers' states are shown at: the end (a command that expired before anyone
    read it: None, all of what the workers said)."""
    end = verdict.end
    return None if end is None or verdict.expired_unread else end.at


def _ordered(verdict: Verdict) -> tuple[list[Track], list[Track]]:
    """The expected workers' tracks by worker id, and the unexpected workers' (never lost)."""
    tracks, command = verdict.tracks, verdict.command
    workers = verdict.ledger.workers
    extra = [
        Track(w, workers[w], verdict.registry, command, verdict.now, expected=False)
        for w in sorted(verdict.unexpected)
    ]
    return [tracks[w] for w in sorted(tracks)], extra


def _dress(
    verdict: Verdict,
    anomalies: Iterable[Anomaly],
    ordered: list[Track],
    extra: list[Track],
    states: list[WorkerState],
    details: tuple[WorkerDetail, ...],
    unexpected: tuple[WorkerDetail, ...],
) -> RolloutStatus:
    cut = verdict.end.at if verdict.end is not None else None
    firsts = [
        t.ledger.first_sent
        for t in ordered
        if t.ledger is not None and (cut is None or t.ledger.first_sent <= cut)
    ]
    return _status(
        verdict.command,
        verdict.now,
        verdict.end,
        verdict.progress_deadline,
        verdict.abort,
        [*anomalies, *ack_anomalies(verdict.command, ordered, extra)],
        states,
        min(firsts, default=None),
        details,
        unexpected,
    )


def _status(
    command: Command,
    now: datetime,
    end: End | None,
    progress_deadline: timedelta,
    abort: Abort | None,
    anomalies: list[Anomaly],
    states: list[WorkerState],
    started: datetime | None,
    details: tuple[WorkerDetail, ...],
    unexpected: tuple[WorkerDetail, ...],
) -> RolloutStatus:
    """The status of a rollout judged: ``started`` is the first ack sent by the end (of an
    expected worker), ``anomalies`` all of them (the fleet's and the acks')."""
    issued = command.issued_at
    cut = end.at if end is not None else None
    counts = StateCounts.of(states)
    if end is not None:
        phase, reason = end.phase, end.reason
        if phase is RolloutPhase.FAILED and reason is None:
            reason = RolloutReason.WORKERS_FAILED
    else:
        phase = RolloutPhase.PROGRESSING if started is not None else RolloutPhase.PENDING
        reason = None
    spec = command.spec
    return RolloutStatus(
        rollout_id=command.rollout_id,
        command_id=command.command_id,
        kind=command.kind,
        target_version=spec.version if isinstance(spec, ReloadWeightsSpec) else None,
        overrides=dict(spec.overrides) if isinstance(spec, UpdateConfigSpec) else None,
        dry_run=bool(command.dry_run),
        issuer=command.issuer,
        selector=command.selector,
        issued_at=issued,
        expires_at=command.expires_at,
        as_of=now,
        phase=phase,
        reason=reason,
        message=_dry(
            command,
            message(phase, reason, counts, len(states), end, progress_deadline, abort, command),
        ),
        expected=len(states),
        counts=counts,
        workers=details,
        unexpected=unexpected,
        anomalies=tuple(
            sorted(
                anomalies,
                key=lambda a: (a.code.value, a.worker_id or "", a.command_id or "", a.message),
            )
        ),
        started_at=started,
        finished_at=cut,
        duration_s=(cut - issued).total_seconds() if cut is not None else None,
    )


#: How a dry run's status message begins: a dry run changes nothing, so it is never a desired
#: version (``Fleet.worker_levels``) and its success is "validated", not applied.
DRY_RUN_PREFIX = "dry run, nothing applied: "


def _dry(command: Command, text: str) -> str:
    return DRY_RUN_PREFIX + text if command.dry_run else text


# --------------------------------------------------------------------------- settled by acks


def settled_end(
    command: Command,
    ledger: CommandLedger | None,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None,
) -> End | None:
    """The end :func:`evaluate` finds, from the acks alone, for a rollout pinned to workers
    that all reported a terminal state before its expiry, any abort and any stall: the last
    terminal report ends it, whatever the heartbeats say (they only decide who is lost, and a
    terminal worker is not; their in-flight spans only add progress). None when that does not
    hold: judge it in full. O(its workers), no :class:`Track` made.

    Progress is judged on the acks' instants alone (accepted, running, terminal sent): fewer
    spans than the full judgment's, so a stall found later than the end (or none) is later
    (or none) there too."""
    ids = command.selector.worker_ids
    if not ids or ledger is None:
        return None
    workers = ledger.workers
    issued = command.issued_at
    at = issued
    ok = True
    points: list[tuple[datetime, datetime]] = []
    succeeded = AckState.SUCCEEDED
    young = now - issued <= progress_deadline  # no stall yet: no progress instants needed
    for worker_id in set(ids):
        held = workers.get(worker_id)
        if held is None:
            return None
        t = held.terminal()
        if t is None:
            return None
        if t.sent_at > at:
            at = t.sent_at
        ok = ok and t.state is succeeded
        if young:
            continue
        points.append((t.sent_at, t.sent_at))
        if held.accepted_sent is not None:
            points.append((held.accepted_sent, held.accepted_sent))
        if held.running_sent is not None:
            points.append((held.running_sent, held.running_sent))
    if command.expires_at <= at or (abort is not None and max(abort.at, issued) <= at):
        return None
    stall = first_stall(points, issued, now, progress_deadline)
    if stall is not None and stall < at:
        return None
    return End(at, RolloutPhase.SUCCEEDED if ok else RolloutPhase.FAILED, None)


def unended_by_acks(
    command: Command,
    ledger: CommandLedger | None,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None,
) -> bool:
    """Whether :func:`evaluate` finds no end by ``now``, known from the acks alone (True), or
    not known (False: judge it in full). True for a rollout pinned to workers not all terminal,
    not expired, not aborted by ``now``, whose acks' instants alone show no stall: the full
    judgment has more progress spans, so no stall either. O(its workers), no :class:`Track`."""
    ids = command.selector.worker_ids
    if not ids or now >= command.expires_at or (abort is not None and abort.at <= now):
        return False
    workers = ledger.workers if ledger is not None else {}
    if now - command.issued_at <= progress_deadline:  # too young to have stalled
        for worker_id in ids:
            held = workers.get(worker_id)
            if held is None or held.terminal() is None:
                return True
        return False
    unresolved = False
    points: list[tuple[datetime, datetime]] = []
    for worker_id in set(ids):
        held = workers.get(worker_id)
        if held is None:
            unresolved = True
            continue
        t = held.terminal()
        if t is None:
            unresolved = True
        else:
            points.append((t.sent_at, t.sent_at))
        if held.accepted_sent is not None:
            points.append((held.accepted_sent, held.accepted_sent))
        if held.running_sent is not None:
            points.append((held.running_sent, held.running_sent))
    return unresolved and first_stall(points, command.issued_at, now, progress_deadline) is None


def tally_by_acks(
    command: Command,
    ledger: CommandLedger | None,
    end: End | None,
    registry: Registry,
    *,
    now: datetime,
    progress_deadline: timedelta,
    abort: Abort | None,
    anomalies: Iterable[Anomaly] = (),
) -> Tally:
    """:func:`tally` of a pinned rollout whose end the acks alone decide: the one
    :func:`settled_end` found (every expected worker in the terminal state it reported), or
    None when :func:`unended_by_acks` found none (each worker's state as of ``now``). No
    :class:`Track` per worker: only for those an ack anomaly may be about."""
    base = set(command.selector.worker_ids or ())
    workers = ledger.workers if ledger is not None else {}
    spec = command.spec
    target = spec.version if isinstance(spec, ReloadWeightsSpec) else None
    errors: dict[str, int] = {}
    versions: dict[str, int] = {}
    states = []
    odd: list[Track] = []  # the workers an ack anomaly may be about
    started: datetime | None = None
    succeeded = AckState.SUCCEEDED  # a local: 10,000 turns
    for worker_id in sorted(base):
        held = workers.get(worker_id)
        # Settled, every worker is terminal, sent by the end: its state then is its state now.
        states.append(state_now(worker_id, held, registry, now))
        if held is None:
            continue
        if started is None or held.first_sent < started:
            started = held.first_sent
        t = held.terminal()
        if t is None:
            continue
        if t.error is not None:
            errors[t.error.code] = errors.get(t.error.code, 0) + 1
        version = t.weights_version
        if version is not None:
            versions[version] = versions.get(version, 0) + 1
        if held.other_terminals or (
            target is not None and t.state is succeeded and version != target
        ):
            odd.append(Track(worker_id, held, registry, command, now))
    extra = [
        Track(w, workers[w], registry, command, now, expected=False)
        for w in sorted(w for w in workers if w not in base)
    ]
    status = _status(
        command,
        now,
        end,
        progress_deadline,
        abort,
        [*anomalies, *ack_anomalies(command, odd, extra)],
        states,
        started,
        (),
        (),
    )
    return Tally(status, errors, versions, 0, len(extra))
