"""The rollout state machine: folds commands, acks and heartbeats, in any order, into rollout status.

Pure: no asyncio, no Kafka, no clock (time comes in as ``now``); O(1) per event, status on request.
Whether a worker is alive (``lost`` or not) is judged on the reader's clock: when it received
the worker's latest heartbeat (``received_at``; without one, the heartbeat's own ``sent_at``).
Judge at a ``now`` the reader knows to be current (the coordinator: ``min(clock,
follower.current_as_of())``). A verdict depends only on the log's own timestamps, never on when
a reader received something, so every reader (``--wait``, ``status``, any coordinator) agrees:
in-flight spans and the expected set of a label-only command use the worker's clock, as its
acks do.

The rules (one command per rollout, expected workers, leases, per-worker states, lost is
provisional, phases and deadlines, ended is ended, unreadable commands, bounded memory) are
specified in docs/rollouts.md ("The fold's rules"); the coordinator, the API and the CLI all
rely on them, and tests/unit/test_rollout*.py check them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from controlplane.rollout.anomalies import rejected, unreadable_anomalies, unverified_anomalies
from controlplane.rollout.judge import (
    Tally,
    Verdict,
    evaluate,
    judge,
    settled_end,
    tally,
    tally_by_acks,
    unended_by_acks,
)
from controlplane.rollout.ledger import CommandLedger, Report
from controlplane.rollout.models import (
    Anomaly,
    AnomalyCode,
    OrphanAcks,
    RolloutPhase,
    RolloutStatus,
    UnverifiedCommand,
    WorkerLevel,
)
from controlplane.rollout.registry import Registry, is_alive, seconds
from controlplane.rollout.track import Abort, End
from controlplane.wire.ack_codec import AckLike
from controlplane.wire.protocol import Command, Heartbeat, ReloadWeightsSpec

#: Kubernetes' default ``progressDeadlineSeconds``.
DEFAULT_PROGRESS_DEADLINE_S: Final = 600.0
#: Ended rollouts kept in full by :meth:`Fleet.compact`; older ones become a summary.
DEFAULT_MAX_ENDED_ROLLOUTS: Final = 1000
#: And at most the newest ended rollouts holding this many workers' reports together (about
#: 0.5 KB each: 100 MB; 20 rollouts of 10,000 workers).
DEFAULT_MAX_ENDED_WORKERS: Final = 200_000
#: Commands the trust store did not verify kept (the newest issued); older ones are dropped,
#: with their NACKs.
DEFAULT_MAX_UNVERIFIED: Final = 1000
#: (rollout id, command id) pairs of unverified commands kept after their NACKs were dropped
#: (expired, or dropped beyond ``max_unverified``), per unverified command kept: a NACK of one
#: read later is dropped too, never made a rollout known from NACKs.
_FORGED_PER_UNVERIFIED: Final = 10

_DESIRING = frozenset({RolloutPhase.PENDING, RolloutPhase.PROGRESSING, RolloutPhase.SUCCEEDED})


@dataclass(frozen=True, slots=True)
class FleetStats:
    commands: int
    acks: int
    heartbeats: int
    rollouts: int
    orphan_acks: int
    #: Ended rollouts kept only as a summary, and acks dropped because they were for one.
    compacted: int = 0
    dropped_acks: int = 0
    #: Commands the trust store did not verify (distinct (rollout id, command id)) held, and
    #: those dropped beyond ``max_unverified``.
    unverified: int = 0
    unverified_dropped: int = 0


@dataclass(slots=True)
class FoldState:
    """What a :class:`Fleet` folded from commands and acks, for a snapshot (and back).

    Not the workers' heartbeats: the registry and the in-flight spans are rebuilt by reading the
    workers topic whole (compacted: about one record per worker), so liveness is judged exactly
    as after a full replay. :meth:`Fleet.fold_state` hands out the fleet's own containers (no
    copy): read them while nothing folds."""

    commands: dict[str, list[Command]]
    ledgers: dict[tuple[str, str], CommandLedger]
    unreadable: dict[str, dict[tuple[str, str], Report]]
    aborts: dict[str, Abort]
    ended: dict[str, datetime]
    #: rollout id -> (its final status, details dropped; the ids of its commands and NACKs)
    summaries: dict[str, tuple[RolloutStatus, frozenset[str]]]
    summary_desired: dict[str, tuple[datetime, str, str]]
    commands_seen: int = 0
    acks_seen: int = 0
    dropped_acks: int = 0
    #: rollout id -> command id -> the command the trust store did not verify (never folded)
    unverified: dict[str, dict[str, UnverifiedCommand]] = field(default_factory=dict)
    #: (rollout id, command id) of unverified commands whose NACKs were dropped (oldest first)
    forged: dict[tuple[str, str], None] = field(default_factory=dict)
    unverified_dropped: int = 0


@dataclass(frozen=True, slots=True)
class _Summary:
    """An ended rollout beyond the last ``max_ended_rollouts``: its final status, details dropped."""

    status: RolloutStatus
    command_ids: frozenset[str]


class Fleet:
    """Every rollout and worker the log describes. Feed it events; ask it for status."""

    def __init__(
        self,
        *,
        progress_deadline_s: float = DEFAULT_PROGRESS_DEADLINE_S,
        registry: Registry | None = None,
        max_ended_rollouts: int | None = None,
        max_ended_workers: int | None = None,
        max_unverified: int | None = DEFAULT_MAX_UNVERIFIED,
    ) -> None:
        """``max_ended_rollouts``: how many ended rollouts :meth:`compact` keeps in full
        (None: all; the coordinator sets it); ``max_ended_workers``: and at most the newest
        that hold this many workers' reports together (None: no such bound; the newest ended
        rollout is kept in full whatever its size); ``max_unverified``: how many commands the
        trust store did not verify are kept, the newest issued (None: all)."""
        if not progress_deadline_s > 0:
            raise ValueError(f"progress_deadline_s must be positive, got {progress_deadline_s!r}")
        if max_ended_rollouts is not None and max_ended_rollouts < 0:
            raise ValueError(f"max_ended_rollouts must be >= 0, got {max_ended_rollouts!r}")
        self._deadline = seconds(progress_deadline_s, limit=10 * 365 * 86400.0)
        self._registry = registry if registry is not None else Registry()
        if max_ended_workers is not None and max_ended_workers < 0:
            raise ValueError(f"max_ended_workers must be >= 0, got {max_ended_workers!r}")
        self.max_ended_rollouts = max_ended_rollouts
        self.max_ended_workers = max_ended_workers
        if max_unverified is not None and max_unverified < 0:
            raise ValueError(f"max_unverified must be >= 0, got {max_unverified!r}")
        self.max_unverified = max_unverified
        #: rollout id -> its distinct commands, usually one.
        self._commands: dict[str, list[Command]] = {}
        self._ledgers: dict[tuple[str, str], CommandLedger] = {}
        #: rollout id -> (command id, worker id) -> the earliest NACK of an unreadable record.
        self._unreadable: dict[str, dict[tuple[str, str], Report]] = {}
        self._aborts: dict[str, Abort] = {}
        #: (rollout id, command id) -> (worker id, incarnation's started_at) -> the span its
        #: heartbeats showed the command in flight (the latest heartbeat alone forgets it once
        #: the worker restarts, and a stall judged without it would move).
        self._flights: dict[
            tuple[str, str], dict[tuple[str, datetime], tuple[datetime, datetime]]
        ] = {}
        #: rollout id -> when it ended, for rollouts found ended by :meth:`compact`.
        self._ended: dict[str, datetime] = {}
        self._summaries: dict[str, _Summary] = {}
        #: worker id -> (issued_at, rollout id, version) of the newest summarized reload rollout
        #: that desired a version for it (summaries keep no per-worker details).
        self._summary_desired: dict[str, tuple[datetime, str, str]] = {}
        #: rollout id -> command id -> a command the trust store did not verify: never in
        #: ``_commands`` (``_primary`` takes the earliest issued_at: a forgery would take the
        #: rollout over), shown by :meth:`unverified` and on the rollout's anomalies.
        self._unverified: dict[str, dict[str, UnverifiedCommand]] = {}
        self._n_unverified = 0
        self._n_dropped_unverified = 0
        #: (rollout id, command id) of unverified commands known only as such whose NACKs were
        #: dropped (the command expired, or was dropped beyond ``max_unverified``): NACKs of
        #: them read later are dropped too. Oldest first, bounded.
        self._forged: dict[tuple[str, str], None] = {}
        self._n_commands = 0
        self._n_acks = 0
        self._n_heartbeats = 0
        self._n_dropped_acks = 0

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def progress_deadline_s(self) -> float:
        return self._deadline.total_seconds()

    # ------------------------------------------------------------------ events

    def observe_command(self, command: Command) -> None:
        self._n_commands += 1
        if command.rollout_id in self._summaries:
            return  # a redelivery (or another command) for a rollout that ended long ago
        if self._forged:  # a verified command: NACKs of its id are its own
            self._forged.pop((command.rollout_id, command.command_id), None)
        held = self._commands.setdefault(command.rollout_id, [])
        if command not in held:
            held.append(command)

    def observe_unverified(
        self, command: Command, code: str, message: str, key_id: str | None = None
    ) -> None:
        """Note a command the trust store did not verify (``code``: why). It never becomes or
        changes a rollout; of several with one (rollout id, command id), the earliest issued
        is kept (then the least code and message: the same whatever the order). At most about
        twice ``max_unverified`` are held between two :meth:`compact`."""
        entry = UnverifiedCommand(
            rollout_id=command.rollout_id,
            command_id=command.command_id,
            kind=command.kind,
            issuer=command.issuer,
            issued_at=command.issued_at,
            key_id=key_id,
            code=str(code),
            message=message,
            expires_at=command.expires_at,
        )
        held = self._unverified.get(command.rollout_id, {})
        kept = held.get(command.command_id)
        if kept is not None:
            if _unverified_order(entry) < _unverified_order(kept):
                held[command.command_id] = entry.model_copy(update={"nacks": kept.nacks})
            return
        if (command.rollout_id, command.command_id) in self._forged:
            self._n_dropped_unverified += 1  # dropped before (beyond max_unverified)
            return
        self._unverified.setdefault(command.rollout_id, {})[command.command_id] = entry
        self._n_unverified += 1
        cap = self.max_unverified
        if cap is not None and self._n_unverified > 2 * cap + 64:
            self._trim_unverified(cap)

    def observe_ack(self, ack: AckLike) -> None:
        """Fold one ack: the pydantic :class:`~controlplane.wire.protocol.Ack` or the fast decoder's."""
        self._n_acks += 1
        rollout_id = ack.rollout_id
        if rollout_id in self._summaries:
            self._n_dropped_acks += 1
            return
        if ack.kind is None:  # a NACK of a record the worker could not read
            if self._forged and (rollout_id, ack.command_id) in self._forged:
                self._n_dropped_acks += 1  # of an unverified command whose NACKs were dropped
                return
            nacks = self._unreadable.setdefault(rollout_id, {})
            key = (ack.command_id, ack.worker_id)
            report = Report.of(ack)
            held = nacks.get(key)
            if held is None or report.order() < held.order():
                nacks[key] = report
            return
        key = (rollout_id, ack.command_id)
        ledger = self._ledgers.get(key)
        if ledger is None:
            ledger = self._ledgers[key] = CommandLedger(*key)
        ledger.add(ack)

    def observe_heartbeat(self, heartbeat: Heartbeat, received_at: datetime | None = None) -> bool:
        """True when it became its worker's latest heartbeat.

        ``received_at``: when the reader's side of the log got it (the record's broker
        timestamp, or the reader's clock at the fetch); None: its own ``sent_at``. Liveness is
        judged on it, so a worker's clock skew does not make it look lost.
        """
        self._n_heartbeats += 1
        flight = heartbeat.in_flight
        if flight is not None and flight.rollout_id not in self._summaries:
            spans = self._flights.setdefault((flight.rollout_id, flight.command_id), {})
            key = (heartbeat.worker_id, heartbeat.started_at)
            since, seen = flight.since, heartbeat.sent_at  # the worker's clock, like its acks
            held = spans.get(key)
            spans[key] = (
                (since, seen) if held is None else (min(held[0], since), max(held[1], seen))
            )
        return self._registry.observe(heartbeat, received_at)

    def abort(self, rollout_id: str, reason: str, now: datetime) -> None:
        """Abort a rollout at ``now``, unless it ended before; the earliest abort counts."""
        held = self._aborts.get(rollout_id)
        if held is None or (now, reason) < (held.at, held.reason):
            self._aborts[rollout_id] = Abort(now, reason)

    # ------------------------------------------------------------------ queries

    def __contains__(self, rollout_id: object) -> bool:
        """Whether a rollout has that id: a verified command, a summary, or NACKs of a
        command no worker could read. Not an id known only from unverified commands (nor from
        NACKs of those): the real issuer may still use it."""
        return (
            rollout_id in self._commands
            or rollout_id in self._summaries
            or (isinstance(rollout_id, str) and self._nacks_only(rollout_id))
        )

    def rollout_ids(self) -> list[str]:
        return sorted(self._commands.keys() | self._summaries.keys() | self._nack_rollouts())

    def unverified(self) -> list[UnverifiedCommand]:
        """Every command the trust store did not verify, oldest issued first, each with the
        NACKs (``kind`` null) workers sent for its command id when no verified command of its
        rollout has that id. Empty without a trust store."""
        out = [entry for rid in self._unverified for entry in self._unverified_of(rid)]
        return sorted(out, key=lambda e: (e.issued_at, e.rollout_id, e.command_id))

    def command(self, rollout_id: str) -> Command:
        """The command that is the rollout. Raises KeyError for an unknown rollout (or one
        without a readable command, or summarized)."""
        return _primary(self._commands[rollout_id])

    def issued(self, rollout_id: str) -> datetime:
        """When the rollout was issued (for one without a readable command: its first NACK).
        Raises KeyError for an unknown rollout."""
        commands = self._commands.get(rollout_id)
        if commands is not None:
            return _primary(commands).issued_at
        summary = self._summaries.get(rollout_id)
        if summary is not None:
            return summary.status.issued_at
        nacks = self._nacks(rollout_id)
        if not nacks:
            raise KeyError(rollout_id)
        return min(r.sent_at for r in nacks.values())

    def status(self, rollout_id: str, now: datetime) -> RolloutStatus:
        """The rollout's status at ``now``. Raises KeyError when no command or NACK has that
        rollout id."""
        commands = self._commands.get(rollout_id)
        if commands is None:
            summary = self._summaries.get(rollout_id)
            if summary is not None:
                return summary.status.model_copy(update={"as_of": now})
            rejections = self._nacks(rollout_id)
            if not rejections:
                raise KeyError(rollout_id)
            return rejected(rollout_id, rejections, now)
        command = _primary(commands)
        anomalies = self._command_anomalies(command, commands)
        nacks = self._nacks(rollout_id)
        if nacks:
            anomalies += unreadable_anomalies(rollout_id, nacks)
        return judge(self._evaluate(command, now), anomalies)

    def tally(self, rollout_id: str, now: datetime) -> Tally:
        """:meth:`status` in counts, equal to ``Tally.of(self.status(rollout_id, now))`` but
        without a detail per worker (what a summary needs). Raises KeyError as status does."""
        commands = self._commands.get(rollout_id)
        if commands is None:
            return Tally.of(self.status(rollout_id, now))  # summarized, or NACKs only: small
        command = _primary(commands)
        anomalies = self._command_anomalies(command, commands)
        nacks = self._nacks(rollout_id)
        if nacks:
            anomalies += unreadable_anomalies(rollout_id, nacks)
        ledger = self._ledgers.get((rollout_id, command.command_id))
        abort = self._aborts.get(rollout_id)
        end = self._settled_end(command, now)
        if end is not None or unended_by_acks(
            command, ledger, now=now, progress_deadline=self._deadline, abort=abort
        ):
            return tally_by_acks(
                command,
                ledger,
                end,
                self._registry,
                now=now,
                progress_deadline=self._deadline,
                abort=abort,
                anomalies=anomalies,
            )
        return tally(self._evaluate(command, now), anomalies)

    def _settled_end(self, command: Command, now: datetime) -> End | None:
        """:func:`settled_end` of the command's rollout: its end from the acks alone, or None."""
        rid = command.rollout_id
        return settled_end(
            command,
            self._ledgers.get((rid, command.command_id)),
            now=now,
            progress_deadline=self._deadline,
            abort=self._aborts.get(rid),
        )

    def _evaluate(self, command: Command, now: datetime) -> Verdict:
        """Judge ``command``'s rollout at ``now`` on everything folded so far."""
        rid, cid = command.rollout_id, command.command_id
        return evaluate(
            command,
            self._ledgers.get((rid, cid)),
            self._registry,
            now=now,
            progress_deadline=self._deadline,
            abort=self._aborts.get(rid),
            flights=self._flights_of(rid, cid),
        )

    def rollouts(self, now: datetime) -> list[RolloutStatus]:
        """Every rollout's status, oldest issued first."""
        return [self.status(rid, now) for _, rid in self.rollout_keys()]

    def rollout_keys(self) -> list[tuple[datetime, str]]:
        """(issued_at, rollout id) of every rollout, oldest issued first (cheap: judges nothing)."""
        return sorted((self.issued(rid), rid) for rid in self.rollout_ids())

    def orphans(self) -> list[OrphanAcks]:
        """Acks whose command has not been seen, by (rollout id, command id)."""
        known = {(c.rollout_id, c.command_id) for cs in self._commands.values() for c in cs}
        out = []
        for key in sorted(self._ledgers):
            ledger = self._ledgers[key]
            first, last = ledger.first_sent, ledger.last_sent
            if key in known or first is None or last is None:
                continue
            out.append(
                OrphanAcks(
                    rollout_id=key[0],
                    command_id=key[1],
                    workers=len(ledger.workers),
                    acks=ledger.acks,
                    first_sent_at=first,
                    last_sent_at=last,
                )
            )
        return out

    def worker_levels(self, now: datetime) -> list[WorkerLevel]:
        """Per worker: the desired weights version against the reported one, sorted by worker id.

        Desired is the target of the latest issued reload rollout that expects the worker and is
        pending, progressing or succeeded (a failed, timed-out or aborted one desires nothing;
        nor does a dry run, which changes nothing however it ends).
        """
        desired: dict[str, tuple[str, str, datetime]] = {}
        newest_first = sorted(
            map(_primary, self._commands.values()),
            key=lambda c: (c.issued_at, c.rollout_id),
            reverse=True,
        )
        for command in newest_first:
            spec = command.spec
            if not isinstance(spec, ReloadWeightsSpec) or command.dry_run:
                continue
            ids = command.selector.worker_ids
            if ids is not None and all(w in desired for w in ids):
                continue  # a newer rollout already decides for all of its workers
            end = self._settled_end(command, now)
            if end is not None and ids is not None:  # settled by its acks: its pinned workers
                phase, expected = end.phase, set(ids)
            else:
                verdict = self._evaluate(command, now)
                phase, expected = verdict.phase, set(verdict.tracks)
            if phase in _DESIRING:
                for worker_id in expected:
                    desired.setdefault(
                        worker_id, (spec.version, command.rollout_id, command.issued_at)
                    )
        for worker_id, (issued, rollout_id, version) in self._summary_desired.items():
            held = desired.get(worker_id)
            if held is None or (issued, rollout_id) > (held[2], held[1]):
                desired[worker_id] = (version, rollout_id, issued)
        levels = []
        registry = self._registry
        known = {hb.worker_id for hb in registry.heartbeats()}
        for worker_id in sorted(desired.keys() | known):
            hb = registry.latest(worker_id)
            want = desired.get(worker_id)
            reported = hb.weights_version if hb is not None else None
            degraded = hb is not None and hb.degraded is not None
            levels.append(
                WorkerLevel(
                    worker_id=worker_id,
                    alive=hb is not None and is_alive(hb, now, registry.received_at(worker_id)),
                    reported_version=reported,
                    desired_version=want[0] if want else None,
                    desired_rollout_id=want[1] if want else None,
                    degraded=degraded,
                    in_sync=not degraded and (want is None or reported == want[0]),
                )
            )
        return levels

    def stats(self) -> FleetStats:
        known = {(c.rollout_id, c.command_id) for cs in self._commands.values() for c in cs}
        return FleetStats(
            commands=self._n_commands,
            acks=self._n_acks,
            heartbeats=self._n_heartbeats,
            rollouts=len(self.rollout_ids()),
            orphan_acks=sum(v.acks for k, v in self._ledgers.items() if k not in known),
            compacted=len(self._summaries),
            dropped_acks=self._n_dropped_acks,
            unverified=self._n_unverified,
            unverified_dropped=self._n_dropped_unverified,
        )

    # ------------------------------------------------------------------ memory

    def compact(self, now: datetime) -> int:
        """Keep the last ``max_ended_rollouts`` ended rollouts (by end, then id) in full, within
        ``max_ended_workers`` (:meth:`excess`); turn older ones into a final summary and drop their commands, acks and NACKs. Returns how
        many were summarized. Judges only rollouts not yet known to have ended; call it with a
        ``now`` the reader knows to be current, every few seconds (the coordinator does, one
        rollout at a time: :meth:`unended`, :meth:`check_ended`, :meth:`summarize_excess`)."""
        if self.max_ended_rollouts is None:
            return 0
        for rollout_id in self.unended():
            self.check_ended(rollout_id, now)
        self.compact_unverified(now)
        return self.summarize_excess(now)

    def compact_unverified(self, now: datetime) -> int:
        """Bound what unverified commands hold: one known only as such that expired by ``now``
        keeps its NACKs as a count (those read later are dropped: never a rollout known from
        NACKs); beyond ``max_unverified``, the oldest issued are dropped, with their NACKs.
        Returns how many were dropped. :meth:`compact` calls it."""
        for rollout_id in list(self._unverified):
            forged = self._forged_ids(rollout_id)
            for command_id, entry in list(self._unverified[rollout_id].items()):
                if (
                    command_id in forged
                    and entry.expires_at is not None
                    and entry.expires_at <= now
                    and (rollout_id, command_id) not in self._forged
                ):
                    self._settle(rollout_id, command_id)
        cap = self.max_unverified
        if cap is None or self._n_unverified <= cap:
            return 0
        return self._trim_unverified(cap)

    def is_summarized(self, rollout_id: str) -> bool:
        """Whether the rollout is kept only as a final summary."""
        return rollout_id in self._summaries

    def unended(self) -> list[str]:
        """Rollouts held in full and not known to have ended (what :meth:`check_ended` judges)."""
        ended = self._ended
        return sorted(r for r in self._commands.keys() | self._nack_rollouts() if r not in ended)

    def ended(self, rollout_id: str) -> datetime | None:
        """When the rollout ended, if known (noted by :meth:`check_ended` or :meth:`note_ended`;
        summarized rollouts ended at their summary's ``finished_at``); None: not known."""
        at = self._ended.get(rollout_id)
        if at is None and rollout_id in self._summaries:
            at = self._summaries[rollout_id].status.finished_at
        return at

    def note_ended(self, status: RolloutStatus) -> None:
        """Remember that a rollout ended, from a status judged of it at an instant the reader
        knew to be current (the coordinator's cached judgments): :meth:`compact` need not
        judge it again. An ended rollout stays ended, so one such judgment is enough."""
        rollout_id = status.rollout_id
        if (
            status.terminal
            and status.finished_at is not None
            and not status.details_dropped
            and rollout_id in self
            and rollout_id not in self._summaries
        ):
            self._ended.setdefault(rollout_id, status.finished_at)

    def check_ended(self, rollout_id: str, now: datetime) -> datetime | None:
        """Judge whether the rollout has ended by ``now`` (cheaply: no per-worker details) and
        remember it; when it ended, or None. Raises KeyError for an unknown rollout."""
        held = self.ended(rollout_id)
        if held is not None:
            return held
        commands = self._commands.get(rollout_id)
        if commands is None:
            status = self.status(rollout_id, now)  # known from NACKs only: small
            at = status.finished_at if status.terminal else None
        else:
            command = _primary(commands)
            end = self._settled_end(command, now)
            if end is None and not unended_by_acks(
                command,
                self._ledgers.get((rollout_id, command.command_id)),
                now=now,
                progress_deadline=self._deadline,
                abort=self._aborts.get(rollout_id),
            ):
                end = self._evaluate(command, now).end
            at = None if end is None else end.at
        if at is not None:
            self._ended[rollout_id] = at
        return at

    def summarize_excess(self, now: datetime) -> int:
        """Summarize the ended rollouts known beyond the bounds (:meth:`excess`); how many."""
        excess = self.excess()
        for rollout_id in excess:
            self.summarize(rollout_id, now)
        return len(excess)

    def excess(self) -> list[str]:
        """The ended rollouts held in full beyond the last ``max_ended_rollouts``, or beyond
        the newest that together hold ``max_ended_workers`` workers' reports (always at least
        the newest one): oldest end first, what compaction summarizes."""
        keep = self.max_ended_rollouts
        if keep is None:
            return []
        ended: Iterable[tuple[str, datetime]] = self._ended.items()
        if self._unverified:  # a NACK-only rollout found ended, then its command came unverified
            ended = [(r, at) for r, at in ended if r in self]
        newest_first = sorted(ended, key=lambda kv: (kv[1], kv[0]), reverse=True)
        kept = min(keep, len(newest_first))
        budget = self.max_ended_workers
        if budget is not None:
            held = 0
            for i, (rollout_id, _) in enumerate(newest_first[:kept]):
                held += self._workers_held(rollout_id)
                if held > budget and i > 0:
                    kept = i
                    break
        return [rollout_id for rollout_id, _ in reversed(newest_first[kept:])]

    def _workers_held(self, rollout_id: str) -> int:
        """How many workers' reports the fold holds for a rollout (its ledgers and NACKs)."""
        count = len(self._unreadable.get(rollout_id, ()))
        for command in self._commands.get(rollout_id, ()):
            ledger = self._ledgers.get((rollout_id, command.command_id))
            count += 0 if ledger is None else len(ledger.workers)
        return count

    def summarize(self, rollout_id: str, now: datetime) -> None:
        """Keep an ended rollout only as its final summary (see :meth:`compact`); judged in
        counts (:meth:`tally`), so one of 10,000 workers costs little."""
        status = self.tally(rollout_id, now).status
        expected: Iterable[str] = ()
        commands = self._commands.get(rollout_id, [])
        target = status.target_version
        desiring = bool(commands) and status.phase in _DESIRING and not _primary(commands).dry_run
        if desiring and target is not None:
            primary = _primary(commands)
            ids = primary.selector.worker_ids
            if ids is not None and self._settled_end(primary, now) is not None:
                expected = set(ids)
            else:
                expected = self._evaluate(primary, now).tracks.keys()
        forged = self._forged_ids(rollout_id)
        commands = self._commands.pop(rollout_id, [])
        command_ids = frozenset(c.command_id for c in commands)
        nacks = {
            k: r for k, r in self._unreadable.pop(rollout_id, {}).items() if k[0] not in forged
        }
        for command_id in command_ids:
            self._ledgers.pop((rollout_id, command_id), None)
            self._flights.pop((rollout_id, command_id), None)
        self._aborts.pop(rollout_id, None)
        del self._ended[rollout_id]
        if desiring and target is not None:
            primary = _primary(commands)
            mine = (primary.issued_at, rollout_id, target)
            for worker_id in expected:
                held = self._summary_desired.get(worker_id)
                if held is None or mine[:2] > held[:2]:
                    self._summary_desired[worker_id] = mine
        summary = status.model_copy(
            update={
                # The expected ids are per-worker detail too (a CLI-pinned command names them all).
                "selector": status.selector.model_copy(update={"worker_ids": None}),
                "workers": (),
                "unexpected": (),
                "anomalies": (),
                "details_dropped": True,
                "message": status.message + " (per-worker details dropped: an older ended rollout)",
            }
        )
        self._summaries[rollout_id] = _Summary(summary, command_ids | {c for c, _ in nacks})

    # ------------------------------------------------------------------ snapshots

    def fold_state(self) -> FoldState:
        """What this fleet folded from commands and acks (its own containers: no copy)."""
        return FoldState(
            commands=self._commands,
            ledgers=self._ledgers,
            unreadable=self._unreadable,
            aborts=self._aborts,
            ended=self._ended,
            summaries={r: (s.status, s.command_ids) for r, s in self._summaries.items()},
            summary_desired=self._summary_desired,
            commands_seen=self._n_commands,
            acks_seen=self._n_acks,
            dropped_acks=self._n_dropped_acks,
            unverified=self._unverified,
            forged=self._forged,
            unverified_dropped=self._n_dropped_unverified,
        )

    def restore(self, state: FoldState) -> None:
        """Take ``state`` (a snapshot's) as what was folded so far from commands and acks; only
        on a fleet that has folded none (ValueError otherwise). Heartbeats are folded as usual."""
        if (
            self._commands
            or self._ledgers
            or self._unreadable
            or self._summaries
            or self._unverified
        ):
            raise ValueError("a snapshot is restored only into a fleet that folded no command")
        self._commands = state.commands
        self._ledgers = state.ledgers
        self._unreadable = state.unreadable
        self._aborts = state.aborts
        self._ended = state.ended
        self._summaries = {r: _Summary(s, ids) for r, (s, ids) in state.summaries.items()}
        self._summary_desired = state.summary_desired
        self._n_commands = state.commands_seen
        self._n_acks = state.acks_seen
        self._n_dropped_acks = state.dropped_acks
        self._unverified = state.unverified
        self._n_unverified = sum(len(held) for held in state.unverified.values())
        self._forged = state.forged
        self._n_dropped_unverified = state.unverified_dropped

    # ------------------------------------------------------------------ internals

    def _flights_of(
        self, rollout_id: str, command_id: str
    ) -> dict[str, list[tuple[datetime, datetime]]]:
        spans = self._flights.get((rollout_id, command_id))
        out: dict[str, list[tuple[datetime, datetime]]] = {}
        if spans:
            for (worker_id, _), span in spans.items():
                out.setdefault(worker_id, []).append(span)
        return out

    def _forged_ids(self, rollout_id: str) -> frozenset[str]:
        """The rollout's command ids known only from unverified commands. None for a rollout
        known from NACKs only and found ended: its verdict was given, and it stays."""
        held = self._unverified.get(rollout_id)
        if not held or (rollout_id in self._ended and rollout_id not in self._commands):
            return frozenset()
        verified = {c.command_id for c in self._commands.get(rollout_id, ())}
        summary = self._summaries.get(rollout_id)
        if summary is not None:
            verified |= summary.command_ids
        return frozenset(held.keys() - verified)

    def _nacks(self, rollout_id: str) -> dict[tuple[str, str], Report] | None:
        """The rollout's NACKs (``kind`` null) but those of unverified commands' ids: judged
        when asked, never when folded (a NACK may come before its command)."""
        nacks = self._unreadable.get(rollout_id)
        forged = self._forged_ids(rollout_id) if nacks else None
        if not forged or nacks is None:
            return nacks
        return {key: report for key, report in nacks.items() if key[0] not in forged}

    def _nacks_only(self, rollout_id: str) -> bool:
        """Whether the rollout is known from NACKs of a command no worker could read (not
        only from NACKs of unverified ones)."""
        return bool(self._nacks(rollout_id))

    def _nack_rollouts(self) -> set[str]:
        """The rollout ids NACKs make known (:meth:`_nacks_only`)."""
        if not self._unverified:
            return set(self._unreadable)
        return {r for r in self._unreadable if self._nacks_only(r)}

    def _unverified_of(self, rollout_id: str) -> list[UnverifiedCommand]:
        """The rollout's unverified commands, each with the NACKs of its command id (when no
        verified command has that id)."""
        held = self._unverified.get(rollout_id, {})
        nacks = self._unreadable.get(rollout_id, {})
        forged = self._forged_ids(rollout_id)
        counts: dict[str, int] = {}
        for command_id, _ in nacks:
            if command_id in forged:
                counts[command_id] = counts.get(command_id, 0) + 1
        return [
            entry.model_copy(update={"nacks": entry.nacks + counts[cid]})
            if cid in counts
            else entry
            for cid, entry in sorted(held.items())
        ]

    def _settle(self, rollout_id: str, command_id: str) -> None:
        """Count the NACKs of an unverified command known only as such into its entry, drop
        them, and drop any read later."""
        nacks = self._unreadable.get(rollout_id)
        count = 0
        if nacks:
            mine = [key for key in nacks if key[0] == command_id]
            for key in mine:
                del nacks[key]
            count = len(mine)
            if not nacks:
                del self._unreadable[rollout_id]
                if rollout_id not in self._commands and rollout_id not in self._summaries:
                    self._ended.pop(rollout_id, None)  # found ended before its command came
        held = self._unverified[rollout_id]
        entry = held[command_id]
        if count:
            held[command_id] = entry.model_copy(update={"nacks": entry.nacks + count})
        self._forged[(rollout_id, command_id)] = None
        limit = _FORGED_PER_UNVERIFIED * max(self.max_unverified or 0, 100)
        while len(self._forged) > limit:
            del self._forged[next(iter(self._forged))]

    def _trim_unverified(self, cap: int) -> int:
        """Keep the newest issued ``cap`` unverified commands; drop the others (with their
        NACKs, when known only as such); how many were dropped."""
        entries = sorted(
            (e for held in self._unverified.values() for e in held.values()),
            key=lambda e: (e.issued_at, e.rollout_id, e.command_id),
            reverse=True,
        )
        for entry in entries[cap:]:
            rollout_id, command_id = entry.rollout_id, entry.command_id
            if command_id in self._forged_ids(rollout_id):
                self._settle(rollout_id, command_id)
            held = self._unverified[rollout_id]
            del held[command_id]
            if not held:
                del self._unverified[rollout_id]
        dropped = max(0, len(entries) - cap)
        self._n_unverified -= dropped
        self._n_dropped_unverified += dropped
        return dropped

    def _command_anomalies(self, primary: Command, commands: list[Command]) -> list[Anomaly]:
        out = []
        for other in commands:
            if other is primary:
                continue
            ledger = self._ledgers.get((other.rollout_id, other.command_id))
            acks = f"; {ledger.acks} ack(s) for it ignored" if ledger is not None else ""
            if other.command_id == primary.command_id:
                code = AnomalyCode.COMMAND_ID_REUSED
                text = f"command id {other.command_id} seen again with different content"
            else:
                code = AnomalyCode.DUPLICATE_ROLLOUT_COMMAND
                text = (
                    f"command {other.command_id} ignored: rollout {primary.rollout_id} "
                    f"is command {primary.command_id}{acks}"
                )
            out.append(Anomaly(code=code, message=text, command_id=other.command_id))
        if primary.rollout_id in self._unverified:
            out += unverified_anomalies(primary, self._unverified_of(primary.rollout_id))
        return out


def _unverified_order(entry: UnverifiedCommand) -> tuple[datetime, str, str, str]:
    return (entry.issued_at, entry.code, entry.message, entry.key_id or "")


def _primary(commands: list[Command]) -> Command:
    if len(commands) == 1:
        return commands[0]
    return min(commands, key=lambda c: (c.issued_at, c.command_id, c.model_dump_json()))
