"""Reads the three topics from the beginning and folds them into a :class:`~controlplane.rollout.fleet.Fleet`.

The log is the source of truth: the coordinator and ``controlplane ... --wait`` both rebuild
their state with this, then follow live. No HTTP, no printing; listeners get each folded batch.
A reader of one rollout (the CLI) narrows it: fewer topics, only some rollouts' commands and
acks, partitions started at given offsets or at their end (see :class:`Follower`).

While the log is replayed, Python's cyclic garbage collector is off (reference counting still
frees every record and ack as soon as it is folded). A replay allocates millions of short-lived
objects beside a growing fleet, and the collector, triggered by allocation counts, scans that
growing heap again and again: a third of a 300,000-ack replay (docs/benchmarks.md, section 2).
It is switched back on when the replay ends, or when the follower stops.

Catching up and being current are defined by the consumer's positions, never by the records
seen: a partition emptied by retention (log start == end > 0), or whose last offset is a
transaction marker, has no record at ``end - 1`` to read, but the consumer's position still
reaches ``end``. :meth:`Follower.current_as_of` is the time up to which the reader knows it has
folded everything (the rule, :class:`PartitionClock`): per partition, the latest T such that
its position has reached an end the partition had at T (the end offsets sampled when it
started, or the end a fetch sent at T returned), or, on the workers partition, the broker's
append time of the last record read there (one partition, read in order: every record appended
before it has been read); the oldest of the partitions. It never passes what the reader has
read: while Kafka is unreachable it stands still, and while the reader lags (a long replay, a
loop blocked by other work) it is the time its backlog starts at, never the clock, so liveness
judged at it never counts a silence the reader could not hear, nor its own lateness.

A reader that also writes (``probe=True``: the coordinator, ``--wait``, ``status``) knows more:
it appends a small probe record to the workers topic every ``probe_interval_s`` and reads it
back. A record read from the workers partition with broker append time T proves that every
heartbeat appended before T has been read too (one partition, read in order), so with probes
the workers partition is current only by such T (and the send time of its own probes read
back), not by a fetch's end: an end says nothing of writes Kafka holds back (before any such T
is read, an empty or older topic, it is the offsets sampled at start). When Kafka accepts
no writes, or holds them back (a broker died and the in-sync replicas still list it, until it
is fenced: ``acks=all`` writes wait on every partition it replicated; or fewer in-sync
replicas than ``min.insync.replicas``), heartbeats stop arriving though every fetch answers:
the probes stop too, and no worker is judged lost for a silence the log itself imposed.

When a heartbeat was received (``received_at``, for liveness): the broker's append time when
the workers topic says ``message.timestamp.type=LogAppendTime`` (topics.py asks for it); else
the reader's clock when it fetched the record, once caught up (a live fetch brings what was
appended since the last one, a fetch interval ago); while the log is replayed, None: the
heartbeat's own ``sent_at`` (a CreateTime is the same writer's clock, and the reader's clock
says nothing about when an old record was appended). A broker timestamp is capped at the
reader's clock: a heartbeat is never received in the future.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any, Final

from controlplane.kafka.bus import (
    LOG_APPEND_TIME,
    Consumer,
    Producer,
    Record,
    collector_paused,
    health,
)
from controlplane.kafka.lifecycle import AsyncService
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.targets import ControlState
from controlplane.wire.ack_codec import AckLike
from controlplane.wire.channels import ACKS, CHANNELS, COMMANDS, CONTROL, HEARTBEATS, Channel
from controlplane.wire.control import ControlRecord
from controlplane.wire.errors import BusError, CommandRejected, LocalCode, ProtocolError, WireCode
from controlplane.wire.protocol import Command, Heartbeat, ReloadWeightsSpec
from controlplane.wire.signing import Verifier, lexically_within, wire_object

log = logging.getLogger(__name__)

#: The key of the readers' probe records on the workers topic: one key for every reader, so
#: compaction keeps one. Never a worker id (ids are identifiers: no NUL). Value: JSON
#: ``{"probe": <reader id>, "sent_at": <unix seconds>}``.
PROBE_KEY: Final = b"\x00probe"
#: Refused commands logged one by one at most this many lines a window (the others counted).
UNVERIFIED_LOG_LINES: Final = 10
UNVERIFIED_LOG_WINDOW_S: Final = 60.0
#: The longest TTL a verified command may claim: the workers' default ``max_ttl_s``.
DEFAULT_MAX_TTL_S: Final = 7 * 24 * 3600.0


@dataclass
class Batch:
    """What one fetch folded in, in log order per topic."""

    commands: list[Command] = field(default_factory=list)
    #: Commands the trust store did not verify (folded as such: never into a rollout).
    unverified: list[Command] = field(default_factory=list)
    #: :class:`~controlplane.wire.ack_codec.FastAck` from the log; anything ack-like from elsewhere.
    acks: list[AckLike] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    #: Records of the controller topic (only with a follower given a ControlState).
    control: list[ControlRecord] = field(default_factory=list)
    undecodable: int = 0
    replay: bool = False

    @property
    def rollout_ids(self) -> set[str]:
        return (
            {c.rollout_id for c in self.commands}
            | {a.rollout_id for a in self.acks}
            | {c.rollout_id for c in self.unverified}
        )

    def __bool__(self) -> bool:
        return bool(
            self.commands
            or self.acks
            or self.heartbeats
            or self.control
            or self.undecodable
            or self.unverified
        )


@dataclass(slots=True)
class PartitionClock:
    """Up to when one reader has read everything appended to one partition (Unix seconds).

    Two kinds of evidence, each a lower bound; the latest counts:

    - an end reached: at time T the partition ended at offset E (the end offsets sampled when
      the reader started, or the end a fetch sent at T returned), and the reader's position
      has reached E: everything appended before T has been read (:meth:`reached`);
    - an append read: a record whose broker append time is T (``LogAppendTime``, or the send
      time of the reader's own probe, appended after it was sent) has been read: every record
      appended before it lies before it in the partition (:meth:`appended`).

    Pure: the times come in; no clock.
    """

    by_end: float | None = None
    by_append: float | None = None
    #: The start sample's time once reached (also in ``by_end``).
    by_start: float | None = None

    def reached(
        self, at: float | None, end: int | None, position: int | None, *, start: bool = False
    ) -> None:
        """Note that the partition ended at ``end`` at time ``at`` (``start``: the sample
        taken when the reader started); counts once ``position`` has reached it."""
        if at is None or end is None or position is None or position < end:
            return
        if start:
            self.by_start = at
        if self.by_end is None or at > self.by_end:
            self.by_end = at

    def appended(self, at: float) -> None:
        """Note that a record appended at ``at`` has been read."""
        if self.by_append is None or at > self.by_append:
            self.by_append = at

    def as_of(self, *, ends_count: bool = True) -> float | None:
        """The latest evidence; ``ends_count=False``: appends only (a prober's workers
        partition, where an end says nothing of writes Kafka holds back), unless none is known
        yet (an empty topic, or one without append times, before its probe came back): then
        the start sample, which any append read later (after the start) does not go back on."""
        if not ends_count:
            return self.by_append if self.by_append is not None else self.by_start
        known = [at for at in (self.by_end, self.by_append) if at is not None]
        return max(known) if known else None


def view_as_of(partitions: Sequence[float | None]) -> float | None:
    """A view of several partitions is current as of the oldest of them (None: one unknown)."""
    if not partitions or any(at is None for at in partitions):
        return None
    return min(at for at in partitions if at is not None)


Listener = Callable[[Batch], None]
AckDecoder = Callable[[bytes], AckLike]
_topic_partition = attrgetter("topic", "partition")


class Follower(AsyncService):
    """``async with Follower(...) as f: await f.catch_up(); await f.follow()``."""

    def __init__(
        self,
        settings: KafkaSettings,
        fleet: Fleet | None = None,
        *,
        decode_ack: AckDecoder | None = None,
        probe: bool = False,
        probe_interval_s: float = 1.0,
        control: ControlState | None = None,
        control_optional: bool = False,
        channels: Collection[Channel[Any]] = CHANNELS,
        rollouts: Collection[str] | None = None,
        start_at: Mapping[tuple[str, int], int] | None = None,
        tail: Collection[Channel[Any]] = (),
        verifier: Verifier | None = None,
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
    ) -> None:
        """``decode_ack``: None, the acks channel's compiled decoder; ``protocol.decode_ack``
        gives the same acks as pydantic models, several times slower. ``probe``: write a probe record to
        the workers topic every ``probe_interval_s`` and judge only up to what was read back
        (see the module's docstring). ``control``: also fold the controller topic into it
        (targets and progressive rollouts); ``control_optional``: when that topic does not
        exist (a fleet whose topics were made before it), follow the rest and say so, instead
        of failing (:attr:`control_missing`).

        A reader of one rollout (the CLI's ``status <id>``, ``--wait``, a publish) need not
        fold the fleet's history: ``channels``, the topics to read (default: commands, acks
        and workers); ``rollouts``, fold only the commands and acks of these rollout ids (the
        others are counted in :attr:`skipped`, and not even decoded when their bytes cannot
        name one of them); ``start_at``, (topic, partition) -> the offset to start reading that
        partition at instead of its beginning; ``tail``, channels read from the end they had at
        start (only what is appended later: a publish's own command and acks). Caught up
        still means: at the end each partition had at start. The coordinator reads
        everything: the defaults.

        ``verifier``: fold only the commands it verifies (:func:`verify_command`, with
        ``max_ttl_s``); the others are folded as unverified (``Fleet.observe_unverified``) and
        listed in ``Batch.unverified``. None: every command, as before signing existed."""
        self.settings = settings
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.reader_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        #: Probes this reader wrote and read back (diagnostics, tests).
        self.probes_sent = 0
        self.probes_read = 0
        self._probe_task: asyncio.Task[None] | None = None
        self.fleet = fleet if fleet is not None else Fleet()
        self.topics = settings.topics
        self.caught_up = asyncio.Event()
        self.listeners: list[Listener] = []
        self.records = 0
        #: Records fetched, per topic (every record, folded or skipped).
        self.records_read: dict[str, int] = {}
        self.undecodable = 0
        self.rollouts = frozenset(rollouts) if rollouts is not None else None
        self.verifier = verifier
        self.max_ttl_s = max_ttl_s
        #: Commands the verifier refused (each record, redeliveries included).
        self.unverified = 0
        #: Refused records not logged one by one (while catching up, or beyond the lines a
        #: window allows), and the current window: (its start, lines logged in it).
        self._unverified_quiet = 0
        self._unverified_window = (-UNVERIFIED_LOG_WINDOW_S, 0)
        #: What a record's bytes must contain to be decoded under ``rollouts``: one of the
        #: ids, or a backslash (a JSON escape: an id may be written ``r\/1`` or ``\u0072-1``).
        self._needles = (
            (*(r.encode() for r in self.rollouts), b"\\") if self.rollouts is not None else ()
        )
        #: Commands and acks not folded: of a rollout outside ``rollouts``.
        self.skipped = 0
        #: Rollout id -> the earliest record timestamp (Unix ms, the writer's clock) of a
        #: command record folded for it, or one that did not decode but names it.
        self.command_times: dict[str, int] = {}
        #: Rollout ids named by command records that did not decode (the workers NACK them
        #: under those ids: such a rollout id is taken).
        self.unreadable_commands: set[str] = set()
        self._start_at = dict(start_at or {})
        self._tail = {channel.topic(self.topics) for channel in tail}
        #: Records whose fold raised something unexpected (logged with topic/partition/offset;
        #: the rest of their fetch is folded all the same).
        self.fold_errors = 0
        self._consumer = Consumer(settings, max_partition_fetch_bytes=4 * 1024 * 1024)
        #: The end offset of each partition when we started: caught up when positions reach them.
        self._targets: dict[tuple[str, int], int] = {}
        #: When those end offsets were asked for (``time.time()``, just before).
        self._targets_at: float | None = None
        #: Per partition, up to when everything in it was folded (see :class:`PartitionClock`).
        self._clocks: dict[tuple[str, int], PartitionClock] = {}
        self._workers_topic = HEARTBEATS.topic(self.topics)
        #: Per partition, the offset after the last record folded (diagnostics; catching up
        #: goes by the consumer's positions, which also pass markers and deleted records).
        self._positions: dict[tuple[str, int], int] = {}
        self._paused_collector = False  # whether the replay switched the cyclic GC off
        observers: dict[Channel[Any], Callable[..., Any]] = {
            COMMANDS: self.fleet.observe_command,
            ACKS: self.fleet.observe_ack,
            HEARTBEATS: self.fleet.observe_heartbeat,
        }
        #: topic -> (decode, observe, the Batch list it goes to)
        self._decoders: dict[str, tuple[Callable[[bytes], Any], Callable[..., Any], str]] = {
            channel.topic(self.topics): (
                decode_ack if channel is ACKS and decode_ack is not None else channel.reader,
                observers[channel],
                channel.name,
            )
            for channel in CHANNELS
            if channel in channels
        }
        self._commands_topic = COMMANDS.topic(self.topics)
        self.control = control
        self.control_optional = control_optional
        #: The controller topic was asked for, optional, and not there at start.
        self.control_missing = False
        if control is not None:
            self._decoders[CONTROL.topic(self.topics)] = (
                CONTROL.decode,
                control.observe,
                "control",
            )
        #: Set after every poll (waiters on positions check again).
        self._polled = asyncio.Event()

    async def start(self) -> None:
        await self._consumer.start()
        if self.control is not None and self.control_optional:
            await self._drop_missing_control_topic()
        names = list(self._decoders)
        await self._consumer.assign_many(names)
        await self._consumer.seek_to_beginning()
        for (topic, partition), offset in self._start_at.items():
            if topic in self._decoders:
                self._consumer.seek(topic, partition, offset)
        self._targets_at = time.time()
        for name in names:
            for partition, end in (await self._consumer.end_offsets(name)).items():
                self._targets[(name, partition)] = end
                if name in self._tail:
                    self._start_at[(name, partition)] = end
                    self._consumer.seek(name, partition, end)
        if all(end <= self._start_at.get(key, 0) for key, end in self._targets.items()):
            self.caught_up.set()
            self._said_replayed()
        elif gc.isenabled():  # (someone else's pause is theirs to end)
            gc.disable()
            self._paused_collector = True
        if self.probe:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="follower-probe")

    def resume_at(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Before :meth:`start`: read these partitions from these offsets (a snapshot's: what
        was folded before them is in the fleet already) instead of their beginning."""
        if self._targets:
            raise RuntimeError("resume_at() is for a follower that has not started")
        self._start_at.update(offsets)

    def positions(self, topics: Collection[str]) -> dict[tuple[str, int], int]:
        """The next offset to fold of every partition of ``topics`` this reader follows: at a
        batch boundary (between two polls), everything before it is folded. A partition
        without a position yet (nothing fetched) is left out."""
        return {
            key: p.position
            for key, p in self._consumer.progress().items()
            if key[0] in topics and p.position is not None
        }

    def follows(self, topic: str) -> bool:
        """Whether this reader folds ``topic`` (the controller topic may be missing)."""
        return topic in self._decoders

    async def _drop_missing_control_topic(self) -> None:
        topic = CONTROL.topic(self.topics)
        try:
            await self._consumer.partitions(topic)  # asked again a while, if just created
            return
        except BusError as exc:
            if "does not exist" not in exc.message:
                raise
        del self._decoders[topic]
        self.control_missing = True
        log.warning(
            "the controller topic %s does not exist: targets and progressive rollouts are off "
            "until `controlplane topics ensure` creates it and the coordinator restarts",
            topic,
        )

    async def stop(self) -> None:
        self._resume_collector()
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        await self._consumer.stop()

    async def _start_producer(self) -> Producer:
        producer = Producer(self.settings, stop_timeout_s=1.0, disposable=True)
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        return producer

    async def _probe_loop(self) -> None:
        """Append a probe to the workers topic every ``probe_interval_s`` (one at a time: a
        probe Kafka holds back is waited for, for at most the delivery timeout)."""
        topic = HEARTBEATS.topic(self.topics)
        producer: Producer | None = None
        try:
            while True:
                try:
                    if producer is None:
                        producer = await self._start_producer()
                    value = json.dumps({"probe": self.reader_id, "sent_at": time.time()})
                    await producer.send(topic, value.encode(), key=PROBE_KEY)
                    self.probes_sent += 1
                except BusError as exc:
                    log.debug("probe not written: %s", exc)
                    if producer is not None and exc.code is not LocalCode.PUBLISH_OUTCOME_UNKNOWN:
                        # It gave up on a probe: the gap in its sequence numbers would make the
                        # broker refuse every later one (OutOfOrderSequenceNumber). A new one.
                        await producer.stop()
                        producer = None
                except Exception as exc:  # never end probing silently: the time would freeze
                    log.warning("probe failed, retrying: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(self.probe_interval_s)
        finally:
            if producer is not None:
                await producer.stop()

    def _resume_collector(self) -> None:
        if self._paused_collector:
            self._paused_collector = False
            gc.enable()

    async def catch_up(self) -> None:
        """Fold everything that was in the log when we started."""
        while not self.caught_up.is_set():
            await self.poll(timeout_s=0.5)

    async def follow(self) -> None:
        """Fold new records forever."""
        while True:
            await self.poll(timeout_s=1.0)

    async def poll(self, *, timeout_s: float = 1.0) -> Batch:
        """One fetch, folded; returns what it folded (and tells the listeners)."""
        fetched = await self._consumer.fetch_partitions(timeout_s=timeout_s)
        now = time.time()
        batch = Batch(replay=not self.caught_up.is_set())
        with collector_paused():  # the fold makes no cycles; see kafka.client.collector_paused
            for topic, partition, records in fetched:
                self._fold_partition(batch, topic, partition, records, now)
        self._note_reached()
        if not self.caught_up.is_set() and self._reached_targets():
            self.caught_up.set()
            self._resume_collector()
            log.info("caught up with the log: %d records folded", self.records)
            self._said_replayed()
        self._polled.set()
        self._polled = asyncio.Event()
        if batch:
            for listener in self.listeners:
                listener(batch)
        return batch

    async def end_offsets(self) -> dict[tuple[str, int], int]:
        """Every followed partition's end now: its last stable offset (read_committed)."""
        ends: dict[tuple[str, int], int] = {}
        for name in self._decoders:
            for partition, end in (await self._consumer.end_offsets(name)).items():
                ends[(name, partition)] = end
        return ends

    def reached(self, ends: dict[tuple[str, int], int]) -> bool:
        """Whether every partition of ``ends`` has been folded up to its offset there."""
        progress = self._consumer.progress()
        for key, end in ends.items():
            p = progress.get(key)
            if end > 0 and (p is None or p.position is None or p.position < end):
                return False
        return True

    def behind(self) -> bool:
        """Whether the reader lags: some partition's position is short of the end its last
        answered fetch returned (records wait to be folded; :meth:`current_as_of` is then the
        time its backlog starts at, not the time of that fetch)."""
        for p in self._consumer.progress().values():
            if p.position is not None and p.end is not None and p.position < p.end:
                return True
        return False

    async def wait_reached(self, ends: dict[tuple[str, int], int]) -> None:
        """Wait until :meth:`reached` (someone else polls: the coordinator's loop)."""
        while not self.reached(ends):
            await self._polled.wait()

    def fold(self, records: Sequence[Record]) -> Batch:
        """Fold records (in log order within each partition) without telling the listeners."""
        batch = Batch(replay=not self.caught_up.is_set())
        now = time.time()
        for (topic, partition), run in itertools.groupby(records, key=_topic_partition):
            self._fold_partition(batch, topic, partition, list(run), now)
        return batch

    def _fold_partition(
        self, batch: Batch, topic: str, partition: int, records: list[Record], now: float
    ) -> None:
        """Fold consecutive records of one partition: one topic lookup for all of them.

        A record that does not decode is counted (``undecodable``); one whose fold raises
        anything else is counted in ``fold_errors`` and logged; neither stops the others."""
        if not records:
            return
        self.records += len(records)
        self.records_read[topic] = self.records_read.get(topic, 0) + len(records)
        self._positions[(topic, partition)] = records[-1].offset + 1
        decode, observe, kind = self._decoders[topic]
        folded: list[Any] = getattr(batch, kind)
        append = folded.append
        heartbeats = kind == "heartbeats"
        if heartbeats:
            self._note_written(records, now)
        scope = None if heartbeats or kind == "control" else self.rollouts
        needles = self._needles
        verifier = self.verifier if topic == self._commands_topic else None
        for record in records:
            value = record.value
            if value is None:  # a tombstone on the compacted workers topic: a worker gone
                if heartbeats and record.key is not None:  # for good; a fresh reader (once
                    self._forget(record.key)  # compaction ran) never sees it either
                continue
            if heartbeats and record.key == PROBE_KEY:
                continue
            if scope is not None and not any(needle in value for needle in needles):
                self.skipped += 1
                continue
            try:
                message = decode(value)
            except ProtocolError as exc:
                if (
                    self.rollouts is not None  # a reader of a few rollouts (the CLI's) only
                    and topic == self._commands_topic
                    and exc.rollout_id is not None
                ):
                    self.unreadable_commands.add(exc.rollout_id)
                    self._note_command(exc.rollout_id, record.timestamp_ms)
                self.undecodable += 1
                batch.undecodable += 1
                log.debug(
                    "skipping undecodable %s record at %s@%d: %s", kind, topic, record.offset, exc
                )
                continue
            except Exception as exc:
                self._fold_failed(topic, partition, record.offset, "decoding", exc)
                continue
            if scope is not None and message.rollout_id not in scope:
                self.skipped += 1
                continue
            if self.rollouts is not None and topic == self._commands_topic:
                self._note_command(message.rollout_id, record.timestamp_ms)
            try:
                if verifier is not None and self._unverified(verifier, message, value, batch):
                    continue
                if heartbeats:
                    observe(message, self._received_at(record, now, batch.replay))
                else:
                    observe(message)
            except Exception as exc:
                self._fold_failed(topic, partition, record.offset, "folding", exc)
                continue
            append(message)

    def _unverified(self, verifier: Verifier, command: Command, value: bytes, batch: Batch) -> bool:
        """Whether ``command`` (decoded from ``value``) is refused by the verifier: then it
        is folded as unverified, never into a rollout."""
        try:
            verify_command(verifier, command, wire_object(value), max_ttl_s=self.max_ttl_s)
        except CommandRejected as exc:
            signature = command.signature
            key_id = None if signature is None else signature.key_id
            self.fleet.observe_unverified(command, exc.code, exc.message, key_id)
            batch.unverified.append(command)
            self.unverified += 1
            self._say_unverified(command, exc)
            return True
        return False

    def _say_unverified(self, command: Command, exc: CommandRejected) -> None:
        """Log a refused command: once caught up, at most :data:`UNVERIFIED_LOG_LINES` lines
        a window, each saying how many were not logged since; while catching up (a replay,
        or a restart's), only their count once caught up (:meth:`_said_replayed`)."""
        if not self.caught_up.is_set():
            self._unverified_quiet += 1
            return
        now = time.monotonic()
        start, lines = self._unverified_window
        if now - start >= UNVERIFIED_LOG_WINDOW_S:
            start, lines = now, 0
        if lines >= UNVERIFIED_LOG_LINES:
            self._unverified_quiet += 1
            return
        self._unverified_window = (start, lines + 1)
        quiet, self._unverified_quiet = self._unverified_quiet, 0
        log.warning(
            "command %s of rollout %s not verified (%s): %s%s",
            command.command_id,
            command.rollout_id,
            exc.code,
            exc.message,
            f" ({quiet} more not verified since the last such line)" if quiet else "",
        )

    def _said_replayed(self) -> None:
        """Once caught up: how many commands read while catching up were not verified."""
        if self._unverified_quiet:
            log.warning(
                "%d command record(s) read while catching up were not verified by the trust"
                " store (GET /api/v1/commands/unverified lists them)",
                self._unverified_quiet,
            )
            self._unverified_quiet = 0

    def _forget(self, key: bytes) -> None:
        try:
            worker_id = key.decode("utf-8")
        except UnicodeDecodeError:
            return  # no worker's key (worker_key is the id in UTF-8)
        if self.fleet.registry.forget(worker_id):
            log.info("worker %s removed by a tombstone on the workers topic", worker_id)

    def _note_command(self, rollout_id: str, timestamp_ms: int) -> None:
        held = self.command_times.get(rollout_id)
        if held is None or timestamp_ms < held:
            self.command_times[rollout_id] = timestamp_ms

    async def offsets_for_times(
        self, channel: Channel[Any], at_ms: int
    ) -> dict[tuple[str, int], int]:
        """Per partition of ``channel``'s topic, the earliest offset whose record timestamp is
        at or after ``at_ms`` (its end when none is): a ``start_at`` for another reader."""
        topic = channel.topic(self.topics)
        found = await self._consumer.offsets_for_times(topic, at_ms)
        return {(topic, partition): offset for partition, offset in found.items()}

    def _fold_failed(
        self, topic: str, partition: int, offset: int, doing: str, exc: Exception
    ) -> None:
        self.fold_errors += 1
        log.error(
            "%s the record at %s[%d]@%d failed (%d so far), skipped: %s: %s",
            doing,
            topic,
            partition,
            offset,
            self.fold_errors,
            type(exc).__name__,
            exc,
        )
        log.debug("the failure folding %s[%d]@%d", topic, partition, offset, exc_info=exc)

    @staticmethod
    def _received_at(record: Record, now: float, replay: bool) -> datetime | None:
        """When the reader's side got a heartbeat (see the module's docstring)."""
        if record.timestamp_type == LOG_APPEND_TIME and record.timestamp_ms >= 0:
            return datetime.fromtimestamp(min(record.timestamp_ms / 1000, now), UTC)
        if replay:  # a CreateTime is the writer's clock, as its own sent_at is
            return None
        return datetime.fromtimestamp(now, UTC)

    def _clock(self, key: tuple[str, int]) -> PartitionClock:
        clock = self._clocks.get(key)
        if clock is None:
            clock = self._clocks[key] = PartitionClock()
        return clock

    def _note_written(self, records: list[Record], now: float | None = None) -> None:
        """Advance the workers partition's clock by the appends read there: broker append
        times (capped at ``now``, the reader's clock, as ``received_at`` is) and the send
        times of this reader's own probes."""
        latest: float | None = None
        for record in records:
            at: float | None = None
            if record.key == PROBE_KEY and record.value is not None:
                at = self._own_probe_sent_at(record.value)
                if at is not None:
                    self.probes_read += 1
            if record.timestamp_type == LOG_APPEND_TIME and record.timestamp_ms >= 0:
                at = record.timestamp_ms / 1000
                if now is not None:
                    at = min(at, now)
            if at is not None and (latest is None or at > latest):
                latest = at
        if latest is not None:
            self._clock((records[0].topic, records[0].partition)).appended(latest)

    def _note_reached(self) -> None:
        """Advance every partition's clock by the ends its position has reached: the end
        offsets sampled at start, and the end of the last fetch answered. Called after each
        poll's fold, before anything else runs (aiokafka fetches ahead in the background: a
        later answer, whose records are not handed out yet, would hide this one)."""
        progress = self._consumer.progress()
        for key, target in self._targets.items():
            clock = self._clock(key)
            p = progress.get(key)
            if p is None:
                continue
            clock.reached(self._targets_at, target, p.position, start=True)
            clock.reached(p.fetched_at, p.end, p.position)

    def written_as_of(self) -> float | None:
        """Unix time up to which the workers partition is known read: the latest append read
        there (a broker append time, or the send time of this reader's own probe)."""
        keys = {k for k in self._targets if k[0] == self._workers_topic}
        keys |= {k for k in self._clocks if k[0] == self._workers_topic}
        return view_as_of([self._clock(k).by_append for k in sorted(keys)])

    def _own_probe_sent_at(self, value: bytes) -> float | None:
        """When this reader sent the probe ``value`` (None: another reader's, or not one)."""
        try:
            probe = json.loads(value)
            if probe.get("probe") == self.reader_id:
                return float(probe["sent_at"])
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
        return None

    def current_as_of(self) -> datetime | None:
        """The time up to which this reader knows it has folded everything in the log: None
        before it caught up. Judge liveness at this time, never later: a reader cut off from
        Kafka, or lagging behind it, knows nothing about workers since.

        Per partition, :class:`PartitionClock`: the latest T whose end its position has
        reached (the end offsets sampled at start; the end the last answered fetch, sent at
        T, returned), or the latest append read there; the oldest of the partitions (see the
        module's docstring). It stops advancing while Kafka is unreachable. With probes, the
        workers partition counts only by the appends read there (the latest broker append
        time, or this reader's own probe): it stops advancing while Kafka holds writes back."""
        if not self.caught_up.is_set():
            return None
        self._note_reached()
        return _datetime(
            view_as_of(
                [
                    self._clock(key).as_of(
                        ends_count=not (self.probe and key[0] == self._workers_topic)
                    )
                    for key in sorted(self._targets)
                ]
            )
        )

    def fetched_as_of(self) -> datetime | None:
        """:meth:`current_as_of` by the ends reached alone (sampled at start, or fetched)."""
        if not self.caught_up.is_set():
            return None
        self._note_reached()
        return _datetime(view_as_of([self._clock(key).by_end for key in sorted(self._targets)]))

    def unreachable_since(self) -> datetime | None:
        """When Kafka stopped answering this process (None: it answers)."""
        since = health.unreachable_since
        return None if since is None else datetime.fromtimestamp(since, UTC)

    def _reached_targets(self) -> bool:
        """Caught up: every partition's position is at or past its end offset at start."""
        progress = self._consumer.progress()
        for key, end in self._targets.items():
            if end == 0:
                continue
            p = progress.get(key)
            if p is None or p.position is None or p.position < end:
                return False
        return True


def verify_command(
    verifier: Verifier, command: Command, wire: Mapping[str, Any], *, max_ttl_s: float
) -> None:
    """What a worker with ``verifier``'s store would check of ``command`` (``wire``: its JSON
    object as received) without its clock or filesystem: the signature, the key and its scope
    (kinds, selectors, the reload path's ``path_roots`` lexically), and a TTL of at most
    ``max_ttl_s``. Not EXPIRED nor ISSUED_IN_FUTURE: they depend on when it is read. Raises
    CommandRejected with the code a worker would NACK."""
    verified = verifier.verify(command, wire)
    ttl = (command.expires_at - command.issued_at).total_seconds()
    if ttl > max_ttl_s:
        raise CommandRejected(
            f"command TTL of {ttl:.0f}s (issued_at to expires_at) exceeds max_ttl_s"
            f" ({max_ttl_s:g}s)",
            code=WireCode.TTL_TOO_LONG,
        )
    roots = verified.scope.path_roots
    spec = command.spec
    path = spec.path if isinstance(spec, ReloadWeightsSpec) else None
    if roots is not None and path is not None and not lexically_within(path, roots):
        raise CommandRejected(
            f"key {verified.key_id!r} may not name weights at {path!r}: its scope"
            f" allows only paths under {roots}",
            code=WireCode.SCOPE_DENIED,
        )


def _datetime(at: float | None) -> datetime | None:
    return None if at is None else datetime.fromtimestamp(at, UTC)
