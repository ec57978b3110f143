"""The producer: idempotent, acks=all, every send bounded; :class:`Delivery` to wait on again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer

from controlplane.kafka.client import (
    ClientLifecycle,
    Record,
    client_options,
    stop_producer,
    translate,
)
from controlplane.kafka.health import health, log
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode


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
                if self._future.done():  # confirmed already (acks sent in one request)
                    meta = self._future.result()
                else:
                    async with asyncio.timeout(timeout_s):
                        meta = await asyncio.shield(self._future)
            except TimeoutError:
                raise BusError(
                    f"publishing to {self.topic}: not confirmed within {timeout_s:g} s; "
                    "the record may still be written (Kafka unreachable, or fewer in-sync "
                    "replicas than min.insync.replicas?)",
                    code=LocalCode.PUBLISH_OUTCOME_UNKNOWN,
                ) from None
        health.succeeded()
        return Record(self.topic, meta.partition, meta.offset, self.key, self.value, meta.timestamp)


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Producer(ClientLifecycle):
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
        self._finish_bootstrap_when_cancelled(self._producer.client)
        self.stop_timeout_s = stop_timeout_s
        self.disposable = disposable
        #: How long :meth:`send` waits for the cluster to confirm a record.
        self.delivery_timeout_s = settings.delivery_timeout_ms / 1000

    async def _start(self) -> None:
        with translate("starting the producer"):
            await self._producer.start()

    async def _stop(self) -> None:
        await stop_producer(self._producer, self.stop_timeout_s, self._closing_without_pending)

    def _closing_without_pending(self) -> None:
        log.log(
            logging.DEBUG if self.disposable else logging.WARNING,
            "the producer could not deliver its pending records within %g s "
            "(Kafka unreachable?); closing without them",
            self.stop_timeout_s,
        )

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
                    code=LocalCode.BROKER_UNAVAILABLE,
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
