"""The consumer: manual assignment and commits, read_committed, and how far it has read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from controlplane.kafka.client import (
    ClientLifecycle,
    Record,
    being_cancelled,
    client_options,
    collector_paused,
    new_record,
    translate,
)
from controlplane.kafka.health import health
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError

#: How long a topic missing from the metadata is asked for again before it is said not to exist.
MISSING_TOPIC_WAIT_S = 5.0


@dataclass(frozen=True)
class PartitionProgress:
    """How far a consumer has read one partition, and what the broker last said about it."""

    #: The offset of the next record the consumer will hand out (None while it is unknown).
    position: int | None
    #: The end of the readable log (last stable offset under read_committed) in the last
    #: successful fetch response, and the wall-clock time (``time.time()``) that fetch was sent:
    #: everything appended before ``fetched_at`` is below ``end``. None before any response.
    end: int | None
    fetched_at: float | None


class Consumer(ClientLifecycle):
    """A consumer with manual assignment and manual commits (never auto-commit).

    With ``group_id`` the consumer stores its positions in Kafka under that group without
    joining it: no rebalances, no session to lose during a long reload.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str | None = None,
        max_partition_fetch_bytes: int = 2 * 1024 * 1024,
        fetch_max_wait_ms: int = 100,
        fetcher_poll_ms: int = 200,
    ) -> None:
        """``fetcher_poll_ms``: how often aiokafka's background fetcher wakes when nothing
        happens (its ``consumer_timeout_ms``). It wakes anyway when a fetch returns, on a seek,
        an assignment or a metadata change, so a consumer of partitions assigned by hand (no
        rebalances to notice) loses nothing with a longer one, and saves CPU while idle."""
        self._consumer = AIOKafkaConsumer(
            **client_options(settings),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=max_partition_fetch_bytes,
            fetch_max_wait_ms=fetch_max_wait_ms,
            consumer_timeout_ms=fetcher_poll_ms,
            isolation_level="read_committed",
        )
        self._finish_bootstrap_when_cancelled(self._consumer._client)
        self.group_id = group_id
        #: (topic, partition) -> (when the last successful fetch of it was sent, its end then)
        self._fetched: dict[tuple[str, int], tuple[float, int | None]] = {}

    async def _start(self) -> None:
        with translate("starting the consumer"):
            await self._consumer.start()
        health.succeeded()
        self._time_fetches()

    async def _stop(self) -> None:
        try:
            await self._consumer.stop()
        except asyncio.CancelledError:
            if being_cancelled():
                raise
            # Fetcher.close() stopped at the first task it had cancelled: finish its work.
            fetcher = getattr(self._consumer, "_fetcher", None)
            pending = list(getattr(fetcher, "_pending_tasks", ()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._consumer._client.close()

    def _time_fetches(self) -> None:
        """Wrap the fetcher's per-request coroutine to note, per partition, when the last
        successful fetch was *sent* and the end offset it returned. (aiokafka's own
        ``last_poll_timestamp`` is the time the response was handled: after a blocked event
        loop, that is later than what the response can vouch for.)"""
        fetcher = getattr(self._consumer, "_fetcher", None)
        proc: Callable[..., Awaitable[bool]] | None = getattr(fetcher, "_proc_fetch_request", None)
        if fetcher is None or proc is None:  # another aiokafka: progress() falls back
            return
        fetched = self._fetched

        async def timed(assignment: Any, node_id: int, request: Any) -> bool:
            sent = time.time()
            result = await proc(assignment, node_id, request)
            answered = False
            sent_ms = int(sent * 1000)
            for topic, partitions in request.topics:
                for item in partitions:
                    tp = TopicPartition(topic, item[0])
                    state = assignment.state_value(tp)
                    if state is None or state.timestamp is None or state.timestamp < sent_ms:
                        continue  # no answer for it from this request
                    answered = True
                    fetched[(topic, item[0])] = (sent, _readable_end(state))
            if answered:
                health.succeeded()
            return bool(result)

        fetcher._proc_fetch_request = timed

    def progress(self) -> dict[tuple[str, int], PartitionProgress]:
        """Per assigned partition: position, and the end and time of the last fetch answered."""
        subscription = getattr(self._consumer._subscription, "subscription", None)
        assignment = getattr(subscription, "assignment", None)
        if assignment is None:
            return {}
        out: dict[tuple[str, int], PartitionProgress] = {}
        for tp in assignment.tps:
            state = assignment.state_value(tp)
            if state is None:
                continue
            key = (tp.topic, tp.partition)
            position = state.position if state.has_valid_position else None
            if key in self._fetched:
                fetched_at, end = self._fetched[key]
            elif state.timestamp is not None:  # without the wrapper: the time it was handled
                fetched_at, end = state.timestamp / 1000, _readable_end(state)
            else:
                fetched_at, end = None, None
            out[key] = PartitionProgress(position=position, end=end, fetched_at=fetched_at)
        return out

    async def partitions(self, topic: str, *, wait_s: float = MISSING_TOPIC_WAIT_S) -> list[int]:
        """The topic's partitions. A topic just created reaches every broker's metadata a
        moment later (on a cluster, the broker asked may not know it yet): asked again for up
        to ``wait_s`` before it is said not to exist."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            with translate(f"reading metadata of {topic}"):
                parts = self._consumer.partitions_for_topic(topic)
                if parts is None:
                    await self._consumer._client.force_metadata_update()
                    parts = self._consumer.partitions_for_topic(topic)
            if parts:
                return sorted(parts)
            if loop.time() >= deadline:
                raise BusError(f"topic {topic} does not exist; run `controlplane topics ensure`")
            await asyncio.sleep(0.25)  # a retry delay (the metadata of a new topic spreading)

    async def assign(self, topic: str, partitions: Sequence[int] | None = None) -> list[int]:
        parts = list(partitions) if partitions is not None else await self.partitions(topic)
        with translate(f"assigning {topic}"):
            self._consumer.assign([TopicPartition(topic, p) for p in parts])
        return parts

    async def assign_many(self, topics: Sequence[str]) -> None:
        tps = [TopicPartition(t, p) for t in topics for p in await self.partitions(t)]
        with translate("assigning topics"):
            self._consumer.assign(tps)

    async def seek_to_beginning(self) -> None:
        with translate("seeking to the beginning"):
            await self._consumer.seek_to_beginning()

    def seek(self, topic: str, partition: int, offset: int) -> None:
        with translate(f"seeking {topic}[{partition}]"):
            self._consumer.seek(TopicPartition(topic, partition), offset)

    async def committed(self, topic: str, partition: int) -> int | None:
        with translate(f"reading committed offset of {topic}[{partition}]"):
            off = await self._consumer.committed(TopicPartition(topic, partition))
        return None if off is None or off < 0 else int(off)

    async def commit(self, topic: str, partition: int, next_offset: int) -> None:
        """Store ``next_offset`` (the offset of the next record to read) for the group."""
        with translate(f"committing {topic}[{partition}]@{next_offset}"):
            await self._consumer.commit(
                {TopicPartition(topic, partition): OffsetAndMetadata(next_offset, "")}
            )

    async def end_offsets(self, topic: str) -> dict[int, int]:
        parts = await self.partitions(topic)
        with translate(f"reading end offsets of {topic}"):
            res = await self._consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in res.items()}

    async def beginning_offsets(self, topic: str) -> dict[int, int]:
        parts = await self.partitions(topic)
        with translate(f"reading beginning offsets of {topic}"):
            res = await self._consumer.beginning_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in res.items()}

    async def offsets_for_times(self, topic: str, at_ms: int) -> dict[int, int]:
        """Per partition of ``topic``, the earliest offset whose record timestamp is at or
        after ``at_ms`` (Unix milliseconds); a partition with none: its end offset (every
        record it holds is older)."""
        parts = await self.partitions(topic)
        tps = [TopicPartition(topic, p) for p in parts]
        with translate(f"reading offsets of {topic} by time"):
            found = await self._consumer.offsets_for_times(dict.fromkeys(tps, at_ms))
            ends = await self._consumer.end_offsets(tps)
        out: dict[int, int] = {}
        for tp in tps:
            hit = found.get(tp)
            out[tp.partition] = hit.offset if hit is not None else ends[tp]
        return out

    async def fetch(
        self, *, timeout_s: float = 1.0, max_records: int | None = None
    ) -> list[Record]:
        """Up to ``max_records`` records (possibly none), in order within each partition."""
        out: list[Record] = []
        for _, _, records in await self.fetch_partitions(
            timeout_s=timeout_s, max_records=max_records
        ):
            out.extend(records)
        return out

    async def fetch_partitions(
        self, *, timeout_s: float = 1.0, max_records: int | None = None
    ) -> list[tuple[str, int, list[Record]]]:
        """Like :meth:`fetch`, grouped: (topic, partition, its records in order) per partition
        that had any, so that a reader can handle a topic's records without a lookup per record."""
        with translate("fetching"):
            batches = await self._consumer.getmany(
                timeout_ms=int(timeout_s * 1000), max_records=max_records
            )
        out: list[tuple[str, int, list[Record]]] = []
        with collector_paused():
            for tp, msgs in batches.items():
                topic, partition = tp.topic, tp.partition
                out.append(
                    (
                        topic,
                        partition,
                        [
                            new_record(
                                (
                                    topic,
                                    partition,
                                    m.offset,
                                    m.key,
                                    m.value,
                                    m.timestamp,
                                    m.timestamp_type,
                                )
                            )
                            for m in msgs
                        ],
                    )
                )
        return out


def _readable_end(state: Any) -> int | None:
    """The end a read_committed consumer can reach: the last stable offset when the broker
    sends one, else the high watermark."""
    lso = getattr(state, "lso", None)
    if isinstance(lso, int) and lso >= 0:
        return lso
    highwater = getattr(state, "highwater", None)
    return highwater if isinstance(highwater, int) else None
