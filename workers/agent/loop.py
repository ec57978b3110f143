"""The worker agent: consume commands, filter, dedupe, dispatch to the runner off the loop, ack, commit.

One command at a time, in log order. The position is committed only after the terminal ack is
published; application is idempotent by command id (journal in state.py). Heartbeats run beside
the command loop and never wait for the runner or the disk. No signals or asyncio.run here (see
cli.py).

Per command, in this order (acks are keyed by worker id: one partition, kept in order):

1. the ``accepted`` and ``running`` acks are built and held; the runner starts at once, in a
   thread. If it is still running after a grace period (setting ``progress_grace_s``), the held acks
   are handed to the producer together, not awaited, beside a "busy" heartbeat;
2. journal phase 1: what the command applied (weights or config) and its terminal outcome, one
   ``fsync`` off the loop: the outcome is durable before anyone can see its ack (failpoint
   ``after_apply``);
3. acks released at the grace are awaited; then the terminal ack is published, after any acks
   still held, in one request, and awaited until the cluster confirms it (see
   :meth:`AckOutbox.publish`); the heartbeat reporting the result goes out beside it;
4. journal phase 2: "published" and the next offset, one ``fsync`` off the loop (failpoint
   ``after_ack``); then the offset is committed to Kafka.

A quick command thus costs one produce request (three acks and a heartbeat), one fsync before
its ack and one after, and one offset commit.

While the cluster does not confirm acks (unreachable, or fewer in-sync replicas than the acks
topic's ``min.insync.replicas``) the agent waits on the same records (the idempotent producer
retries them: no second copy), says so once, reports it in every heartbeat
(``acks_unpublished``, ``publish_failing_since``), and says once when they go through. A stop
meanwhile waits for them until the drain timeout at most, then exits with the terminal acks
still in the journal: the next start publishes them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar, assert_never

from controlplane.kafka.bus import Consumer, Producer, Record
from controlplane.wire.errors import (
    BusError,
    CommandRejected,
    ControlPlaneError,
    ErrorCode,
    ProtocolError,
)
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Degraded,
    InFlight,
    ReloadWeightsSpec,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
    decode_command,
    utcnow,
)
from controlplane.wire.topics import worker_key
from workers.agent import failpoints
from workers.agent.durable import Applied, ConfigApplied, Journal
from workers.agent.heartbeat import AGENT_VERSION as AGENT_VERSION
from workers.agent.heartbeat import Heartbeater
from workers.agent.journal import WorkerState
from workers.agent.outbox import AckOutbox, AcksLeftUnpublished
from workers.agent.producer import ProducerLink, PublishHealth
from workers.agent.session import AgentLog, StopSignal, WorkerView
from workers.agent.settings import WorkerSettings
from workers.runners.base import ReloadResult, Runner, RunnerDescription
from workers.weights.paths import resolve_weights_path

#: After a runner ignores cancellation this long past its deadline, we stop waiting for it.
_CANCEL_GRACE_S = 30.0
R = TypeVar("R")


@dataclass
class _Outcome:
    state: AckState
    error: AckError | None = None
    result: dict[str, Any] | None = None
    started_at: datetime | None = None
    #: The runner's description after the command, when the runner returned one.
    description: RunnerDescription | None = None
    #: What the command applied, for the journal (phase 1) to re-apply after a restart.
    applied: Applied | None = None


@dataclass(frozen=True)
class Handled:
    """How one record ended: with a terminal ack published (now or before), and the id of a
    journaled ack published just now (phase 2 marks it published)."""

    acked: bool
    published: str | None = None


class Agent:
    """One worker agent. ``await agent.run()`` until ``agent.request_stop()`` (or burst mode)."""

    def __init__(
        self,
        settings: WorkerSettings,
        runner: Runner,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.clock = clock
        self.topics = settings.kafka.topics
        self.worker_id = settings.worker_id
        self.ready = asyncio.Event()
        self.outcomes: Counter[str] = Counter()
        self._stop = StopSignal(settings.drain_timeout_s)
        self._view = WorkerView()
        self._log = AgentLog(self.worker_id)
        #: The coded error run() raises once it has stopped (a journal that cannot be written).
        self._failed: ControlPlaneError | None = None
        #: Since when the command loop cannot fetch (logged once, and once when it can again).
        self._unreachable_since: datetime | None = None
        self._health = PublishHealth()
        self._started_at = self.clock()
        self._link: ProducerLink | None = None
        self._outbox: AckOutbox | None = None
        self._heart: Heartbeater | None = None
        self._consumer: Consumer | None = None
        self._journal: Journal | None = None

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Stop taking commands; the one in flight may finish within ``drain_timeout_s``."""
        self._stop.request()

    async def run(self) -> None:
        """Run until stopped. Drains on stop: in-flight command acked, last heartbeat sent.

        A journal that cannot be written stops the worker: no more commands, a degraded
        heartbeat with code JOURNAL_WRITE_FAILED (best effort), then that error is raised here
        once everything is closed. The runner is closed whatever happened; an error while
        closing is logged and never hides the one that stopped the worker.
        """
        try:
            directory = self.settings.worker_state_dir
            self._journal = Journal(
                WorkerState.open(directory), directory, on_failure=self._journal_failed
            )
            async with (
                Producer(self.settings.kafka) as producer,
                Consumer(
                    self.settings.kafka,
                    group_id=self.topics.worker_group(self.worker_id),
                    # The broker answers a waiting fetch as soon as a command lands, so a long
                    # poll costs no latency, while a short one costs a request per idle worker
                    # every 100 ms (docs/benchmarks.md: 500 idle agents, broker 28% -> 9%).
                    fetch_max_wait_ms=3000,
                ) as consumer,
            ):
                self._consumer = consumer
                link = ProducerLink(
                    producer,
                    lambda: Producer(self.settings.kafka),  # loop.Producer, as tests patch it
                    health=self._health,
                    log=self._log,
                )
                self._link = link
                self._outbox = AckOutbox(
                    link=link,
                    health=self._health,
                    topic=self.topics.acks.name,
                    key=worker_key(self.worker_id),
                    stop=self._stop,
                    clock=self.clock,
                    log=self._log,
                )
                assert self._journal is not None
                heart = Heartbeater(
                    settings=self.settings,
                    runner_name=self.runner.name,
                    link=link,
                    health=self._health,
                    view=self._view,
                    stop=self._stop,
                    incarnation=self._journal.incarnation,
                    started_at=self._started_at,
                    clock=self.clock,
                    log=self._log,
                )
                self._heart = heart
                try:
                    try:
                        await self._establish_position()
                    except ControlPlaneError as exc:
                        if exc is not self._failed:
                            raise
                        await heart.beat()  # best effort: say why, then stop
                    else:
                        await self._serve()
                    await heart.drain()
                finally:
                    await link.close()
        finally:
            await self._close()
        if self._failed is not None:
            raise self._failed

    async def _serve(self) -> None:
        """Heartbeats beside the command loop, until stopped (or the journal fails).

        Acks journaled and not published by the previous run go first (heartbeats already
        report them, should the cluster not take them yet)."""
        async with asyncio.TaskGroup() as tg:
            assert self._heart is not None
            tg.create_task(self._heart.run())
            try:
                await self._publish_pending_acks()
                await self._load_runner()
                self.ready.set()
                if self._view.degraded is not None:
                    self._log(
                        logging.WARNING,
                        "running degraded (%s): runner %s on %s",
                        self._view.degraded.code,
                        self.runner.name,
                        self._view.device,
                    )
                else:
                    self._log(
                        logging.INFO, "ready: runner %s on %s", self.runner.name, self._view.device
                    )
                await self._command_loop()
            except ControlPlaneError as exc:
                if exc is not self._failed:
                    raise
                await self._heart.beat()  # the degraded heartbeat, best effort; then stop
            except AcksLeftUnpublished:
                assert self._journal is not None
                left = len(self._journal.unpublished())
                self._log(
                    logging.WARNING,
                    "stopping: Kafka has not confirmed acks within the drain timeout"
                    " (drain_timeout_s %gs); %d ack(s) remain unpublished in the journal and are"
                    " published at the next start (the command offset is not committed)",
                    self.settings.drain_timeout_s,
                    left,
                )
            finally:
                self._view.status = WorkerStatus.STOPPED
                self._heart.finish()
                assert self._outbox is not None
                self._outbox.cancel()  # only if the command loop was cancelled

    async def _close(self) -> None:
        """Close the journal, then the runner (always); errors are logged, never raised over
        the one that stopped the worker. A journal that cannot be closed when nothing else
        failed is the error run() raises."""
        if self._journal is not None:
            error = self._journal.close()  # never raises: returns what it could not write
            if error is not None:
                self._log(logging.ERROR, "the journal could not be closed: %s", error)
                if self._failed is None:
                    self._failed = error
        try:
            await asyncio.to_thread(self.runner.close)
        except Exception as exc:
            self._log(logging.ERROR, "runner.close() failed: %r", exc)
        self._log(logging.INFO, "stopped")

    # ------------------------------------------------------------------ start-up

    async def _establish_position(self) -> None:
        """Where to read from: Kafka's committed offset, else ours, else the head of the log.

        A worker never seen before starts at the head: history is not replayed onto it. The
        position is fixed before the first heartbeat, so a command published after a worker
        is visible as live is always seen by it.
        """
        assert self._consumer is not None and self._journal is not None
        topic = self.topics.commands.name
        await self._consumer.assign(topic, [0])
        committed = await self._consumer.committed(topic, 0)
        begin = (await self._consumer.beginning_offsets(topic))[0]
        end = (await self._consumer.end_offsets(topic))[0]
        if committed is not None:
            start, source = committed, "committed offset"
        elif self._journal.next_offset is not None:
            start, source = self._journal.next_offset, "local state (committed offset expired)"
        else:
            start, source = end, "head of the log (new worker)"
        if start < begin:
            self._log(
                logging.WARNING, "offset %d was deleted by retention; reading from %d", start, begin
            )
            start = begin
        self._consumer.seek(topic, 0, start)
        # Remember where this incarnation starts, so a crash before its first commit resumes here.
        await self._journal.commit_published((), start)
        self._log(logging.INFO, "reading %s from offset %d (%s)", topic, start, source)

    async def _publish_pending_acks(self) -> None:
        """Terminal acks recorded but not known to be published (a crash, or a stop while the
        cluster did not take them): publish them, together, then mark them published."""
        assert self._journal is not None
        pending = self._journal.unpublished()
        if not pending:
            return
        self._log(
            logging.INFO,
            "re-publishing %d ack(s) of applied commands, from the journal",
            len(pending),
        )
        assert self._outbox is not None
        await self._outbox.publish([self._replayed(ack) for ack in pending])
        await self._journal.commit_published([ack.command_id for ack in pending])

    async def _load_runner(self) -> None:
        """Load the model. If that fails the worker keeps running, degraded (RUNNER_LOAD_FAILED
        in its heartbeats), and the runner refuses reloads with MODEL_NOT_LOADED."""
        try:
            await asyncio.to_thread(self.runner.load)
        except Exception as exc:
            message = exc.message if isinstance(exc, ControlPlaneError) else f"{exc}"
            message = f"{type(exc).__name__}: {message}"
            self._log(logging.ERROR, "runner failed to load its model: %s", message)
            self._view.degraded = Degraded(
                code=ErrorCode.RUNNER_LOAD_FAILED.value,
                message=message[:4096],
                since=self.clock(),
            )
        else:
            if self.settings.restore_on_start:
                await self._restore()
        await self._view.refresh(self.runner, self._log)
        self._view.status = self._view.idle_status(self._stop.is_set())

    async def _restore(self) -> None:
        """Re-apply what this worker had applied before a restart (level, not events)."""
        assert self._journal is not None
        if self._journal.config_overrides:
            try:
                await asyncio.to_thread(
                    self.runner.update_config, dict(self._journal.config_overrides)
                )
            except Exception as exc:
                self._log(logging.ERROR, "could not restore config overrides: %s", exc)
        spec = self._journal.weights
        if spec is not None:
            try:
                path = resolve_weights_path(spec.path, self.settings.allowed_roots)
                await asyncio.to_thread(self.runner.reload_weights, spec, path)
                self._log(logging.INFO, "restored weights %s from %s", spec.version, spec.path)
            except Exception as exc:
                self._log(logging.ERROR, "could not restore weights %s: %s", spec.version, exc)

    # ------------------------------------------------------------------ commands

    async def _command_loop(self) -> None:
        assert self._consumer is not None
        topic = self.topics.commands.name
        while not self._stop.is_set():
            try:
                records = await self._consumer.fetch(timeout_s=0.5, max_records=16)
            except BusError as exc:
                self._fetch_failed(exc)
                await self._stop.sleep(1.0)
                continue
            if self._unreachable_since is not None:
                self._log(
                    logging.WARNING,
                    "Kafka reachable again (unreachable since %s)",
                    self._unreachable_since.isoformat(timespec="seconds"),
                )
                self._unreachable_since = None
            for record in records:
                if self._stop.is_set():
                    break  # not committed: seen again after a restart
                handled = await self._handle(record)
                await self._commit(topic, record.offset + 1, handled)

    def _fetch_failed(self, exc: BusError) -> None:
        """Log an outage once when it starts (and once when it ends), not at every retry."""
        if self._unreachable_since is None:
            self._unreachable_since = self.clock()
            self._log(
                logging.WARNING,
                "Kafka unreachable since %s, retrying every second: %s",
                self._unreachable_since.isoformat(timespec="seconds"),
                exc,
            )
        else:
            self._log(logging.DEBUG, "fetch failed, retrying: %s", exc)

    async def _commit(self, topic: str, next_offset: int, handled: Handled) -> None:
        """Journal phase 2, then Kafka: the "published" mark of the ack just sent (if any) and
        the next offset, in one fsync, then the commit."""
        assert self._consumer is not None and self._journal is not None
        published = () if handled.published is None else (handled.published,)
        await self._journal.commit_published(published, next_offset)
        if handled.acked:
            failpoints.hit("after_ack")
        try:
            await self._consumer.commit(topic, 0, next_offset)
        except BusError as exc:  # the local state still has it; Kafka catches up at the next one
            self._log(logging.WARNING, "commit of offset %d failed: %s", next_offset, exc)

    async def _handle(self, record: Record) -> Handled:
        """Handle one record: whether it ended with a terminal ack published (now or before)."""
        received = self.clock()
        try:
            command = decode_command(record.value or b"", max_bytes=self.settings.max_message_bytes)
        except ProtocolError as exc:
            return await self._handle_garbage(record, exc, received)
        if not command.selector.matches(self.worker_id, self.settings.labels):
            return Handled(acked=False)
        replay = await self._replay_outcome(command.command_id)
        if replay is not None:
            return replay
        rejected = self._precheck(command, received)
        if isinstance(rejected, ControlPlaneError):
            await self._finish(
                command.command_id,
                command.rollout_id,
                command.kind,
                received,
                _Outcome(AckState.REJECTED, _ack_error(rejected)),
            )
            return Handled(acked=True, published=command.command_id)
        path = rejected
        started = self.clock()
        self._view.in_flight = InFlight(
            command_id=command.command_id,
            rollout_id=command.rollout_id,
            kind=command.kind,
            since=started,
        )
        self._view.status = WorkerStatus.BUSY
        assert self._outbox is not None
        self._outbox.hold(
            self._ack(
                command.command_id, command.rollout_id, command.kind, AckState.ACCEPTED, received
            ),
            self._ack(
                command.command_id,
                command.rollout_id,
                command.kind,
                AckState.RUNNING,
                received,
                started_at=started,
            ),
        )
        self._log(
            logging.INFO,
            "applying %s",
            command.kind.value,
            command_id=command.command_id,
            rollout_id=command.rollout_id,
        )
        grace = asyncio.get_running_loop().call_later(
            # A command done within it sends its three acks in one request, and no busy
            # heartbeat (its acks say as much; the heartbeat at its end reports the result).
            min(self.settings.progress_grace_s, self.settings.heartbeat_interval_s),
            self._grace_over,
        )
        try:
            outcome = await self._execute(command, path)
        finally:
            grace.cancel()
        outcome.started_at = started
        self._view.in_flight = None
        if outcome.description is not None:
            self._view.describe = outcome.description
        else:
            await self._view.refresh(self.runner, self._log)
        self._view.status = self._view.idle_status(self._stop.is_set())
        await self._finish(command.command_id, command.rollout_id, command.kind, received, outcome)
        return Handled(acked=True, published=command.command_id)

    async def _handle_garbage(
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
        replay = await self._replay_outcome(exc.command_id)
        if replay is not None:
            return replay
        nack = self._ack(
            exc.command_id,
            exc.rollout_id or "unknown",
            None,
            AckState.REJECTED,
            received,
            finished_at=self.clock(),
            error=_ack_error(exc),
        )
        assert self._outbox is not None
        await self._outbox.publish((nack,))
        self.outcomes[exc.code.value] += 1
        self._log(
            logging.WARNING,
            "rejected %s: %s (not remembered: the real command of this id is still applied)",
            exc.code.value,
            exc.message,
            command_id=exc.command_id,
            rollout_id=exc.rollout_id,
        )
        return Handled(acked=True)  # not journaled: nothing to mark published

    def _precheck(self, command: Command, now: datetime) -> Path | ControlPlaneError | None:
        """Checks before anything is touched: expiry, issue time, TTL and weights path.
        Returns the resolved path."""
        if command.is_expired(now):
            return CommandRejected(
                f"command expired at {command.expires_at.isoformat()} (worker clock {now.isoformat()})",
                code=ErrorCode.EXPIRED,
            )
        skew = timedelta(seconds=self.settings.max_clock_skew_s)
        if command.issued_at > now + skew:
            return CommandRejected(
                f"command issued at {command.issued_at.isoformat()}, in the future of the worker"
                f" clock {now.isoformat()} by more than max_clock_skew_s"
                f" ({self.settings.max_clock_skew_s:g}s)",
                code=ErrorCode.ISSUED_IN_FUTURE,
            )
        ttl = (command.expires_at - command.issued_at).total_seconds()
        if ttl > self.settings.max_ttl_s:
            return CommandRejected(
                f"command TTL of {ttl:.0f}s (issued_at to expires_at) exceeds max_ttl_s"
                f" ({self.settings.max_ttl_s:g}s)",
                code=ErrorCode.TTL_TOO_LONG,
            )
        if isinstance(command.spec, ReloadWeightsSpec):
            try:
                return resolve_weights_path(command.spec.path, self.settings.allowed_roots)
            except ControlPlaneError as exc:
                return exc
        return None

    async def _replay_outcome(self, command_id: str) -> Handled | None:
        """Already ended here (redelivery after a crash)? Then re-publish its ack if needed.

        None if not; the caller marks a re-published ack published (with the next offset).
        """
        assert self._journal is not None
        prior = self._journal.outcome(command_id)
        if prior is None:
            return None
        if not prior.published:
            ack = self._replayed(prior.ack)
            self._log(
                logging.INFO,
                "re-publishing the %s ack of an applied command",
                ack.state.value,
                command_id=command_id,
                rollout_id=ack.rollout_id,
            )
            assert self._outbox is not None
            await self._outbox.publish((ack,))
            return Handled(acked=True, published=command_id)
        else:
            self._log(
                logging.INFO,
                "duplicate delivery ignored (already %s)",
                prior.ack.state.value,
                command_id=command_id,
                rollout_id=prior.ack.rollout_id,
            )
        return Handled(acked=True)

    def _replayed(self, ack: Ack) -> Ack:
        """A journaled terminal ack, to publish again."""
        return ack.model_copy(
            update={
                "attempt": ack.attempt + 1,
                "sent_at": self.clock(),
                "result": {**ack.result, "replayed": True},
            }
        )

    async def _execute(self, command: Command, path: Path | None) -> _Outcome:
        """Run the command in a thread under its timeout and the drain deadline."""
        spec = command.spec
        cancel = threading.Event()
        call: Callable[[], ReloadResult | RunnerDescription]
        if isinstance(spec, ReloadWeightsSpec):
            assert path is not None
            call = lambda: self.runner.reload_weights(spec, path, cancel=cancel)  # noqa: E731
        elif isinstance(spec, UpdateConfigSpec):
            call = lambda: self.runner.update_config(dict(spec.overrides))  # noqa: E731
        else:  # pragma: no cover - the discriminated union has no other member
            assert_never(spec)
        timeout = command.timeout_s or self.settings.command_timeout_s
        task = asyncio.ensure_future(asyncio.to_thread(call))
        deadline = time.monotonic() + timeout
        reason: ErrorCode | None = None
        while not task.done():
            limit = deadline
            drain = self._stop.drain_deadline()
            if drain is not None:
                limit = min(limit, drain)
            if time.monotonic() >= limit:
                reason = (
                    ErrorCode.WORKER_SHUTTING_DOWN
                    if limit < deadline
                    else ErrorCode.COMMAND_TIMEOUT
                )
                cancel.set()
                self._log(
                    logging.WARNING,
                    "cancelling (%s)",
                    reason.value,
                    command_id=command.command_id,
                    rollout_id=command.rollout_id,
                )
                await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
                break
            await asyncio.wait({task}, timeout=min(0.2, max(0.0, limit - time.monotonic())))
        if not task.done():
            return _Outcome(
                AckState.FAILED,
                AckError(
                    code=reason or ErrorCode.COMMAND_TIMEOUT,
                    retryable=True,
                    message=f"runner did not stop within {_CANCEL_GRACE_S:.0f}s of cancellation",
                ),
            )
        try:
            value = task.result()
        except ControlPlaneError as exc:
            error = _ack_error(exc)
            if reason is not None and exc.code is ErrorCode.COMMAND_TIMEOUT:
                error = AckError(code=reason, message=exc.message, retryable=True)
            elif reason is not None:
                error = AckError(
                    code=exc.code,
                    retryable=exc.retryable,
                    message=f"{exc.message} (after cancellation: {reason.value})",
                )
            return _Outcome(AckState.REJECTED if exc.is_rejection else AckState.FAILED, error)
        except Exception as exc:  # a runner bug must not kill the agent
            self._log(logging.ERROR, "runner raised %r", exc, command_id=command.command_id)
            return _Outcome(
                AckState.FAILED,
                AckError(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}"),
            )
        if isinstance(spec, ReloadWeightsSpec) and isinstance(value, ReloadResult):
            return _Outcome(AckState.SUCCEEDED, result=value.as_dict(), applied=spec)
        if isinstance(spec, UpdateConfigSpec) and isinstance(value, RunnerDescription):
            return _Outcome(
                AckState.SUCCEEDED,
                result={"overrides": sorted(spec.overrides)},
                description=value,  # the runner's state after the update: no describe() call
                applied=ConfigApplied(spec.overrides),
            )
        return _Outcome(  # pragma: no cover - a runner returned the wrong type
            AckState.FAILED,
            AckError(code=ErrorCode.INTERNAL, message=f"runner returned {type(value).__name__}"),
        )

    async def _finish(
        self,
        command_id: str,
        rollout_id: str,
        kind: CommandKind | None,
        received: datetime,
        outcome: _Outcome,
    ) -> None:
        """Record the terminal ack durably, then publish it.

        Journal phase 1 is the outcome plus what _execute applied (weights or config): one fsync,
        off the loop, done before the ack can be seen. The ack follows the accepted and running
        acks (released ones awaited first, held ones in the same request), and the heartbeat
        reporting the result goes beside it. The "published" mark goes to disk with the next
        offset in _commit (phase 2).
        """
        assert self._journal is not None
        ack = self._ack(
            command_id,
            rollout_id,
            kind,
            outcome.state,
            received,
            started_at=outcome.started_at,
            finished_at=self.clock(),
            error=outcome.error,
            result=outcome.result,
        )
        await self._journal.commit_outcome(ack, outcome.applied)
        failpoints.hit("after_apply")
        assert self._outbox is not None
        await self._outbox.settle()
        held = self._outbox.take_held()
        assert self._heart is not None
        self._heart.beat_soon()  # appended right after the acks below: one request for both
        await self._outbox.publish((*held, ack))
        self.outcomes[outcome.error.code if outcome.error else "OK"] += 1
        level = logging.INFO if outcome.state is AckState.SUCCEEDED else logging.WARNING
        self._log(
            level,
            "%s%s",
            outcome.state.value,
            f" {outcome.error.code}: {outcome.error.message}" if outcome.error else "",
            command_id=command_id,
            rollout_id=rollout_id,
        )

    def _ack(
        self,
        command_id: str,
        rollout_id: str,
        kind: CommandKind | None,
        state: AckState,
        received: datetime,
        *,
        started_at: datetime | None = None,
        finished_at: datetime | None = None,
        error: AckError | None = None,
        result: dict[str, Any] | None = None,
    ) -> Ack:
        desc = self._view.describe
        return Ack(
            command_id=command_id,
            rollout_id=rollout_id,
            worker_id=self.worker_id,
            kind=kind,
            state=state,
            weights_version=desc.weights_version if desc else None,
            config_digest=desc.config_digest if desc else None,
            error=error,
            timings=Timings(received_at=received, started_at=started_at, finished_at=finished_at),
            sent_at=self.clock(),
            result=result or {},
        )

    def _grace_over(self) -> None:
        """The command in hand still runs after the grace: say so, acks and heartbeat, now."""
        assert self._outbox is not None
        self._outbox.release_held()
        assert self._heart is not None
        self._heart.beat_soon()

    # ------------------------------------------------------------------ helpers

    def _journal_failed(self, error: ControlPlaneError) -> ControlPlaneError:
        """The journal cannot be written: stop taking commands, degraded with the code."""
        if self._failed is None:
            self._failed = error
            self._log(logging.ERROR, "stopping: %s", error)
        self._view.degraded = Degraded(
            code=error.code.value, message=error.message[:4096], since=self.clock()
        )
        self._view.status = WorkerStatus.DEGRADED
        return self._failed


def _ack_error(exc: ControlPlaneError) -> AckError:
    return AckError(code=exc.code.value, message=exc.message[:4096], retryable=exc.retryable)
