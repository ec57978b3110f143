"""Reads the three topics from the beginning and folds them into a :class:`~controlplane.rollout.Fleet`.

The log is the source of truth: the coordinator and ``controlplane ... --wait`` both rebuild
their state with this, then follow live. No HTTP, no printing; listeners get each folded batch.

While the log is replayed, Python's cyclic garbage collector is off (reference counting still
frees every record and ack as soon as it is folded). A replay allocates millions of short-lived
objects beside a growing fleet, and the collector, triggered by allocation counts, scans that
growing heap again and again: a third of a 300,000-ack replay (docs/benchmarks.md, section 2).
It is switched back on when the replay ends, or when the follower stops.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import Any

from controlplane.ack_codec import AckLike, decode_ack_fast
from controlplane.bus import Consumer, Record, collector_paused
from controlplane.errors import ProtocolError
from controlplane.lifecycle import AsyncService
from controlplane.protocol import Command, Heartbeat, decode_command, decode_heartbeat, utcnow
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
        self._consumer = Consumer(settings, max_partition_fetch_bytes=4 * 1024 * 1024)
        self._targets: dict[tuple[str, int], int] = {}
        self._positions: dict[tuple[str, int], int] = {}
        self._paused_collector = False  # whether the replay switched the cyclic GC off
        #: topic -> (decode, observe, the Batch list it goes to)
        self._decoders: dict[str, tuple[Callable[[bytes], Any], Callable[[Any], Any], str]] = {
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
        batch = Batch(replay=not self.caught_up.is_set())
        with collector_paused():  # the fold makes no cycles; see bus.collector_paused
            for topic, partition, records in fetched:
                self._fold_partition(batch, topic, partition, records)
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
        for (topic, partition), run in itertools.groupby(records, key=_topic_partition):
            self._fold_partition(batch, topic, partition, list(run))
        return batch

    def _fold_partition(
        self, batch: Batch, topic: str, partition: int, records: list[Record]
    ) -> None:
        """Fold consecutive records of one partition: one topic lookup for all of them."""
        if not records:
            return
        self.records += len(records)
        self._positions[(topic, partition)] = records[-1].offset + 1
        decode, observe, kind = self._decoders[topic]
        folded: list[Any] = getattr(batch, kind)
        append = folded.append
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
            observe(message)
            append(message)

    def current_as_of(self) -> datetime | None:
        """The time up to which this reader knows it has folded everything in the log: None
        before it caught up. Judge liveness at this time, never later (a reader cut off from
        Kafka knows nothing about workers since). (To be refined: the last fetch at the end.)"""
        return utcnow() if self.caught_up.is_set() else None

    def _reached_targets(self) -> bool:
        return all(
            self._positions.get(key, 0) >= end for key, end in self._targets.items() if end > 0
        )
