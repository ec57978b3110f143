"""One command's path through the agent, top to bottom: decode, select, dedupe, check, apply, ack.

:meth:`CommandPath.handle` takes one record of the commands topic and returns how it ended; the
agent's loop then commits the position (journal phase 2, then Kafka). Nothing here builds a
producer or a consumer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from controlplane.kafka.bus import Record
from controlplane.wire.errors import CommandRejected, ControlPlaneError, ProtocolError, WireCode
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    InFlight,
    ReloadWeightsSpec,
    Timings,
    WorkerStatus,
    decode_command,
)
from workers.agent import failpoints
from workers.agent.apply import DRY_RUN, Outcome, ack_error, apply
from workers.agent.durable import Journal
from workers.agent.heartbeat import Heartbeater
from workers.agent.outbox import AckOutbox
from workers.agent.session import AgentLog, StopSignal, WorkerView
from workers.agent.settings import WorkerSettings
from workers.agent.trust import TrustGate
from workers.runners.base import Runner
from workers.weights.paths import resolve_weights_path

#: Degraded codes of a restart that did not re-apply what an untrusted key had admitted.
UNRESTORED_CODES = frozenset(
    c.value
    for c in (
        WireCode.KEY_REVOKED,
        WireCode.KEY_UNKNOWN,
        WireCode.SIGNATURE_MISSING,
        WireCode.SCOPE_DENIED,
    )
)


@dataclass(frozen=True)
class CommandContext:
    """What every ack of one command says about it."""

    command_id: str
    rollout_id: str
    #: None for a record that did not decode.
    kind: CommandKind | None
    received: datetime
    #: When the runner was started on it; None until then (and for a rejected command).
    started: datetime | None = None
    #: A dry run: every ack of it says so (``result["dry_run"]``), whatever its state.
    dry_run: bool = False


@dataclass(frozen=True)
class Handled:
    """How one record ended: with a terminal ack published (now or before), and the id of a
    journaled ack published just now (phase 2 marks it published)."""

    acked: bool
    published: str | None = None


def precheck(
    command: Command,
    now: datetime,
    settings: WorkerSettings,
    roots: Sequence[Path] | None = None,
) -> Path | ControlPlaneError | None:
    """Checks before anything is touched: expiry, issue time, TTL and weights path (in
    ``roots``, default the worker's ``allowed_roots``). Returns the resolved path (None for a
    command without one), or why it is rejected."""
    if command.is_expired(now):
        return CommandRejected(
            f"command expired at {command.expires_at.isoformat()} (worker clock {now.isoformat()})",
            code=WireCode.EXPIRED,
        )
    skew = timedelta(seconds=settings.max_clock_skew_s)
    if command.issued_at > now + skew:
        return CommandRejected(
            f"command issued at {command.issued_at.isoformat()}, in the future of the worker"
            f" clock {now.isoformat()} by more than max_clock_skew_s"
            f" ({settings.max_clock_skew_s:g}s)",
            code=WireCode.ISSUED_IN_FUTURE,
        )
    ttl = (command.expires_at - command.issued_at).total_seconds()
    if ttl > settings.max_ttl_s:
        return CommandRejected(
            f"command TTL of {ttl:.0f}s (issued_at to expires_at) exceeds max_ttl_s"
            f" ({settings.max_ttl_s:g}s)",
            code=WireCode.TTL_TOO_LONG,
        )
    if isinstance(command.spec, ReloadWeightsSpec):
        try:
            return resolve_weights_path(
                command.spec.path, settings.allowed_roots if roots is None else roots
            )
        except ControlPlaneError as exc:
            return exc
    return None


def replayed(ack: Ack, now: datetime) -> Ack:
    """A journaled terminal ack, to publish again."""
    return ack.model_copy(
        update={
            "attempt": ack.attempt + 1,
            "sent_at": now,
            "result": {**ack.result, "replayed": True},
        }
    )


class CommandPath:
    """Takes commands one at a time, in log order, to their terminal ack."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        runner: Runner,
        journal: Journal,
        outbox: AckOutbox,
        heart: Heartbeater,
        view: WorkerView,
        stop: StopSignal,
        clock: Callable[[], datetime],
        log: AgentLog,
        outcomes: Counter[str],
        gate: TrustGate | None = None,
    ) -> None:
        self._settings = settings
        self._gate = gate or TrustGate(None, settings.allowed_roots)
        self._runner = runner
        self._journal = journal
        self._outbox = outbox
        self._heart = heart
        self._view = view
        self._stop = stop
        self._clock = clock
        self._log = log
        self._outcomes = outcomes
        #: Kinds whose journaled state a restart did not re-apply (its key no longer trusted):
        #: the worker reports degraded until a command of each kind succeeds.
        self.unrestored: set[CommandKind] = set()

    async def handle(self, record: Record) -> Handled:
        """Handle one record: whether it ended with a terminal ack published (now or before)."""
        received = self._clock()
        try:
            command = decode_command(
                record.value or b"", max_bytes=self._settings.max_message_bytes
            )
        except ProtocolError as exc:
            return await self._nack_garbage(record, exc, received)
        if not command.selector.matches(self._settings.worker_id, self._settings.labels):
            return Handled(acked=False)
        self._gate.refresh()  # a changed trust store file is read again (cheap, throttled)
        try:
            admitted = self._gate.admit(command, record.value or b"")
        except CommandRejected as exc:
            # No kind on the NACK, as on one of an unreadable record: a reader folds it as an
            # anomaly, never as this worker's outcome of the command of that id (a forged record
            # in front of the real command must not fail the rollout the real one succeeds in).
            ctx = CommandContext(command.command_id, command.rollout_id, None, received)
            return await self._refuse_unremembered(ctx, exc)
        replay = await self._replay(command.command_id)
        if replay is not None:
            return replay
        accepted = CommandContext(
            command.command_id,
            command.rollout_id,
            command.kind,
            received,
            dry_run=bool(command.dry_run),
        )
        checked = precheck(command, received, self._settings, admitted.roots)
        if isinstance(checked, ControlPlaneError):
            await self._finish(accepted, Outcome(AckState.REJECTED, ack_error(checked)))
            return Handled(acked=True, published=command.command_id)
        started = self._clock()
        ctx = replace(accepted, started=started)
        self._view.in_flight = InFlight(
            command_id=command.command_id,
            rollout_id=command.rollout_id,
            kind=command.kind,
            since=started,
        )
        self._view.status = WorkerStatus.BUSY
        self._outbox.hold(self.ack(accepted, AckState.ACCEPTED), self.ack(ctx, AckState.RUNNING))
        self._log(
            logging.INFO,
            "checking %s (dry run)" if command.dry_run else "applying %s",
            command.kind.value,
            command_id=command.command_id,
            rollout_id=command.rollout_id,
        )
        grace = asyncio.get_running_loop().call_later(
            # A command done within it sends its three acks in one request, and no busy
            # heartbeat (its acks say as much; the heartbeat at its end reports the result).
            min(self._settings.progress_grace_s, self._settings.heartbeat_interval_s),
            self._grace_over,
        )
        try:
            outcome = await apply(
                self._runner,
                command,
                checked,
                default_timeout_s=self._settings.command_timeout_s,
                stop=self._stop,
                log=self._log,
            )
        finally:
            grace.cancel()
        self._view.in_flight = None
        if outcome.description is not None:
            self._view.describe = outcome.description
        else:
            await self._view.refresh(self._runner, self._log)
        if outcome.state is AckState.SUCCEEDED and not command.dry_run:
            self._recovered(command.kind)
        self._view.status = self._view.idle_status(self._stop.is_set())
        await self._finish(ctx, outcome, admitted.key_id)
        return Handled(acked=True, published=command.command_id)

    def ack(
        self,
        ctx: CommandContext,
        state: AckState,
        *,
        finished_at: datetime | None = None,
        error: AckError | None = None,
        result: dict[str, Any] | None = None,
    ) -> Ack:
        desc = self._view.describe
        return Ack(
            command_id=ctx.command_id,
            rollout_id=ctx.rollout_id,
            worker_id=self._settings.worker_id,
            kind=ctx.kind,
            state=state,
            weights_version=desc.weights_version if desc else None,
            config_digest=desc.config_digest if desc else None,
            error=error,
            timings=Timings(
                received_at=ctx.received, started_at=ctx.started, finished_at=finished_at
            ),
            sent_at=self._clock(),
            result={**(result or {}), DRY_RUN: True} if ctx.dry_run else (result or {}),
        )

    def _recovered(self, kind: CommandKind) -> None:
        """A command of ``kind`` succeeded: what a restart left unrestored of that kind (an
        untrusted key's, see ``Agent._restore``) is replaced; degraded no more once nothing is
        left."""
        if kind not in self.unrestored:
            return
        self.unrestored.discard(kind)
        degraded = self._view.degraded
        if not self.unrestored and degraded is not None and degraded.code in UNRESTORED_CODES:
            self._view.degraded = None
            self._log(
                logging.INFO,
                "no longer degraded (%s): replaced by a trusted command",
                degraded.code,
            )

    async def _finish(
        self, ctx: CommandContext, outcome: Outcome, key_id: str | None = None
    ) -> None:
        """Record the terminal ack durably, then publish it.

        Journal phase 1 is the outcome plus what it applied (weights or config): one fsync, off
        the loop, done before the ack can be seen. The ack follows the accepted and running
        acks (released ones awaited first, held ones in the same request), and the heartbeat
        reporting the result goes beside it. The "published" mark goes to disk with the next
        offset (phase 2, the caller's).
        """
        ack = self.ack(
            ctx,
            outcome.state,
            finished_at=self._clock(),
            error=outcome.error,
            result=outcome.result,
        )
        await self._journal.commit_outcome(ack, outcome.applied, key_id)
        failpoints.hit("after_apply")
        await self._outbox.settle()
        held = self._outbox.take_held()
        self._heart.beat_soon()  # appended right after the acks below: one request for both
        await self._outbox.publish((*held, ack))
        self._outcomes[outcome.error.code if outcome.error else "OK"] += 1
        level = logging.INFO if outcome.state is AckState.SUCCEEDED else logging.WARNING
        self._log(
            level,
            "%s%s",
            outcome.state.value,
            f" {outcome.error.code}: {outcome.error.message}" if outcome.error else "",
            command_id=ctx.command_id,
            rollout_id=ctx.rollout_id,
        )

    def _grace_over(self) -> None:
        """The command in hand still runs after the grace: say so, acks and heartbeat, now."""
        self._outbox.release_held()
        self._heart.beat_soon()

    async def _replay(self, command_id: str) -> Handled | None:
        """Already ended here (redelivery after a crash)? Then re-publish its ack if needed.

        None if not; the caller marks a re-published ack published (with the next offset).
        """
        prior = self._journal.outcome(command_id)
        if prior is None:
            return None
        if not prior.published:
            ack = replayed(prior.ack, self._clock())
            self._log(
                logging.INFO,
                "re-publishing the %s ack of an applied command",
                ack.state.value,
                command_id=command_id,
                rollout_id=ack.rollout_id,
            )
            await self._outbox.publish((ack,))
            return Handled(acked=True, published=command_id)
        self._log(
            logging.INFO,
            "duplicate delivery ignored (already %s)",
            prior.ack.state.value,
            command_id=command_id,
            rollout_id=prior.ack.rollout_id,
        )
        return Handled(acked=True)

    async def _nack_garbage(
        self, record: Record, exc: ProtocolError, received: datetime
    ) -> Handled:
        """NACK a record that did not decode, where its command id can be read.

        The NACK is published but never journaled: an id read from bytes that are not a command
        proves nothing about the command of that id, which must still be applied when it comes
        (anyone can write a record with a guessable id in front of the real one).
        """
        self._log(logging.WARNING, "unreadable command at offset %d: %s", record.offset, exc)
        if exc.command_id is None:
            return Handled(acked=False)
        ctx = CommandContext(exc.command_id, exc.rollout_id or "unknown", None, received)
        return await self._refuse_unremembered(ctx, exc)

    async def _refuse_unremembered(self, ctx: CommandContext, exc: ControlPlaneError) -> Handled:
        """NACK a record that proves nothing (unreadable, or not signed as the trust store
        requires), and never journal it: anyone can write a record with a guessable id in front
        of the real command of that id, which must still be applied when it comes. A command
        of that id already ended here keeps its own outcome (re-published if needed)."""
        replay = await self._replay(ctx.command_id)
        if replay is not None:
            return replay
        nack = self.ack(ctx, AckState.REJECTED, finished_at=self._clock(), error=ack_error(exc))
        await self._outbox.publish((nack,))
        self._outcomes[exc.code.value] += 1
        self._log(
            logging.WARNING,
            "rejected %s: %s (not remembered: the real command of this id is still applied)",
            exc.code.value,
            exc.message,
            command_id=ctx.command_id,
            rollout_id=ctx.rollout_id,
        )
        return Handled(acked=True)  # not journaled: nothing to mark published
