"""The controller: the one elected coordinator turns the log's wishes into commands, wave by wave.

Runs inside every coordinator; exactly one leads (docs/controller.md). Its state is only what
the log holds: the coordinator's follower folds the controller topic (targets, rollouts, actions,
rollout states) and the three channels (commands, acks, heartbeats); :func:`decide` reads that
and says what to write. The loop, once elected in generation *g*:

1. init the transactional producer (this fences every earlier holder of the id);
2. read every followed partition up to its end as of now (after the init, so it includes all
   that earlier holders committed);
3. write a ``leader`` record; then, each time the log changes or a tick passes, decide and write
   the decision's commands and rollout states in one transaction, and fold them once it
   committed (the next decision starts from them; the follower reading them back changes nothing).

Fenced (another coordinator inits the id), revoked, or a transaction with an unknown outcome:
it stops writing at once, drops the producer and waits to be elected again; it never writes
through anything but that producer, so a paused former leader cannot publish after a newer one
took over. The coordinator's HTTP answers come from the same fold on every coordinator, leader
or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Final

from controlplane.coordinator.follower import Batch, Follower
from controlplane.kafka.bus import Record
from controlplane.kafka.election import LeaderElection, LeadershipLost
from controlplane.kafka.settings import KafkaSettings
from controlplane.kafka.transactions import (
    Transaction,
    TransactionalProducer,
    TransactionFenced,
    TransactionOutcomeUnknown,
)
from controlplane.rollout.decisions import named
from controlplane.rollout.progressive import Decision, conflicts, decide
from controlplane.rollout.targets import ControlState
from controlplane.wire.channels import COMMANDS, CONTROL
from controlplane.wire.control import LeaderRecord
from controlplane.wire.errors import BusError, CommandRejected, LocalCode
from controlplane.wire.messages import AckState, Command
from controlplane.wire.signing import Signer

log = logging.getLogger(__name__)

#: How often the controller decides when nothing in the log changed (bakes, pauses, deadlines).
DEFAULT_TICK_S: Final = 0.5
#: The share of the coordinator's time deciding may take (a large fleet's decision takes long:
#: the loop rests after it), and the longest rest.
DUTY: Final = 0.25
MAX_REST_S: Final = 5.0
#: The end of a batch's rollout id (progressive.batch_rollout_id): only their acks feed the gates.
_BATCH_ID: Final = re.compile(r"\.w[0-9]+\.b[0-9]+$")
#: Probe answers and digests kept before those of ended rollouts are dropped.
_FACTS_KEPT: Final = 10_000
#: After an error that is not a lost leadership: wait this long before trying again.
_RETRY_S: Final = 1.0


class Controller:
    """``await controller.run()`` in a task; the coordinator starts and cancels it."""

    def __init__(
        self,
        settings: KafkaSettings,
        follower: Follower,
        now: Callable[[], datetime | None],
        *,
        issuer: str = "controller",
        member: str | None = None,
        session_timeout_ms: int = 10_000,
        transaction_timeout_ms: int = 15_000,
        tick_s: float = DEFAULT_TICK_S,
        signer: Signer | None = None,
        verify: Callable[[Command], None] | None = None,
    ) -> None:
        """``now``: the instant to judge at (None: the replica has not caught up yet);
        ``signer``: signs every command it publishes (progressive waves, rollbacks, syncs);
        ``verify``: what the follower checks of a command read back (raises CommandRejected):
        the commands it writes are folded as the follower will fold them, so that the leader
        and its standbys agree even on a command its key may not sign."""
        if follower.control is None:
            raise ValueError("the controller needs a follower that folds the controller topic")
        self.settings = settings
        self.follower = follower
        self.control: ControlState = follower.control
        self.fleet = follower.fleet
        self._now = now
        self.issuer = issuer
        self.member = member or f"{socket.gethostname()}-{os.getpid()}"
        self.session_timeout_ms = session_timeout_ms
        self.transaction_timeout_ms = transaction_timeout_ms
        self.tick_s = tick_s
        self.signer = signer
        self.verify = verify
        #: (rollout id, worker id) -> the probe answer of its succeeded ack.
        self.probes: dict[tuple[str, str], dict[str, Any]] = {}
        #: (rollout id, worker id) -> the weights digest of its succeeded ack.
        self.digests: dict[tuple[str, str], str] = {}
        #: The generation this coordinator leads and writes in (None: it does not).
        self.leading: int | None = None
        self.decisions = 0
        self.commands_published = 0
        #: Times this coordinator was fenced (CONTROLLER_FENCED) and stepped down.
        self.fenced = 0
        self.last_error: str | None = None
        self._changed = asyncio.Event()
        #: Workers two targets claim, as last reported.
        self._conflicts: dict[str, list[str]] = {}
        #: Per worker, what its latest heartbeat said that a decision depends on.
        self._seen: dict[str, tuple[object, ...]] = {}
        #: Syncs the seal refused, said once each.
        self._refused: set[str] = set()
        follower.listeners.append(self._on_batch)

    def _on_batch(self, batch: Batch) -> None:
        for ack in batch.acks:
            if ack.state is AckState.SUCCEEDED and _BATCH_ID.search(ack.rollout_id):
                probe = ack.result.get("probe")
                if isinstance(probe, dict):
                    self.probes[(ack.rollout_id, ack.worker_id)] = probe
                digest = ack.result.get("weights_digest")
                if isinstance(digest, str):
                    self.digests[(ack.rollout_id, ack.worker_id)] = digest
        # Decide again on what can change a decision; a heartbeat saying what the last one of
        # its worker said cannot (time-driven changes, a lease running out, come with the tick).
        changed = bool(batch.control or batch.commands or batch.acks)
        for hb in batch.heartbeats:
            seen = (
                hb.incarnation,
                hb.status,
                hb.weights_version,
                hb.config_digest,
                hb.in_flight is None,
                hb.degraded is None,
                tuple(sorted(hb.labels.items())),
            )
            if self._seen.get(hb.worker_id) != seen:
                self._seen[hb.worker_id] = seen
                changed = True
        if changed:
            self._changed.set()
        self._forget_ended()  # on standby coordinators too (they never decide)

    async def run(self) -> None:
        """Campaign, lead, step down, campaign again: until cancelled."""
        async with LeaderElection(
            self.settings, session_timeout_ms=self.session_timeout_ms
        ) as election:
            while True:
                generation = await election.wait_leader()
                try:
                    await self._lead(election, generation)
                except TransactionFenced as exc:
                    self.fenced += 1
                    self.last_error = f"{LocalCode.CONTROLLER_FENCED}: {exc.message}"
                    log.warning(
                        "error: %s: generation %s: %s; stepping down",
                        LocalCode.CONTROLLER_FENCED,
                        generation,
                        exc.message,
                    )
                    await election.rejoin(generation)
                except LeadershipLost:
                    log.info("controller: generation %s ended", generation)
                except (TransactionOutcomeUnknown, BusError) as exc:
                    self.last_error = f"{exc.code}: {exc.message}"
                    log.warning("controller: %s: %s; starting over", exc.code, exc.message)
                    await asyncio.sleep(_RETRY_S)  # a retry delay, not a synchronization

    async def _lead(self, election: LeaderElection, generation: int) -> None:
        topics = self.settings.topics
        producer = TransactionalProducer(
            self.settings,
            topics.controller_transactional_id,
            transaction_timeout_ms=self.transaction_timeout_ms,
        )
        try:
            async with election.leading(generation):
                await producer.start()  # every earlier holder of the id is fenced from here
            await self.follower.wait_reached(await self.follower.end_offsets())
            now = await self._judge_time(election, generation)
            leader = LeaderRecord(
                member=self.member,
                generation=generation,
                producer_epoch=producer.producer_epoch,
                since=now,
            )
            async with election.leading(generation), producer.transaction() as txn:
                _put(txn, CONTROL.record(topics, leader))
            self.leading = generation
            log.info(
                "controller: leading in generation %s (producer epoch %s)",
                generation,
                producer.producer_epoch,
            )
            await self.follower.wait_reached(_ends(txn.records))
            while election.is_leader(generation):
                now = await self._judge_time(election, generation)
                started = time.monotonic()
                decision = decide(
                    self.control,
                    self.fleet,
                    now,
                    issuer=self.issuer,
                    probes=self.probes,
                    digests=self.digests,
                    seal=self.seal if self.signer is not None or self.verify else None,
                )
                self._report_refused(decision)
                self._report_conflicts(now)
                self._forget_ended()
                spent = time.monotonic() - started
                if not decision:
                    await self._wait_change(spent)
                    continue
                await self._write(election, generation, producer, decision)
                await self._rest(spent)
            raise LeadershipLost(f"generation {generation} revoked")
        finally:
            self.leading = None
            await producer.stop()

    async def _write(
        self,
        election: LeaderElection,
        generation: int,
        producer: TransactionalProducer,
        decision: Decision,
    ) -> None:
        topics = self.settings.topics
        async with election.leading(generation), producer.transaction() as txn:
            for command in decision.commands:
                _put(txn, COMMANDS.record(topics, command))
            for state in decision.states:
                _put(txn, CONTROL.record(topics, state))
        self.decisions += 1
        self.commands_published += len(decision.commands)
        for state in decision.states:
            log.info(
                "rollout %s: %s (wave %s, revision %s) %s",
                state.rollout_id,
                state.phase.value,
                state.wave,
                state.revision,
                state.message,
            )
        for command in decision.commands:
            log.info(
                "published %s to %s", command.rollout_id, named(command.selector.worker_ids or [])
            )
        # The next decision starts from these records, committed: fold them now rather than
        # wait for the follower to bring them back (both folds ignore a record seen twice:
        # an equal command, a rollout state of a revision already held).
        for command in decision.commands:
            self._fold_own(command)
        for state in decision.states:
            self.control.observe(state)

    def seal(self, command: Command) -> Command:
        """``command`` signed with its key, once its own trust store verifies it (what the
        follower will check reading it back); CommandRejected otherwise: the decision then
        publishes nothing for it (a published one would be no rollout, and be published again
        at every decision)."""
        if self.signer is not None:
            command = self.signer.sign(command)
        if self.verify is not None:
            self.verify(command)
        return command

    def _report_refused(self, decision: Decision) -> None:
        """Say once per rollout id that a sync was not published: its trust store refuses it."""
        for command, exc in decision.refused:
            if command.rollout_id in self._refused:
                continue
            if len(self._refused) >= _FACTS_KEPT:
                self._refused.clear()
            self._refused.add(command.rollout_id)
            log.warning(
                "error: %s: controller: %s not published, its own trust store refuses it: %s",
                exc.code,
                command.rollout_id,
                exc.message,
            )

    def _fold_own(self, command: Command) -> None:
        """Fold a command it wrote as the follower will when it reads it back."""
        if self.verify is not None:
            try:
                self.verify(command)
            except CommandRejected as exc:
                key_id = None if command.signature is None else command.signature.key_id
                self.fleet.observe_unverified(command, exc.code, exc.message, key_id)
                log.warning(
                    "controller: %s published, not verified by its own trust store (%s): %s",
                    command.rollout_id,
                    exc.code,
                    exc.message,
                )
                return
        self.fleet.observe_command(command)

    def _forget_ended(self) -> None:
        """Drop the probe answers and digests of rollouts that ended (gates never look again)."""
        for facts in (self.probes, self.digests):
            if len(facts) <= _FACTS_KEPT:
                continue
            for key in list(facts):
                match = _BATCH_ID.search(key[0])
                rollout = None if match is None else self.control.rollout(key[0][: match.start()])
                if rollout is None or rollout.ended:
                    del facts[key]

    def _report_conflicts(self, now: datetime) -> None:
        """Say once per worker that two targets claim it (it is left alone meanwhile)."""
        found = conflicts(self.control, self.fleet, now)
        for worker, names in found.items():
            if self._conflicts.get(worker) != names:
                log.warning(
                    "error: %s: worker %s is matched by targets %s: left alone until only one "
                    "selector matches it",
                    LocalCode.TARGET_CONFLICT,
                    worker,
                    ", ".join(names),
                )
        self._conflicts = found

    async def _judge_time(self, election: LeaderElection, generation: int) -> datetime:
        while True:
            now = self._now()
            if now is not None:
                return now
            if not election.is_leader(generation):
                raise LeadershipLost(f"generation {generation} revoked")
            await self._wait_change()

    async def _rest(self, spent: float) -> float:
        """After a decision that took ``spent`` seconds, let the coordinator's loop (its fold,
        its API) have the rest: at most :data:`DUTY` of it goes to deciding. Nothing at a few
        hundred workers (a decision takes a millisecond); about 0.6 s after each 0.2 s decision
        at 10,000. Returns how long it rested."""
        rest = min(MAX_REST_S, spent * (1 / DUTY - 1))
        if rest > 0.001:
            await asyncio.sleep(rest)
        return rest

    async def _wait_change(self, spent: float = 0.0) -> None:
        """Until the log changes in a way a decision depends on, or the tick passes."""
        rested = await self._rest(spent)
        # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
        # comes as the event is set, and the coordinator's stop then waited on this task forever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, self.tick_s - rested)):
                await self._changed.wait()
        self._changed.clear()


def _put(txn: Transaction, record: tuple[str, bytes, bytes]) -> None:
    topic, key, value = record
    txn.send(topic, value, key=key)


def _ends(records: Iterable[Record]) -> dict[tuple[str, int], int]:
    ends: dict[tuple[str, int], int] = {}
    for record in records:
        key = (record.topic, record.partition)
        ends[key] = max(ends.get(key, 0), record.offset + 1)
    return ends
