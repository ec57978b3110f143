"""Reads the three topics from the beginning and folds them into a :class:`~controlplane.rollout.Fleet`.

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
import gc
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

from controlplane.ack_codec import AckLike, decode_ack_fast
from controlplane.bus import LOG_APPEND_TIME, Consumer, Record, collector_paused, health
from controlplane.errors import ProtocolError
from controlplane.lifecycle import AsyncService
from controlplane.protocol import Command, Heartbeat, decode_command, decode_heartbeat
from controlplane.rollout import Fleet
from controlplane.settings import KafkaSettings

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """What one fetch folded in, in log order per topic."""

    commands: list[Command] = field(default_factory=list)
    #: :class:`~controlplane.ack_codec.FastAck` from the log; anything ack-like from elsewhere.
    acks: list[AckLike] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    undecodable: int = 0
    replay: bool = False

    @property
    def rollout_ids(self) -> set[str]:
        return {c.rollout_id for c in self.commands} | {a.rollout_id for a in self.acks}

    def __bool__(self) -> bool:
        return bool(self.commands or self.acks or self.heartbeats or self.undecodable)


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
        decode_ack: AckDecoder = decode_ack_fast,
    ) -> None:
        """``decode_ack``: the compiled decoder by default; ``protocol.decode_ack`` gives the
        same acks as pydantic models, several times slower."""
        self.settings = settings
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
        #: topic -> (decode, observe, the Batch list it goes to)
        self._decoders: dict[str, tuple[Callable[[bytes], Any], Callable[..., Any], str]] = {
            self.topics.commands.name: (decode_command, self.fleet.observe_command, "commands"),
            self.topics.acks.name: (decode_ack, self.fleet.observe_ack, "acks"),
            self.topics.workers.name: (
                decode_heartbeat,
                self.fleet.observe_heartbeat,
                "heartbeats",
            ),
        }

    async def start(self) -> None:
        await self._consumer.start()
        names = [t.name for t in self.topics.all()]
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

    async def stop(self) -> None:
        self._resume_collector()
        await self._consumer.stop()

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
        with collector_paused():  # the fold makes no cycles; see bus.collector_paused
            for topic, partition, records in fetched:
                self._fold_partition(batch, topic, partition, records, now)
        if not self.caught_up.is_set() and self._reached_targets():
            self.caught_up.set()
            self._resume_collector()
            log.info("caught up with the log: %d records folded", self.records)
        if batch:
            for listener in self.listeners:
                listener(batch)
        return batch

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
        for record in records:
            value = record.value
            if value is None:  # a tombstone on the compacted workers topic
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

    def current_as_of(self) -> datetime | None:
        """The time up to which this reader knows it has folded everything in the log: None
        before it caught up. Judge liveness at this time, never later: a reader cut off from
        Kafka (or lagging behind it) knows nothing about workers since.

        Per partition, the time the last answered fetch was sent, once the position has reached
        the end that fetch reported; the oldest of them. It stops advancing while Kafka is
        unreachable."""
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
