"""The rollout state machine: folds commands, acks and heartbeats, in any order, into rollout status.

Pure: no asyncio, no Kafka, no clock (time comes in as ``now``); O(1) per event, status on request.

Rules (the coordinator, the API and the CLI all rely on them):

* **One command per rollout.** Of several commands with one ``rollout_id`` the earliest issued
  (ties: lowest ``command_id``) is the rollout; the others are reported as anomalies, ignored.
* **Expected workers**, fixed by the command and the log, never by arrival order. Explicit
  ``selector.worker_ids`` (what our CLI publishes after resolving labels): exactly those.
  Otherwise (a label-only command, e.g. from kcat): every worker matching the selector whose
  latest known heartbeat shows an incarnation alive at ``issued_at`` (``started_at <= issued_at``
  and ``sent_at >= issued_at - 3 * interval_s``, not stopped by then), plus any worker that acks
  the command and matches by its latest labels (or has no heartbeat), unless its first ack was
  sent after the rollout had ended. None expected: ``failed`` / ``NO_MATCHING_WORKERS`` at once.
* **Per-worker state** only moves forward: pending < accepted < running < terminal (succeeded,
  failed, rejected, lost). The first terminal ack by ``sent_at`` wins; redelivered duplicates
  change nothing; a different terminal state later is an anomaly. Acks from workers outside the
  expected set are listed as ``unexpected`` and counted nowhere. Acks whose command never
  appeared are kept (``orphans()``) and folded in when it does.
* **Lost**: an expected worker with no counted terminal ack whose latest heartbeat no longer
  proves it alive at ``now`` (silent for over 3 periods, or stopped), or that was never seen at
  all and never acked. It is lost from when its heartbeats stopped proving it alive; a terminal
  ack sent after that does not count. A restarted worker (newer incarnation) is alive, not lost:
  it is expected to re-apply the redelivered command, or the deadlines below end the rollout.
* **Phase** is a pure function of the events and ``now``; event timestamps, not arrival order,
  decide. It ends at the earliest of: every expected worker resolved (terminal or lost), giving
  ``succeeded`` if all succeeded else ``failed`` (``WORKERS_FAILED`` / ``WORKERS_LOST``); the
  command's ``expires_at`` (``timed_out`` / ``EXPIRED``); an ``abort`` (``aborted``); and the
  progress deadline: more than ``progress_deadline_s`` without progress (``timed_out`` /
  ``PROGRESS_DEADLINE_EXCEEDED``), where progress is an expected worker's accepted, running or
  terminal ack, the span of a terminal ack's own ``timings.started_at`` to ``sent_at``, and the
  span of a latest heartbeat showing the command in flight (keep the deadline above three
  heartbeat periods: a silent worker's in-flight span ends at its last heartbeat).
* **Ended is ended.** Counts and per-worker states are those as of ``finished_at``; what a
  worker reported later shows as its ``late_state``. Acks sent after the end (late, or
  redelivered) never change the phase, whenever they arrive; an ack sent before the end counts
  even if it arrives after a lagging coordinator showed a verdict. Heartbeats can change it:
  a worker judged lost that comes back is alive again (a replay, seeing only its latest
  heartbeat, agrees).
* **Not durable**: ``abort`` lives only in this object until aborts travel on a topic.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from controlplane.ack_codec import AckLike
from controlplane.protocol import Command, Heartbeat, ReloadWeightsSpec
from controlplane.registry import Registry, is_alive
from controlplane.rollout_ledger import CommandLedger
from controlplane.rollout_models import (
    Anomaly,
    AnomalyCode,
    OrphanAcks,
    RolloutPhase,
    RolloutStatus,
    WorkerLevel,
)
from controlplane.rollout_status import Abort, evaluate, judge

#: Kubernetes' default ``progressDeadlineSeconds``.
DEFAULT_PROGRESS_DEADLINE_S: Final = 600.0

_DESIRING = frozenset({RolloutPhase.PENDING, RolloutPhase.PROGRESSING, RolloutPhase.SUCCEEDED})


@dataclass(frozen=True, slots=True)
class FleetStats:
    commands: int
    acks: int
    heartbeats: int
    rollouts: int
    orphan_acks: int


class Fleet:
    """Every rollout and worker the log describes. Feed it events; ask it for status."""

    def __init__(
        self,
        *,
        progress_deadline_s: float = DEFAULT_PROGRESS_DEADLINE_S,
        registry: Registry | None = None,
    ) -> None:
        if not progress_deadline_s > 0:
            raise ValueError(f"progress_deadline_s must be positive, got {progress_deadline_s!r}")
        self._deadline = timedelta(seconds=progress_deadline_s)
        self._registry = registry if registry is not None else Registry()
        #: rollout id -> its distinct commands, usually one.
        self._commands: dict[str, list[Command]] = {}
        self._ledgers: dict[tuple[str, str], CommandLedger] = {}
        self._aborts: dict[str, Abort] = {}
        self._n_commands = 0
        self._n_acks = 0
        self._n_heartbeats = 0

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def progress_deadline_s(self) -> float:
        return self._deadline.total_seconds()

    # ------------------------------------------------------------------ events

    def observe_command(self, command: Command) -> None:
        self._n_commands += 1
        held = self._commands.setdefault(command.rollout_id, [])
        if command not in held:
            held.append(command)

    def observe_ack(self, ack: AckLike) -> None:
        """Fold one ack: the pydantic :class:`~controlplane.protocol.Ack` or the fast decoder's."""
        self._n_acks += 1
        key = (ack.rollout_id, ack.command_id)
        ledger = self._ledgers.get(key)
        if ledger is None:
            ledger = self._ledgers[key] = CommandLedger(*key)
        ledger.add(ack)

    def observe_heartbeat(self, heartbeat: Heartbeat, received_at: datetime | None = None) -> bool:
        """True when it became its worker's latest heartbeat.

        ``received_at``: when the reader's side of the log got it (the record's broker
        timestamp, or the reader's clock at the fetch); None: its own ``sent_at``.
        """
        self._n_heartbeats += 1
        return self._registry.observe(heartbeat, received_at)

    def abort(self, rollout_id: str, reason: str, now: datetime) -> None:
        """Abort a rollout at ``now``, unless it ended before; the earliest abort counts."""
        held = self._aborts.get(rollout_id)
        if held is None or (now, reason) < (held.at, held.reason):
            self._aborts[rollout_id] = Abort(now, reason)

    # ------------------------------------------------------------------ queries

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._commands

    def rollout_ids(self) -> list[str]:
        return sorted(self._commands)

    def command(self, rollout_id: str) -> Command:
        """The command that is the rollout. Raises KeyError for an unknown rollout."""
        return _primary(self._commands[rollout_id])

    def status(self, rollout_id: str, now: datetime) -> RolloutStatus:
        """The rollout's status at ``now``. Raises KeyError when no command has that rollout id."""
        commands = self._commands[rollout_id]
        command = _primary(commands)
        return judge(
            command,
            self._ledgers.get((rollout_id, command.command_id)),
            self._registry,
            now=now,
            progress_deadline=self._deadline,
            abort=self._aborts.get(rollout_id),
            anomalies=self._command_anomalies(command, commands),
        )

    def rollouts(self, now: datetime) -> list[RolloutStatus]:
        """Every rollout's status, oldest issued first."""
        primaries = sorted(
            (_primary(c) for c in self._commands.values()),
            key=lambda c: (c.issued_at, c.rollout_id),
        )
        return [self.status(c.rollout_id, now) for c in primaries]

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
        pending, progressing or succeeded (a failed, timed-out or aborted one desires nothing).
        """
        desired: dict[str, tuple[str, str]] = {}
        newest_first = sorted(
            map(_primary, self._commands.values()),
            key=lambda c: (c.issued_at, c.rollout_id),
            reverse=True,
        )
        for command in newest_first:
            spec = command.spec
            if not isinstance(spec, ReloadWeightsSpec):
                continue
            ids = command.selector.worker_ids
            if ids is not None and all(w in desired for w in ids):
                continue  # a newer rollout already decides for all of its workers
            verdict = evaluate(
                command,
                self._ledgers.get((command.rollout_id, command.command_id)),
                self._registry,
                now=now,
                progress_deadline=self._deadline,
                abort=self._aborts.get(command.rollout_id),
            )
            if verdict.phase in _DESIRING:
                for worker_id in verdict.tracks:
                    desired.setdefault(worker_id, (spec.version, command.rollout_id))
        levels = []
        known = {hb.worker_id for hb in self._registry.heartbeats()}
        for worker_id in sorted(desired.keys() | known):
            hb = self._registry.latest(worker_id)
            want = desired.get(worker_id)
            reported = hb.weights_version if hb is not None else None
            degraded = hb is not None and hb.degraded is not None
            levels.append(
                WorkerLevel(
                    worker_id=worker_id,
                    alive=hb is not None and is_alive(hb, now),
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
            rollouts=len(self._commands),
            orphan_acks=sum(v.acks for k, v in self._ledgers.items() if k not in known),
        )

    # ------------------------------------------------------------------ internals

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
        return out


def _primary(commands: list[Command]) -> Command:
    if len(commands) == 1:
        return commands[0]
    return min(commands, key=lambda c: (c.issued_at, c.command_id, c.model_dump_json()))
