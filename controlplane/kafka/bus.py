"""The Kafka seam: the only module that imports aiokafka.

Producers, consumers and topic administration over our own types (:class:`Record`,
:class:`~controlplane.wire.topics.Topics`) and our own errors: every aiokafka exception is translated
here, once, into a :class:`~controlplane.wire.errors.BusError`. Nothing above this module sees aiokafka.

Kafka's reachability is one state per process (:data:`health`): aiokafka logs every failed
connection attempt, fetch and metadata refresh (about 70 ERROR lines a second during an outage),
so a filter on its loggers drops those and logs one line when the state changes ("Kafka
unreachable: ...", "Kafka reachable again after N s"). A successful fetch, produce or admin
request is what makes Kafka reachable again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import OffsetAndMetadata

from controlplane.kafka.lifecycle import AsyncService
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, ErrorCode, TopicMismatch
from controlplane.wire.topics import Topics, TopicSpec

log = logging.getLogger(__name__)

R = TypeVar("R")

#: ConsumerRecord.timestamp_type of a record stamped by the broker (topic config
#: ``message.timestamp.type=LogAppendTime``); 0 is CreateTime (the producer's clock).
LOG_APPEND_TIME = 1


class Record(NamedTuple):
    """One consumed or produced record. A tuple: the coordinator makes one per record it reads,
    about a million on a catch-up, and a frozen dataclass costs several times more to build."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    #: 1 (:data:`LOG_APPEND_TIME`): ``timestamp_ms`` is the broker's clock when it appended the
    #: record; 0: the producer's own (CreateTime).
    timestamp_type: int = 0


#: ``Record(*fields)`` without the Python-level ``__new__`` of a NamedTuple: this is a C call.
_new_record: Callable[[tuple[str, int, int, bytes | None, bytes | None, int, int]], Record] = (
    functools.partial(tuple.__new__, Record)
)


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


@dataclass(frozen=True)
class EnsureReport:
    created: list[str]
    existing: list[str]
    #: What the created topics got and the existing ones were checked against.
    replication_factor: int | None = None
    min_insync_replicas: int | None = None


@dataclass(frozen=True)
class ClusterInfo:
    bootstrap: str
    brokers: int
    controller_id: int | None
    cluster_id: str | None


class KafkaHealth:
    """Whether this process can reach Kafka: one state, changed by what its clients see.

    Kafka is unreachable once failures have gone on for ``grace_s`` without a success between
    them (a broker closing its connections as it shuts down, then answering once more, is no
    outage yet); one line is logged when that happens and one when a request succeeds again.
    ``unreachable_since`` (a ``time.time()``: the first failure) is None while reachable.
    """

    def __init__(self, *, grace_s: float = 1.0) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self.unreachable_since: float | None = None
        #: Why, in aiokafka's words, the first time it failed.
        self.reason = ""
        #: No log lines (for a caller that reports outages in its own words, as `--wait` does).
        self.quiet = False

    @property
    def reachable(self) -> bool:
        return self.unreachable_since is None

    def failed(self, reason: str) -> None:
        now = time.time()
        with self._lock:
            if self.unreachable_since is not None:
                return
            if self._failing_since is None:
                self._failing_since, self.reason = now, reason
                return
            if now - self._failing_since < self.grace_s:
                return
            self.unreachable_since = self._failing_since
            reason = self.reason
        if not self.quiet:
            log.warning("Kafka unreachable: %s", reason)

    def succeeded(self) -> None:
        if self._failing_since is None:  # the common case: no lock
            return
        with self._lock:
            since, self.unreachable_since = self.unreachable_since, None
            self._failing_since = None
        if since is not None and not self.quiet:
            log.warning("Kafka reachable again after %.0f s", time.time() - since)


#: The process's view of Kafka (every client of this module reports to it).
health = KafkaHealth()

#: Exceptions in an aiokafka log record's arguments that mean "could not reach the broker".
_CONNECTION_ERRORS = (
    KafkaConnectionError,
    NodeNotReadyError,
    RequestTimedOutError,
    KafkaTimeoutError,
    OSError,
    TimeoutError,
)
#: aiokafka's own messages (format strings) for the same.
_CONNECTION_MESSAGES = (
    "Unable connect to",
    "Unable to update metadata from",
    "Unable to request metadata from",
)
#: The loggers aiokafka writes to (a filter applies only to records logged on its own logger).
_AIOKAFKA_LOGGERS = (
    "aiokafka",
    "aiokafka.conn",
    "aiokafka.cluster",
    "aiokafka.consumer.consumer",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
    "aiokafka.producer.producer",
    "aiokafka.producer.sender",
    "aiokafka.admin.client",
)


