"""Reads the three topics from the beginning and folds them into a :class:`~controlplane.rollout.fleet.Fleet`.

The log is the source of truth: the coordinator and ``controlplane ... --wait`` both rebuild
their state with this, then follow live. No HTTP, no printing; listeners get each folded batch.

While the log is replayed, Python's cyclic garbage collector is off (reference counting still
frees every record and ack as soon as it is folded). A replay allocates millions of short-lived
objects beside a growing fleet, and the collector, triggered by allocation counts, scans that
growing heap again and again: a third of a 300,000-ack replay (docs/benchmarks.md, section 2).
It is switched back on when the replay ends, or when the follower stops.

Catching up and being current are defined by the consumer's positions, never by the records
seen: a partition emptied by retention (log start == end > 0), or whose last offset is a
transaction marker, has no record at ``end - 1`` to read, but the consumer's position still
reaches ``end``. :meth:`Follower.current_as_of` is the time up to which the reader knows it has
folded everything: the time the last fetch was sent, for every partition whose position has
reached the end that fetch returned. It stops advancing while Kafka is unreachable (and while
the reader lags), so liveness judged at that time never counts a silence it could not hear.

A reader that also writes (``probe=True``: the coordinator, ``--wait``, ``status``) knows more:
it appends a small probe record to the workers topic every ``probe_interval_s`` and reads it
back. A record read from the workers partition with broker append time T proves that every
heartbeat appended before T has been read too (one partition, read in order), so with probes
:meth:`Follower.current_as_of` is also never later than the latest such T. When Kafka accepts
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
from collections.abc import Callable, Sequence
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
from controlplane.wire.errors import BusError, LocalCode, ProtocolError
from controlplane.wire.protocol import Command, Heartbeat

log = logging.getLogger(__name__)

#: The key of the readers' probe records on the workers topic: one key for every reader, so
#: compaction keeps one. Never a worker id (ids are identifiers: no NUL). Value: JSON
#: ``{"probe": <reader id>, "sent_at": <unix seconds>}``.
PROBE_KEY: Final = b"\x00probe"


@dataclass
class Batch:
    """What one fetch folded in, in log order per topic."""

    commands: list[Command] = field(default_factory=list)
    #: :class:`~controlplane.wire.ack_codec.FastAck` from the log; anything ack-like from elsewhere.
    acks: list[AckLike] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    #: Records of the controller topic (only with a follower given a ControlState).
    control: list[ControlRecord] = field(default_factory=list)
    undecodable: int = 0
    replay: bool = False

    @property
    def rollout_ids(self) -> set[str]:
        return {c.rollout_id for c in self.commands} | {a.rollout_id for a in self.acks}

    def __bool__(self) -> bool:
        return bool(
            self.commands or self.acks or self.heartbeats or self.control or self.undecodable
        )


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
    ) -> None:
        """``decode_ack``: None, the acks channel's compiled decoder; ``protocol.decode_ack``
        gives the same acks as pydantic models, several times slower. ``probe``: write a probe record to
        the workers topic every ``probe_interval_s`` and judge only up to what was read back
        (see the module's docstring). ``control``: also fold the controller topic into it
        (targets and progressive rollouts); ``control_optional``: when that topic does not
        exist (a fleet whose topics were made before it), follow the rest and say so, instead
        of failing (:attr:`control_missing`)."""
        self.settings = settings
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.reader_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        #: Probes this reader wrote and read back (diagnostics, tests).
        self.probes_sent = 0
        self.probes_read = 0
        #: Unix time up to which the workers partition is known read: the latest broker append
        #: time read there, or the send time of this reader's own probe read back.
        self._written_until: float | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self.fleet = fleet if fleet is not None else Fleet()
        self.topics = settings.topics
        self.caught_up = asyncio.Event()
        self.listeners: list[Listener] = []
        self.records = 0
        self.undecodable = 0
        #: Records whose fold raised something unexpected (logged with topic/partition/offset;
        #: the rest of their fetch is folded all the same).
        self.fold_errors = 0
        self._consumer = Consumer(settings, max_partition_fetch_bytes=4 * 1024 * 1024)
        #: The end offset of each partition when we started: caught up when positions reach them.
        self._targets: dict[tuple[str, int], int] = {}
        #: Per partition, the time (``time.time()``) up to which everything in it was folded.
        self._current: dict[tuple[str, int], float] = {}
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
        }
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
        for name in names:
            for partition, end in (await self._consumer.end_offsets(name)).items():
                self._targets[(name, partition)] = end
        if all(end == 0 for end in self._targets.values()):
            self.caught_up.set()
        elif gc.isenabled():  # (someone else's pause is theirs to end)
            gc.disable()
            self._paused_collector = True
        if self.probe:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="follower-probe")

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
        if not self.caught_up.is_set() and self._reached_targets():
            self.caught_up.set()
            self._resume_collector()
            log.info("caught up with the log: %d records folded", self.records)
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
        self._positions[(topic, partition)] = records[-1].offset + 1
        decode, observe, kind = self._decoders[topic]
        folded: list[Any] = getattr(batch, kind)
        append = folded.append
        heartbeats = kind == "heartbeats"
        if heartbeats:
            self._note_written(records)
        for record in records:
            value = record.value
            if value is None:  # a tombstone on the compacted workers topic
                continue
            if heartbeats and record.key == PROBE_KEY:
                continue
            try:
                message = decode(value)
            except ProtocolError as exc:
                self.undecodable += 1
                batch.undecodable += 1
                log.debug(
                    "skipping undecodable %s record at %s@%d: %s", kind, topic, record.offset, exc
                )
                continue
            except Exception as exc:
                self._fold_failed(topic, partition, record.offset, "decoding", exc)
                continue
            try:
                if heartbeats:
                    observe(message, self._received_at(record, now, batch.replay))
                else:
                    observe(message)
            except Exception as exc:
                self._fold_failed(topic, partition, record.offset, "folding", exc)
                continue
            append(message)

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

    def _note_written(self, records: list[Record]) -> None:
        """Advance the workers partition's known-read time (see ``_written_until``)."""
        latest = self._written_until
        for record in records:
            at: float | None = None
            if record.key == PROBE_KEY and record.value is not None:
                at = self._own_probe_sent_at(record.value)
                if at is not None:
                    self.probes_read += 1
            if record.timestamp_type == LOG_APPEND_TIME and record.timestamp_ms >= 0:
                at = record.timestamp_ms / 1000
            if at is not None and (latest is None or at > latest):
                latest = at
        self._written_until = latest

    def written_as_of(self) -> float | None:
        """Unix time up to which the workers partition is known read: the latest append read
        there (a broker append time, or the send time of this reader's own probe)."""
        return self._written_until

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
        Kafka (or lagging behind it) knows nothing about workers since.

        Per partition, the time the last answered fetch was sent, once the position has reached
        the end that fetch reported; the oldest of them. It stops advancing while Kafka is
        unreachable. With probes, also never later than the workers partition is known read
        (the latest broker append time read there): it stops advancing while Kafka holds
        writes back."""
        as_of = self.fetched_as_of()
        if as_of is None or not self.probe:
            return as_of
        written = self.written_as_of()
        if written is None:
            return None
        return min(as_of, datetime.fromtimestamp(written, UTC))

    def fetched_as_of(self) -> datetime | None:
        """:meth:`current_as_of` by the consumer's fetches alone."""
        if not self.caught_up.is_set():
            return None
        progress = self._consumer.progress()
        oldest: float | None = None
        for key in self._targets:
            p = progress.get(key)
            if (
                p is not None
                and p.position is not None
                and p.end is not None
                and p.fetched_at is not None
                and p.position >= p.end
                and p.fetched_at > self._current.get(key, 0.0)
            ):
                self._current[key] = p.fetched_at
            at = self._current.get(key)
            if at is None:
                return None
            oldest = at if oldest is None else min(oldest, at)
        return None if oldest is None else datetime.fromtimestamp(oldest, UTC)

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
