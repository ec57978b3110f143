"""The worker agent: consume commands, filter, dedupe, dispatch to the runner off the loop, ack, commit.

One command at a time, in log order. The position is committed only after the terminal ack is
published; application is idempotent by command id (journal.py, written in two phases by
durable.py). Heartbeats run beside the command loop and never wait for the runner or the disk.
No signals or asyncio.run here (see workers/cli.py).

This module is the lifecycle: it opens the journal, the producer and the consumer, builds the
parts of a :class:`RunSession` over them, finds the position, fetches, and commits. One
command's path is in commands.py (applied by apply.py); acks go through outbox.py, heartbeats
through heartbeat.py, both over producer.py. Only this module builds a ``Producer`` or a
``Consumer``.

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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane.kafka.bus import Consumer, Producer
from controlplane.wire.channels import COMMANDS
from controlplane.wire.errors import BusError, CommandRejected, ControlPlaneError, WireCode
from controlplane.wire.protocol import CommandKind, Degraded, WorkerStatus, utcnow
from workers.agent import failpoints
from workers.agent.commands import CommandPath, Handled, replayed
from workers.agent.durable import Journal
from workers.agent.heartbeat import AGENT_VERSION as AGENT_VERSION
from workers.agent.heartbeat import Heartbeater
from workers.agent.journal import WorkerState
from workers.agent.outbox import AckOutbox, AcksLeftUnpublished
from workers.agent.producer import ProducerLink, PublishHealth
from workers.agent.session import AgentLog, StopSignal, WorkerView
from workers.agent.settings import WorkerSettings
from workers.agent.trust import TrustGate
from workers.runners.base import Runner
from workers.weights.paths import resolve_weights_path

#: How long one fetch of commands waits for a record (the broker answers as soon as one lands;
#: a stop ends the wait at once): how often an idle agent's command loop goes round.
COMMAND_WAIT_S = 5.0


@dataclass(frozen=True)
class RunSession:
    """The parts of one run, over the journal, producer and consumer it opened."""

    journal: Journal
    consumer: Consumer
    link: ProducerLink
    outbox: AckOutbox
    heart: Heartbeater
    commands: CommandPath


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
        self._started_at = self.clock()
        #: Signed commands: the trust store is read now (SETTINGS_INVALID before any Kafka).
        self._gate = TrustGate.from_path(
            settings.trust_store,
            settings.allowed_roots,
            check_every_s=settings.trust_store_check_s,
            log=self._log,
        )

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Stop taking commands; the one in flight may finish within ``drain_timeout_s``."""
        self._stop.request()

    def reload_trust_store(self) -> bool:
        """Read the trust store file again (SIGHUP): the next command is admitted by the new
        store; one that does not read or validate leaves the previous one in force (logged,
        SETTINGS_INVALID). Whether the store in force changed; nothing without a store."""
        if self._gate.verifier is None:
            self._log(logging.INFO, "no trust store to read again (FLEET_WORKER_TRUST_STORE)")
            return False
        return self._gate.reload()

    @property
    def trust_store_digest(self) -> str | None:
        """The sha256 of the trust store in force (None without one)."""
        return self._gate.digest

    async def run(self) -> None:
        """Run until stopped. Drains on stop: in-flight command acked, last heartbeat sent.

        A journal that cannot be written stops the worker: no more commands, a degraded
        heartbeat with code JOURNAL_WRITE_FAILED (best effort), then that error is raised here
        once everything is closed. The runner is closed whatever happened; an error while
        closing is logged and never hides the one that stopped the worker.
        """
        journal: Journal | None = None  # None only when it could not be opened
        signed = self._gate.verifier is not None
        self._log(
            logging.INFO if signed else logging.WARNING,
            "commands: %s",
            self._gate.describe(self.settings.trust_store),
        )
        try:
            directory = self.settings.worker_state_dir
            journal = Journal(
                WorkerState.open(directory), directory, on_failure=self._journal_failed
            )
            async with (
                Producer(self.settings.kafka) as producer,
                Consumer(
                    self.settings.kafka,
                    group_id=self.topics.worker_group(self.worker_id),
                    # The broker answers a waiting fetch as soon as a command lands, so a long
                    # poll costs no latency, while a short one costs a request per idle worker
                    # every 100 ms (docs/benchmarks.md, idle CPU of the agents).
                    fetch_max_wait_ms=3000,
                    # Partition 0, assigned by hand: nothing for the fetcher to poll for.
                    fetcher_poll_ms=3000,
                ) as consumer,
            ):
                session = self._session(journal, producer, consumer)
                try:
                    try:
                        await self._establish_position(session)
                    except ControlPlaneError as exc:
                        if exc is not self._failed:
                            raise
                        await session.heart.beat()  # best effort: say why, then stop
                    else:
                        await self._serve(session)
                    await session.heart.drain()
                finally:
                    await session.link.close()  # a renewed producer, and the retired ones
        finally:
            await self._close(journal)
        if self._failed is not None:
            raise self._failed

    def _session(self, journal: Journal, producer: Producer, consumer: Consumer) -> RunSession:
        """The parts of this run, wired together (nothing started yet)."""
        health = PublishHealth()
        link = ProducerLink(
            producer,
            lambda: Producer(self.settings.kafka),  # loop.Producer, as tests patch it
            health=health,
            log=self._log,
        )
        outbox = AckOutbox(
            link=link,
            health=health,
            topics=self.topics,
            stop=self._stop,
            clock=self.clock,
            log=self._log,
        )
        heart = Heartbeater(
            settings=self.settings,
            runner_name=self.runner.name,
            link=link,
            health=health,
            view=self._view,
            stop=self._stop,
            incarnation=journal.incarnation,
            started_at=self._started_at,
            clock=self.clock,
            log=self._log,
        )
        commands = CommandPath(
            settings=self.settings,
            runner=self.runner,
            journal=journal,
            outbox=outbox,
            heart=heart,
            view=self._view,
            stop=self._stop,
            clock=self.clock,
            log=self._log,
            outcomes=self.outcomes,
            gate=self._gate,
        )
        return RunSession(journal, consumer, link, outbox, heart, commands)

    async def _serve(self, session: RunSession) -> None:
        """Heartbeats beside the command loop, until stopped (or the journal fails).

        Acks journaled and not published by the previous run go first (heartbeats already
        report them, should the cluster not take them yet)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(session.heart.run())
            try:
                await self._publish_pending_acks(session)
                await self._load_runner(session.journal, session.commands)
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
                await self._command_loop(session)
            except ControlPlaneError as exc:
                if exc is not self._failed:
                    raise
                await session.heart.beat()  # the degraded heartbeat, best effort; then stop
            except AcksLeftUnpublished:
                left = len(session.journal.unpublished())
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
                session.heart.finish()
                session.outbox.cancel()  # only if the command loop was cancelled

    async def _close(self, journal: Journal | None) -> None:
        """Close the journal, then the runner (always); errors are logged, never raised over
        the one that stopped the worker. A journal that cannot be closed when nothing else
        failed is the error run() raises."""
        if journal is not None:
            error = journal.close()  # never raises: returns what it could not write
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

    async def _establish_position(self, session: RunSession) -> None:
        """Where to read from: Kafka's committed offset, else ours, else the head of the log.

        A worker never seen before starts at the head: history is not replayed onto it. The
        position is fixed before the first heartbeat, so a command published after a worker
        is visible as live is always seen by it.
        """
        consumer, journal = session.consumer, session.journal
        topic = COMMANDS.topic(self.topics)
        await consumer.assign(topic, [0])
        committed = await consumer.committed(topic, 0)
        begin = (await consumer.beginning_offsets(topic))[0]
        end = (await consumer.end_offsets(topic))[0]
        if committed is not None:
            start, source = committed, "committed offset"
        elif journal.next_offset is not None:
            start, source = journal.next_offset, "local state (committed offset expired)"
        else:
            start, source = end, "head of the log (new worker)"
        if start < begin:
            self._log(
                logging.WARNING, "offset %d was deleted by retention; reading from %d", start, begin
            )
            start = begin
        consumer.seek(topic, 0, start)
        # Remember where this incarnation starts, so a crash before its first commit resumes here.
        await journal.commit_published((), start)
        self._log(logging.INFO, "reading %s from offset %d (%s)", topic, start, source)

    async def _publish_pending_acks(self, session: RunSession) -> None:
        """Terminal acks recorded but not known to be published (a crash, or a stop while the
        cluster did not take them): publish them, together, then mark them published."""
        pending = session.journal.unpublished()
        if not pending:
            return
        self._log(
            logging.INFO,
            "re-publishing %d ack(s) of applied commands, from the journal",
            len(pending),
        )
        await session.outbox.publish([replayed(ack, self.clock()) for ack in pending])
        await session.journal.commit_published([ack.command_id for ack in pending])

    async def _load_runner(self, journal: Journal, commands: CommandPath) -> None:
        """Load the model. If that fails the worker keeps running, degraded (RUNNER_LOAD_FAILED
        in its heartbeats), and the runner refuses reloads with MODEL_NOT_LOADED."""
        try:
            await asyncio.to_thread(self.runner.load)
        except Exception as exc:
            message = exc.message if isinstance(exc, ControlPlaneError) else f"{exc}"
            message = f"{type(exc).__name__}: {message}"
            self._log(logging.ERROR, "runner failed to load its model: %s", message)
            self._view.degraded = Degraded(
                code=WireCode.RUNNER_LOAD_FAILED.value,
                message=message[:4096],
                since=self.clock(),
            )
        else:
            if self.settings.restore_on_start:
                await self._restore(journal, commands)
        await self._view.refresh(self.runner, self._log)
        self._view.status = self._view.idle_status(self._stop.is_set())

    async def _restore(self, journal: Journal, commands: CommandPath) -> None:
        """Re-apply what this worker had applied before a restart (level, not events).

        With a trust store, only what a key the store trusts now admitted: weights or config
        overrides whose key was since revoked or removed (or that came without a signature)
        are not re-applied, and the worker reports degraded with that code until a trusted
        command of that kind replaces them (see docs/signing.md)."""
        untrusted: dict[CommandKind, CommandRejected] = {}
        overrides: dict[str, Any] = {}
        for name, value in journal.config_overrides.items():
            refused = self._gate.distrusts(journal.config_keys.get(name), CommandKind.UPDATE_CONFIG)
            if refused is None:
                overrides[name] = value
            else:
                untrusted.setdefault(CommandKind.UPDATE_CONFIG, refused)
        if overrides:
            try:
                await asyncio.to_thread(self.runner.update_config, overrides)
            except Exception as exc:
                self._log(logging.ERROR, "could not restore config overrides: %s", exc)
        spec = journal.weights
        refused = (
            None
            if spec is None
            else self._gate.distrusts(journal.weights_key, CommandKind.RELOAD_WEIGHTS, spec.path)
        )
        if refused is not None:
            untrusted[CommandKind.RELOAD_WEIGHTS] = refused
        elif spec is not None:
            try:
                path = resolve_weights_path(spec.path, self.settings.allowed_roots)
                await asyncio.to_thread(self.runner.reload_weights, spec, path)
                self._log(logging.INFO, "restored weights %s from %s", spec.version, spec.path)
            except Exception as exc:
                self._log(logging.ERROR, "could not restore weights %s: %s", spec.version, exc)
        if untrusted:
            self._not_restored(journal, untrusted, commands)

    def _not_restored(
        self,
        journal: Journal,
        untrusted: dict[CommandKind, CommandRejected],
        commands: CommandPath,
    ) -> None:
        """Say, once and in the heartbeats, what a restart did not re-apply, and why."""
        what = []
        if CommandKind.RELOAD_WEIGHTS in untrusted and journal.weights is not None:
            what.append(
                f"weights {journal.weights.version} ({untrusted[CommandKind.RELOAD_WEIGHTS].message})"
            )
        if CommandKind.UPDATE_CONFIG in untrusted:
            names = sorted(
                n
                for n in journal.config_overrides
                if self._gate.distrusts(journal.config_keys.get(n), CommandKind.UPDATE_CONFIG)
                is not None
            )
            what.append(
                f"config overrides {names} ({untrusted[CommandKind.UPDATE_CONFIG].message})"
            )
        first = untrusted.get(CommandKind.RELOAD_WEIGHTS) or untrusted[CommandKind.UPDATE_CONFIG]
        message = (
            "not re-applied after the restart, their key no longer trusted for them: "
            + "; ".join(what)
            + "; the worker keeps what it loaded until a trusted command replaces them"
        )
        self._log(logging.ERROR, "%s: %s", first.code.value, message)
        self._view.degraded = Degraded(
            code=first.code.value, message=message[:4096], since=self.clock()
        )
        commands.unrestored.update(untrusted)

    # ------------------------------------------------------------------ commands

    async def _command_loop(self, session: RunSession) -> None:
        while not self._stop.is_set():
            try:
                # A long wait for the next command, ended at once by a stop: an idle agent's
                # loop goes round every COMMAND_WAIT_S, not twice a second (idle CPU, 500 agents
                # a host in bench.fanout).
                records = await self._stop.unless_stopped(
                    session.consumer.fetch(timeout_s=COMMAND_WAIT_S, max_records=16)
                )
            except BusError as exc:
                self._fetch_failed(exc)
                await self._stop.sleep(1.0)
                continue
            if records is None:
                break  # stopped while waiting
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
                handled = await session.commands.handle(record)
                await self._commit(session, record.offset + 1, handled)

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

    async def _commit(self, session: RunSession, next_offset: int, handled: Handled) -> None:
        """Journal phase 2, then Kafka: the "published" mark of the ack just sent (if any) and
        the next offset, in one fsync, then the commit."""
        published = () if handled.published is None else (handled.published,)
        await session.journal.commit_published(published, next_offset)
        if handled.acked:
            failpoints.hit("after_ack")
        try:
            await session.consumer.commit(COMMANDS.topic(self.topics), 0, next_offset)
        except BusError as exc:  # the local state still has it; Kafka catches up at the next one
            self._log(logging.WARNING, "commit of offset %d failed: %s", next_offset, exc)

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