class ConnectionLogFilter(logging.Filter):
    """Drops aiokafka's per-retry connection failures and turns them into :data:`health` state.

    Other records pass, except that a message (by its format string) repeated within
    ``repeat_s`` is dropped: a retry loop logs one line per ``repeat_s``, not one per retry.
    """

    def __init__(self, state: KafkaHealth, *, repeat_s: float = 60.0) -> None:
        super().__init__()
        self.state = state
        self.repeat_s = repeat_s
        self.dropped = 0
        self._last: dict[tuple[str, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if _is_connection_failure(record):
            self.dropped += 1
            self.state.failed(_one_line(record))
            return False
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.repeat_s:
            self.dropped += 1
            return False
        if len(self._last) > 1000:  # bounded: messages are format strings, but be safe
            self._last.clear()
        self._last[key] = now
        return True


def _is_connection_failure(record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    if msg.startswith(_CONNECTION_MESSAGES):
        return True
    args = record.args if isinstance(record.args, tuple) else ()
    return any(isinstance(a, _CONNECTION_ERRORS) for a in args)


def _one_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # a record that does not format: still one line
        text = str(record.msg)
    return " ".join(text.split())[:300]


def install_log_filter() -> ConnectionLogFilter:
    """Put the (one) :class:`ConnectionLogFilter` on aiokafka's loggers; idempotent."""
    for name in _AIOKAFKA_LOGGERS:
        for existing in logging.getLogger(name).filters:
            if isinstance(existing, ConnectionLogFilter):
                return existing
    log_filter = ConnectionLogFilter(health)
    for name in _AIOKAFKA_LOGGERS:
        logging.getLogger(name).addFilter(log_filter)
    return log_filter


log_filter = install_log_filter()


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block; only for synchronous code (no await).

    For code that builds or folds a fetch's records: they make no reference cycles, but a
    collection triggered meanwhile finds tens of thousands of them alive, promotes them to the
    oldest generation and so sets off full collections of the whole heap (on a 300,000-ack
    catch-up: 16 full collections, half its time). After the block they are freed by reference
    counting and the collector resumes with nothing to promote.
    """
    if not gc.isenabled():  # someone else's pause: theirs to end
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def translate(what: str) -> Iterator[None]:
    """Turn aiokafka's exceptions into ours. ``what`` says what we were doing."""
    try:
        yield
    except BusError:
        raise
    except (KafkaConnectionError, KafkaTimeoutError) as exc:
        health.failed(f"{what}: {exc}")
        raise BusError(
            f"{what}: Kafka unreachable: {exc}", code=ErrorCode.BROKER_UNAVAILABLE
        ) from exc
    except KafkaError as exc:
        retryable = bool(getattr(exc, "retriable", False))
        code = ErrorCode.BROKER_UNAVAILABLE if retryable else ErrorCode.KAFKA_ERROR
        raise BusError(f"{what}: {type(exc).__name__}: {exc}", code=code) from exc
    except TimeoutError as exc:
        health.failed(f"{what}: timed out")
        raise BusError(f"{what}: timed out", code=ErrorCode.BROKER_UNAVAILABLE) from exc


def client_options(settings: KafkaSettings) -> dict[str, Any]:
    """Connection and security options shared by every aiokafka client (TLS/SASL pass through)."""
    opts: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "client_id": settings.client_id,
        "request_timeout_ms": settings.request_timeout_ms,
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        opts["ssl_context"] = create_ssl_context(
            cafile=settings.ssl_cafile, certfile=settings.ssl_certfile, keyfile=settings.ssl_keyfile
        )
    if settings.sasl_mechanism is not None:
        opts["sasl_mechanism"] = settings.sasl_mechanism
        opts["sasl_plain_username"] = settings.sasl_username
        if settings.sasl_password is not None:
            opts["sasl_plain_password"] = settings.sasl_password.get_secret_value()
    return opts


class _Lifecycle(AsyncService):
    """start()/stop() with a null state: stop() works after a failed start() and twice."""

    _started = False
    _closed = False

    async def start(self) -> None:
        if self._closed:
            raise BusError(f"{type(self).__name__} was stopped and cannot be reused")
        if self._started:
            return
        await self._start()
        self._started = True

    async def stop(self) -> None:
        """Never raises, except our own task's cancellation: aiokafka's close() awaits tasks it
        cancelled and lets their CancelledError out (seen when Kafka was down)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop()
        except asyncio.CancelledError:
            if _being_cancelled():
                raise
        except Exception as exc:
            log.debug("stopping %s: %s", type(self).__name__, exc)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError


class Delivery:
    """One record handed to the producer, until the cluster confirms it.

    :meth:`wait` may be called again after it timed out: the idempotent producer keeps the
    record and retries it (never twice in the log), so a caller that must not lose it (the
    worker's acks) waits on until it is confirmed, instead of sending a second copy.
    """

    __slots__ = ("_future", "key", "topic", "value")

    def __init__(
        self, topic: str, key: bytes | None, value: bytes | None, future: asyncio.Future[Any]
    ) -> None:
        self.topic, self.key, self.value = topic, key, value
        self._future = future
        # A delivery nobody waits for any more must not log "exception was never retrieved".
        future.add_done_callback(_retrieve_exception)

    @property
    def done(self) -> bool:
        return self._future.done()

    async def wait(self, timeout_s: float) -> Record:
        """The record's place in the log once the cluster has it. PUBLISH_OUTCOME_UNKNOWN when
        that takes longer than ``timeout_s`` (the record stays queued; wait again or give up);
        a coded BusError when the producer gave up on it (then it was not written)."""
        with translate(f"publishing to {self.topic}"):
            try:
                async with asyncio.timeout(timeout_s):
                    meta = await asyncio.shield(self._future)
            except TimeoutError:
                raise BusError(
                    f"publishing to {self.topic}: not confirmed within {timeout_s:g} s; "
                    "the record may still be written (Kafka unreachable, or fewer in-sync "
                    "replicas than min.insync.replicas?)",
                    code=ErrorCode.PUBLISH_OUTCOME_UNKNOWN,
                ) from None
        health.succeeded()
        return Record(self.topic, meta.partition, meta.offset, self.key, self.value, meta.timestamp)


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Producer(_Lifecycle):
    """An idempotent producer with acks=all: commands and acks must not be lost or duplicated."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        linger_ms: int = 0,
        stop_timeout_s: float = 5.0,
        disposable: bool = False,
    ) -> None:
        """``disposable``: its records may be dropped at stop without a word (probes).
        ``stop_timeout_s``: how long stop() may spend delivering records still pending (every
        send here waits for its delivery, so those are records whose send already failed or was
        cancelled); with Kafka down, aiokafka's own stop() would wait for ever."""
        self._producer = AIOKafkaProducer(
            **client_options(settings),
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_request_size=2 * 1024 * 1024,
        )
        self.stop_timeout_s = stop_timeout_s
        self.disposable = disposable
        #: How long :meth:`send` waits for the cluster to confirm a record.
        self.delivery_timeout_s = settings.delivery_timeout_ms / 1000

    async def _start(self) -> None:
        with translate("starting the producer"):
            await self._producer.start()

    async def _stop(self) -> None:
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                await self._producer.stop()
            return
        except TimeoutError:
            log.log(
                logging.DEBUG if self.disposable else logging.WARNING,
                "the producer could not deliver its pending records within %g s "
                "(Kafka unreachable?); closing without them",
                self.stop_timeout_s,
            )
        sender = getattr(self._producer, "_sender", None)
        if sender is not None:
            with contextlib.suppress(Exception):
                await sender.close()
        await self._producer.client.close()

    async def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Record:
        """Publish one record and wait until the cluster has it. Returns where it landed.

        Bounded by ``timeout_s`` (default: the delivery timeout): BROKER_UNAVAILABLE when the
        record could not even be handed to the producer (no metadata for the topic: certainly
        not published), PUBLISH_OUTCOME_UNKNOWN when it was handed over but not confirmed
        (it may still be written: see :class:`Delivery`)."""
        limit = self.delivery_timeout_s if timeout_s is None else timeout_s
        deadline = asyncio.get_running_loop().time() + limit
        delivery = await self.submit(topic, value, key=key, timeout_s=limit)
        return await delivery.wait(max(0.0, deadline - asyncio.get_running_loop().time()))

    async def submit(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Delivery:
        """Hand one record to the producer; returns its :class:`Delivery` to wait on.

        BROKER_UNAVAILABLE when that does not happen within ``timeout_s`` (default: the
        delivery timeout): the record was not queued, so it will never be written."""
        limit = self.delivery_timeout_s if timeout_s is None else timeout_s
        with translate(f"publishing to {topic}"):
            try:
                async with asyncio.timeout(limit):
                    future = await self._producer.send(topic, value=value, key=key)
            except TimeoutError:
                health.failed(f"publishing to {topic}: no metadata within {limit:g} s")
                raise BusError(
                    f"publishing to {topic}: Kafka did not describe the topic within {limit:g} s "
                    "(unreachable?); nothing was published",
                    code=ErrorCode.BROKER_UNAVAILABLE,
                ) from None
        return Delivery(topic, key, value, future)

    async def send_many(
        self,
        topic: str,
        items: Sequence[tuple[bytes | None, bytes | None]],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Publish (key, value) pairs concurrently and wait for all; for bulk writers. Bounded
        as :meth:`send` is (PUBLISH_OUTCOME_UNKNOWN: some may still be written)."""
        limit = self.delivery_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        deliveries = await self.submit_many(topic, items, timeout_s=limit)
        for delivery in deliveries:
            await delivery.wait(max(0.0, deadline - loop.time()))

    async def submit_many(
        self,
        topic: str,
        items: Sequence[tuple[bytes | None, bytes | None]],
        *,
        timeout_s: float | None = None,
    ) -> list[Delivery]:
        """Hand (key, value) pairs to the producer in this order (one request when they fit);
        their deliveries, to wait on. BROKER_UNAVAILABLE as in :meth:`submit`."""
        limit = self.delivery_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        return [
            await self.submit(topic, v, key=k, timeout_s=max(0.001, deadline - loop.time()))
            for k, v in items
        ]

    async def flush(self) -> None:
        with translate("flushing the producer"):
            await self._producer.flush()


class Consumer(_Lifecycle):
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
    ) -> None:
        self._consumer = AIOKafkaConsumer(
            **client_options(settings),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=max_partition_fetch_bytes,
            fetch_max_wait_ms=fetch_max_wait_ms,
            isolation_level="read_committed",
        )
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
            if _being_cancelled():
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

    async def partitions(self, topic: str) -> list[int]:
        with translate(f"reading metadata of {topic}"):
            parts = self._consumer.partitions_for_topic(topic)
            if parts is None:
                await self._consumer._client.force_metadata_update()
                parts = self._consumer.partitions_for_topic(topic)
        if not parts:
            raise BusError(f"topic {topic} does not exist; run `controlplane topics ensure`")
        return sorted(parts)

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
                            _new_record(
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


class Admin(_Lifecycle):
    def __init__(self, settings: KafkaSettings) -> None:
        self._admin = AIOKafkaAdminClient(**client_options(settings))
        #: How long a request is tried again while a broker is unavailable.
        self._retry_s = settings.request_timeout_ms / 1000

    async def _start(self) -> None:
        with translate("connecting the admin client"):
            await self._admin.start()
        health.succeeded()

    async def _stop(self) -> None:
        await self._admin.close()

    async def _retrying(self, what: str, call: Callable[[], Awaitable[R]]) -> R:
        """``call()``, tried again for up to the request timeout while Kafka is unavailable.

        A broker that died stays in the cluster's metadata until the cluster fences it (about
        9 s), and aiokafka sends an admin request to a random broker, or to the cached
        controller, where it waits for a connection for the whole request timeout: one dead node
        of three must not fail ``topics ensure``. So each attempt has at most a few seconds, and
        each retry refreshes the metadata first. (A create that timed out after it was sent is
        answered TOPIC_ALREADY_EXISTS when tried again.)
        """
        deadline = time.monotonic() + self._retry_s
        attempt_s = min(5.0, self._retry_s)
        failed = False
        while True:
            try:
                with translate(what):
                    async with asyncio.timeout(attempt_s):
                        result = await call()
            except BusError as exc:
                if exc.code is not ErrorCode.BROKER_UNAVAILABLE or time.monotonic() >= deadline:
                    raise
                failed = True
            else:
                if failed:
                    health.succeeded()
                return result
            with contextlib.suppress(KafkaError, OSError, TimeoutError):
                await self._admin._client.force_metadata_update()
            await asyncio.sleep(0.25)

    async def ensure_topics(self, topics: Topics) -> EnsureReport:
        """Create missing topics; verify existing ones. Idempotent; raises TopicMismatch.

        A replication factor of None is the cluster's ``default.replication.factor`` (read from
        a broker); the topics are created with it and existing ones are checked against it, as
        are their partitions and configs (``min.insync.replicas`` included). A factor the
        cluster cannot give (more replicas than brokers) is a :class:`BusError` with the
        broker's own words.
        """
        if topics.replication_factor is None:
            topics = topics.resolved(await self._default_replication_factor())
        rf = topics.replication_factor
        assert rf is not None  # resolved above
        min_isr = topics.effective_min_insync_replicas
        if min_isr is not None and min_isr > rf:
            raise BusError(
                f"min.insync.replicas {min_isr} exceeds the replication factor {rf}: "
                "no write to these topics could ever be acknowledged",
                code=ErrorCode.SETTINGS_INVALID,
            )
        specs = topics.all()
        existing = set(await self._retrying("listing topics", self._admin.list_topics))
        missing = [s for s in specs if s.name not in existing]
        if missing:
            new_topics = [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    replication_factor=rf,
                    topic_configs=dict(s.config),
                )
                for s in missing
            ]
            # Tried again only when it was not answered: then a topic it did create comes
            # back as TOPIC_ALREADY_EXISTS and is checked like any existing one.
            resp = await self._retrying(
                "creating topics", lambda: self._admin.create_topics(new_topics)
            )
            failures: list[str] = []
            for name, code, message in _topic_errors(resp):
                if code == 36:  # TOPIC_ALREADY_EXISTS: listed late, or a concurrent creator won
                    existing.add(name)
                elif code != 0:
                    failures.append(f"{name}: {_kafka_error_name(code)}: {message or ''}".strip())
            if failures:
                # INVALID_REPLICATION_FACTOR (38, e.g. more replicas than brokers) and
                # INVALID_CONFIG (40) are settings the cluster cannot honour.
                raise BusError(
                    f"creating topics with replication factor {rf} failed:\n  "
                    + "\n  ".join(failures),
                    code=ErrorCode.SETTINGS_INVALID
                    if {c for _, c, _ in _topic_errors(resp)} & {38, 40}
                    else ErrorCode.KAFKA_ERROR,
                )
        # Whatever we did not create ourselves is checked against what we need.
        present = [s for s in specs if s.name in existing]
        missing = [s for s in missing if s.name not in existing]
        differences = await self._differences(present) if present else []
        if differences:
            hints = []
            if any("=" in d for d in differences):
                hints.append(
                    "a config can be changed in place: kafka-configs.sh --bootstrap-server "
                    "HOST:PORT --alter --entity-type topics --entity-name TOPIC "
                    "--add-config KEY=VALUE"
                )
            if any("replication factor" in d for d in differences):
                hints.append(
                    "a replication factor is changed by reassigning the partitions "
                    "(kafka-reassign-partitions.sh --bootstrap-server HOST:PORT "
                    "--reassignment-json-file FILE --execute), or by recreating the topic"
                )
            raise TopicMismatch(
                "existing topics differ from what this version needs:\n  "
                + "\n  ".join(differences)
                + "".join(f"\n  {h}" for h in hints),
                differences=differences,
            )
        return EnsureReport(
            created=[s.name for s in missing],
            existing=[s.name for s in present],
            replication_factor=rf,
            min_insync_replicas=min_isr,
        )

    async def _default_replication_factor(self) -> int:
        """The cluster's ``default.replication.factor``, as one of its brokers reports it."""
        key = "default.replication.factor"
        attempt = 0

        async def ask() -> list[Any]:
            nonlocal attempt
            cluster = await self._admin.describe_cluster()
            brokers = sorted(b["node_id"] for b in cluster.get("brokers", []))
            if not brokers:
                raise BusError("the cluster reports no brokers", code=ErrorCode.BROKER_UNAVAILABLE)
            # Another broker on each attempt: the one asked may be dead and not fenced yet.
            broker = brokers[attempt % len(brokers)]
            attempt += 1
            resource = ConfigResource(ConfigResourceType.BROKER, str(broker), {key: None})
            return list(await self._admin.describe_configs([resource]))

        configs = await self._retrying("reading the cluster's default replication factor", ask)
        for resp in configs:
            for resource in resp.resources:
                error_code, error_message, name, entries = (
                    resource[0],
                    resource[1],
                    resource[3],
                    resource[4],
                )
                if error_code != 0:
                    raise BusError(
                        f"reading {key} of broker {name}: "
                        f"{_kafka_error_name(error_code)}: {error_message or ''}".strip()
                        + "; a replication factor set explicitly needs no such read"
                    )
                for entry in entries or []:
                    if entry[0] == key and entry[1] is not None:
                        return int(entry[1])
        raise BusError(f"the cluster did not report {key}")

    async def _differences(self, specs: list[TopicSpec]) -> list[str]:
        # A topic created a moment ago (by someone else) may not be described yet: no partitions,
        # no configs. Wait for it briefly rather than report a mismatch that is not there.
        for _ in range(40):
            partitions, actual_cfg = await self._describe(specs)
            if all(partitions.get(s.name) and s.name in actual_cfg for s in specs):
                break
            await asyncio.sleep(0.25)
        diffs: list[str] = []
        for s in specs:
            replicas = partitions.get(s.name)
            if replicas and len(replicas) != s.partitions:
                diffs.append(f"{s.name}: {len(replicas)} partitions, expected {s.partitions}")
            if replicas and s.replication_factor is not None:
                # The weakest partition is what a broker's loss can cost.
                have_rf = min(replicas)
                if have_rf != s.replication_factor or max(replicas) != s.replication_factor:
                    have = (
                        str(have_rf)
                        if have_rf == max(replicas)
                        else f"{have_rf} to {max(replicas)}"
                    )
                    diffs.append(
                        f"{s.name}: replication factor {have}, expected {s.replication_factor}"
                    )
            for key, want in s.config.items():
                got = actual_cfg.get(s.name, {}).get(key)
                if got != want:
                    diffs.append(f"{s.name}: {key}={got}, expected {want}")
        return diffs

    async def _describe(
        self, specs: list[TopicSpec]
    ) -> tuple[dict[str, list[int]], dict[str, dict[str, str]]]:
        """Per topic: the replica count of each of its partitions, and its configs."""
        names = [s.name for s in specs]
        described = await self._retrying(
            "describing topics", lambda: self._admin.describe_topics(names)
        )
        configs = await self._retrying(
            "describing topic configs",
            lambda: self._admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
            ),
        )
        partitions = {d["topic"]: [len(p["replicas"]) for p in d["partitions"]] for d in described}
        actual_cfg: dict[str, dict[str, str]] = {}
        for resp in configs:
            for resource in resp.resources:
                # (error_code, error_message, resource_type, resource_name, config_entries)
                error_code, name, entries = resource[0], resource[3], resource[4]
                if error_code == 0 and entries:
                    actual_cfg[name] = {e[0]: e[1] for e in entries}
        return partitions, actual_cfg


def _readable_end(state: Any) -> int | None:
    """The end a read_committed consumer can reach: the last stable offset when the broker
    sends one, else the high watermark."""
    lso = getattr(state, "lso", None)
    if isinstance(lso, int) and lso >= 0:
        return lso
    highwater = getattr(state, "highwater", None)
    return highwater if isinstance(highwater, int) else None


def _kafka_error_name(code: int) -> str:
    """``INVALID_REPLICATION_FACTOR (38)``: the protocol's name of an error code, and the code."""
    name = getattr(for_code(code), "message", None)
    return f"{name} ({code})" if isinstance(name, str) and name else f"error {code}"


def _topic_errors(resp: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for item in resp.topic_errors:
        name, code = item[0], item[1]
        message = item[2] if len(item) > 2 else None
        out.append((name, code, message))
    return out


async def probe(bootstrap: str, *, timeout: float = 10.0) -> ClusterInfo:
    """Ask the cluster for its metadata: proof that it is up and serving."""
    settings = KafkaSettings(
        bootstrap_servers=bootstrap, request_timeout_ms=max(1000, int(timeout * 1000))
    )
    admin = Admin(settings)
    try:
        async with asyncio.timeout(timeout):
            await admin.start()
            with translate("describing the cluster"):
                info = await admin._admin.describe_cluster()
    except TimeoutError:
        raise BusError(
            f"no metadata from {bootstrap} within {timeout}s", code=ErrorCode.BROKER_UNAVAILABLE
        ) from None
    finally:
        await admin.stop()
    return ClusterInfo(
        bootstrap=bootstrap,
        brokers=len(info.get("brokers", [])),
        controller_id=info.get("controller_id"),
        cluster_id=info.get("cluster_id"),
    )


def probe_sync(bootstrap: str, *, timeout: float = 10.0) -> ClusterInfo:
    return asyncio.run(probe(bootstrap, timeout=timeout))
