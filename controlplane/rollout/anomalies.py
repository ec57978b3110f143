"""What a rollout's status says beyond its workers' states: the anomalies (conflicting or
unexpected acks, unreadable NACKs), its one-line message, and the status of a rollout known
only from NACKs of a command no worker could read.

No I/O, no clock. The rules are documented in :mod:`controlplane.rollout.fleet`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta

from controlplane.rollout.ledger import Report
from controlplane.rollout.models import (
    Anomaly,
    AnomalyCode,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
    UnverifiedCommand,
    WorkerDetail,
    WorkerState,
)
from controlplane.rollout.registry import shift
from controlplane.rollout.track import Abort, End, Track
from controlplane.wire.protocol import AckState, Command, ReloadWeightsSpec, Selector

#: At most this many per-worker anomalies about unreadable NACKs are listed (then one summary).
MAX_UNREADABLE_ANOMALIES = 20


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
    return _capped(out, len(nacks), AnomalyCode.UNREADABLE_COMMAND_NACK, "such NACK(s)")


def _capped(out: list[Anomaly], total: int, code: AnomalyCode, what: str) -> list[Anomaly]:
    """``out`` (the first :data:`MAX_UNREADABLE_ANOMALIES` of ``total``) and one line
    counting the rest."""
    if total > MAX_UNREADABLE_ANOMALIES:
        more = f"{total - MAX_UNREADABLE_ANOMALIES} more {what} not listed"
        out.append(Anomaly(code=code, message=more))
    return out


def unverified_anomalies(
    command: Command, unverified: Sequence[UnverifiedCommand]
) -> list[Anomaly]:
    """Commands carrying ``command``'s rollout id that the trust store did not verify: shown,
    never the rollout (an earlier issued forgery does not take it over)."""
    out = []
    for entry in unverified[:MAX_UNREADABLE_ANOMALIES]:
        nacks = f"; {entry.nacks} worker(s) refused it too" if entry.nacks else ""
        out.append(
            Anomaly(
                code=AnomalyCode.COMMAND_UNVERIFIED,
                command_id=entry.command_id,
                message=(
                    f"command {entry.command_id} ({entry.kind.value}, issued"
                    f" {entry.issued_at.isoformat()} by {entry.issuer!r}) not verified:"
                    f" {entry.code}: {entry.message}; ignored: rollout {command.rollout_id} is"
                    f" command {command.command_id}{nacks}"
                ),
            )
        )
    return _capped(out, len(unverified), AnomalyCode.COMMAND_UNVERIFIED, "unverified command(s)")


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


def ack_anomalies(
    command: Command, expected: list[Track], unexpected: list[Track]
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
        yield _about(
            track,
            command,
            AnomalyCode.CONFLICTING_TERMINAL_ACKS,
            f"kept {kept.state.value} sent at {kept.sent_at.isoformat()} "
            f"(first terminal wins); ignored {others}",
        )
    spec = command.spec
    # A dry run acks the version in force (it applies nothing): no version to compare with.
    if isinstance(spec, ReloadWeightsSpec) and not command.dry_run:
        for track in expected:
            t = track.terminal
            if (
                t is not None
                and t.state is AckState.SUCCEEDED
                and t.weights_version != spec.version
            ):
                yield _about(
                    track,
                    command,
                    AnomalyCode.VERSION_MISMATCH,
                    f"succeeded reporting weights version {t.weights_version!r}, "
                    f"expected {spec.version!r}",
                )


def _about(track: Track, command: Command, code: AnomalyCode, message: str) -> Anomaly:
    """An anomaly about one worker's acks for ``command``."""
    return Anomaly(
        code=code, worker_id=track.worker_id, command_id=command.command_id, message=message
    )


def message(
    phase: RolloutPhase,
    reason: RolloutReason | None,
    counts: StateCounts,
    expected: int,
    end: End | None,
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
