"""Folds acks into per-command, per-worker ledgers in O(1) each; judges nothing.

Every field is a count, a minimum, a maximum or a per-state minimum, so the same acks in any
arrival order give the same ledger. No I/O, no clock; acks are reduced to the few facts status needs.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from controlplane.wire.ack_codec import AckLike, as_model_error
from controlplane.wire.protocol import AckError, AckState

_ACCEPTED = AckState.ACCEPTED
_RUNNING = AckState.RUNNING


class Report(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """The facts of one terminal ack that status shows (an :class:`Ack` is much larger).

    Like :class:`WorkerLedger`, not tracked by the garbage collector: a fleet holds one per
    worker per rollout, and collections walking them all slow a catch-up (docs/benchmarks.md).
    Encoded as an array (the coordinator's snapshots hold one per worker per rollout): a
    change of its fields is a new ``FORMAT`` of controlplane/coordinator/snapshots.py.
    """

    sent_at: datetime
    attempt: int
    state: AckState
    weights_version: str | None
    config_digest: str | None
    error: AckError | None
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def of(cls, ack: AckLike) -> Report:
        t = ack.timings
        error = ack.error
        return cls(
            ack.sent_at,
            ack.attempt,
            ack.state,
            ack.weights_version,
            ack.config_digest,
            None if error is None else as_model_error(error),
            t.started_at,
            t.finished_at,
        )

    def order(self) -> tuple[datetime, int, str, str, str, str, str]:
        """A total order: earliest sent first ("first terminal wins"); the rest breaks ties."""
        err = self.error
        return (
            self.sent_at,
            self.attempt,
            self.state.value,
            self.weights_version or "",
            err.code if err is not None else "",
            err.message if err is not None else "",
            self.config_digest or "",
        )

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class WorkerLedger(msgspec.Struct, gc=False, array_like=True):
    """What one worker has reported about one command. Start one with :meth:`first`.

    Not tracked by the garbage collector (it refers to nothing that refers back to it).
    Encoded as an array, as :class:`Report` is."""

    acks: int
    first_sent: datetime
    last_sent: datetime
    accepted_sent: datetime | None
    running_sent: datetime | None
    received_at: datetime
    started_at: datetime | None
    max_attempt: int
    #: The earliest report of the first terminal state that arrived, and of each other terminal
    #: state (a conflict, rare): apart, so that a ledger holds no dict for the GC to track.
    one_terminal: Report | None
    other_terminals: dict[AckState, Report] | None = None

    @classmethod
    def first(cls, ack: AckLike) -> WorkerLedger:
        sent = ack.sent_at
        timings = ack.timings
        state = ack.state
        return cls(
            1,
            sent,
            sent,
            sent if state is _ACCEPTED else None,
            sent if state is _RUNNING else None,
            timings.received_at,
            timings.started_at,
            ack.attempt,
            None if state is _ACCEPTED or state is _RUNNING else Report.of(ack),
        )

    def add(self, ack: AckLike) -> None:
        self.acks += 1
        sent = ack.sent_at
        if sent < self.first_sent:
            self.first_sent = sent
        elif sent > self.last_sent:
            self.last_sent = sent
        state = ack.state
        if state is _RUNNING:
            if self.running_sent is None or sent < self.running_sent:
                self.running_sent = sent
        elif state is _ACCEPTED:
            if self.accepted_sent is None or sent < self.accepted_sent:
                self.accepted_sent = sent
        else:
            one = self.one_terminal
            if one is None:
                self.one_terminal = Report.of(ack)
            elif one.state is state:
                if sent <= one.sent_at:
                    report = Report.of(ack)
                    if report.order() < one.order():
                        self.one_terminal = report
            else:
                others = self.other_terminals
                if others is None:
                    others = self.other_terminals = {}
                held = others.get(state)
                if held is None or sent <= held.sent_at:
                    report = Report.of(ack)
                    if held is None or report.order() < held.order():
                        others[state] = report
        timings = ack.timings
        if timings.received_at < self.received_at:
            self.received_at = timings.received_at
        started = timings.started_at
        if started is not None and (self.started_at is None or started < self.started_at):
            self.started_at = started
        if ack.attempt > self.max_attempt:
            self.max_attempt = ack.attempt

    @property
    def terminals(self) -> dict[AckState, Report]:
        """The earliest terminal report of each terminal state; more than one is a conflict."""
        one = self.one_terminal
        if one is None:
            return {}
        out = {one.state: one}
        if self.other_terminals:
            out.update(self.other_terminals)
        return out

    def terminal(self) -> Report | None:
        """The terminal report that counts: the earliest sent. None while none arrived."""
        if not self.other_terminals:
            return self.one_terminal
        return min(self.terminals.values(), key=Report.order)

    def conflicts(self) -> list[Report]:
        """Terminal reports of other states than the one that counts, earliest first."""
        kept = self.terminal()
        return sorted((r for r in self.terminals.values() if r is not kept), key=Report.order)


class CommandLedger:
    """Every worker's reports about one (rollout id, command id)."""

    __slots__ = ("acks", "command_id", "rollout_id", "workers")

    def __init__(self, rollout_id: str, command_id: str) -> None:
        self.rollout_id = rollout_id
        self.command_id = command_id
        self.acks = 0
        self.workers: dict[str, WorkerLedger] = {}

    def add(self, ack: AckLike) -> None:
        self.acks += 1
        worker_id = ack.worker_id
        held = self.workers.get(worker_id)
        if held is not None:
            held.add(ack)
        else:
            self.workers[worker_id] = WorkerLedger.first(ack)

    @property
    def first_sent(self) -> datetime | None:
        return min((w.first_sent for w in self.workers.values()), default=None)

    @property
    def last_sent(self) -> datetime | None:
        return max((w.last_sent for w in self.workers.values()), default=None)
