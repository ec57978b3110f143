"""A transactional producer with a fixed ``transactional.id``: the controller's only way to write.

Kafka's transaction coordinator serializes one transactional id: :meth:`TransactionalProducer.start`
(InitProducerId) completes or aborts whatever an older holder of the id left open and bumps the
epoch, so from then on every write of an older holder is refused (``ProducerFenced``) and none of
its records reaches a ``read_committed`` reader. See docs/controller.md.

One transaction is one decision, milliseconds long::

    async with producer.transaction() as txn:
        txn.send(topic, value, key=key)   # collected, not sent yet
    txn.records                           # where each record landed, once committed

The body only collects records; the transaction is begun, sent, awaited record by record and
committed at the end of the block, all under one timeout, so nothing but Kafka is ever awaited
while it is open (an open transaction holds the last stable offset of its partitions, and so
every ``read_committed`` reader of them). A producer that was fenced (:attr:`TxnState.FENCED`) or
whose commit has an unknown outcome (:attr:`TxnState.UNKNOWN`) is closed and never used again:
the caller makes a new one (its init completes or aborts the unknown transaction) once it leads
again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidProducerEpoch,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)

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

#: aiokafka's errors that mean "another producer holds this transactional id now" (an init by a
#: newer holder, or the broker aborting our transaction on its timeout, bumped the epoch).
_FENCING_ERRORS = (ProducerFenced, InvalidProducerEpoch, TransactionalIdAuthorizationFailed)


class TxnState(StrEnum):
    NEW = "new"
    #: Initialized (every older holder of the id fenced); may run transactions.
    READY = "ready"
    #: A newer holder of the id fenced this one: nothing more it writes can commit.
    FENCED = "fenced"
    #: A transaction failed or did not end within its timeout: it may still commit or abort
    #: (aiokafka retries EndTxn on its own). A new producer's init settles it.
    UNKNOWN = "unknown"
    #: Stopped.
    CLOSED = "closed"


class TransactionFenced(BusError):
    """This producer's transactional id was taken over: it may never write again
    (CONTROLLER_FENCED: the producer is the controller's)."""


class TransactionOutcomeUnknown(BusError):
    """A transaction failed or did not end in time: it may or may not be committed."""

    default_code = LocalCode.PUBLISH_OUTCOME_UNKNOWN


class Transaction:
    """The records of one transaction, collected by :meth:`send` and written when the block ends."""

    __slots__ = ("pending", "records")

    def __init__(self) -> None:
        #: (topic, key, value) in the order given to :meth:`send`.
        self.pending: list[tuple[str, bytes | None, bytes | None]] = []
        #: Where each record landed, in the order sent; filled in once the transaction committed.
        self.records: list[Record] = []

    def send(self, topic: str, value: bytes | None, *, key: bytes | None = None) -> None:
        self.pending.append((topic, key, value))


class TransactionalProducer(ClientLifecycle):
    """acks=all, idempotent (both implied by a transactional id), one transaction at a time."""

    def __init__(
        self,
        settings: KafkaSettings,
        transactional_id: str,
        *,
        transaction_timeout_ms: int = 15_000,
        timeout_s: float | None = None,
        stop_timeout_s: float = 5.0,
    ) -> None:
        """``transaction_timeout_ms``: how long the broker lets a transaction of ours stay open
        before it aborts it (and so fences us): it bounds how long a crashed holder stalls the
        readers when nobody takes over. ``timeout_s`` bounds one whole transaction here
        (default: two thirds of the transaction timeout); past it the outcome is unknown."""
        if timeout_s is None:
            timeout_s = transaction_timeout_ms / 1000 * 2 / 3
        self.transactional_id = transactional_id
        self.timeout_s = timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.init_timeout_s = settings.request_timeout_ms / 1000
        self._producer = AIOKafkaProducer(
            **client_options(settings),
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id,
            transaction_timeout_ms=transaction_timeout_ms,
            max_request_size=2 * 1024 * 1024,
        )
        self._finish_bootstrap_when_cancelled(self._producer.client)
        self._state = TxnState.NEW
        #: Held by a transaction; stop() waits for it (closing under one breaks aiokafka).
        self._lock = asyncio.Lock()

    @property
    def state(self) -> TxnState:
        return self._state

    @property
    def producer_epoch(self) -> int:
        """The epoch the broker gave this producer at init (-1 before)."""
        manager: Any = self._producer._txn_manager
        return int(manager.producer_epoch)

    async def _start(self) -> None:
        """Init the producer id: from here on every older holder of the id is fenced."""
        with translate(f"initializing the transactional producer {self.transactional_id!r}"):
            async with asyncio.timeout(self.init_timeout_s):
                await self._producer.start()
                await self._producer._txn_manager.wait_for_pid()
        self._state = TxnState.READY

    async def _stop(self) -> None:
        if self._state in (TxnState.NEW, TxnState.READY):
            self._state = TxnState.CLOSED
        async with self._lock:
            await stop_producer(self._producer, self.stop_timeout_s, self._dropping)

    def _dropping(self) -> None:
        log.warning(
            "the transactional producer %r did not close within %g s; dropping it",
            self.transactional_id,
            self.stop_timeout_s,
        )

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """Collect records in the block; at its end send them all in one transaction and commit.

        An exception in the block sends nothing. :class:`TransactionFenced` when a newer holder
        of the id fenced this producer, :class:`TransactionOutcomeUnknown` when the transaction
        failed otherwise or did not end within ``timeout_s``: either way the producer is closed
        (its :attr:`state` says which) and this call is the last it answers."""
        if self._state is not TxnState.READY:
            raise BusError(
                f"the transactional producer {self.transactional_id!r} is {self._state}: "
                "a new one must be started",
                code=LocalCode.KAFKA_ERROR,
            )
        txn = Transaction()
        yield txn
        if not txn.pending:
            return
        failure: BaseException | None = None
        async with self._lock:
            if self._state is not TxnState.READY:  # stopped while the block ran
                raise BusError(
                    f"the transactional producer {self.transactional_id!r} is {self._state}",
                    code=LocalCode.KAFKA_ERROR,
                )
            try:
                async with asyncio.timeout(self.timeout_s):
                    txn.records = await self._run(txn.pending)
            except BaseException as exc:  # every failure ends this producer: see _failed_state
                self._state = _failed_state(exc)
                failure = exc
        if failure is None:
            health.succeeded()
            return
        self._retrieve_internal_failures()
        await self.stop()
        error = self._error(failure)
        if error is None:  # cancelled: the caller is going away, the producer is closed
            raise failure
        raise error from failure

    async def _run(self, pending: list[tuple[str, bytes | None, bytes | None]]) -> list[Record]:
        await self._producer.begin_transaction()
        futures = [
            (topic, key, value, await self._producer.send(topic, value=value, key=key))
            for topic, key, value in pending
        ]
        records = []
        for topic, key, value, future in futures:
            meta = await future
            records.append(Record(topic, meta.partition, meta.offset, key, value, meta.timestamp))
        await self._producer.commit_transaction()
        return records

    def _retrieve_internal_failures(self) -> None:
        """A fenced producer fails futures of aiokafka's own that nobody awaits (the
        transaction's waiter, each batch's drain waiter): retrieve their exceptions, so asyncio
        does not log "Future exception was never retrieved" with a traceback for each."""
        producer: Any = self._producer
        futures: list[Any] = [getattr(producer._txn_manager, "_transaction_waiter", None)]
        accumulator = getattr(producer, "_message_accumulator", None)
        if accumulator is not None:
            batches = [b for queued in accumulator._batches.values() for b in queued]
            batches += list(accumulator._pending_batches)
            futures += [getattr(b, "_drain_waiter", None) for b in batches]
        for future in futures:
            if isinstance(future, asyncio.Future) and future.done() and not future.cancelled():
                future.exception()

    def _error(self, exc: BaseException) -> BusError | None:
        tid = self.transactional_id
        if isinstance(exc, asyncio.CancelledError):
            return None
        if self._state is TxnState.FENCED:
            return TransactionFenced(
                f"transactional producer {tid!r} fenced: another producer took the id over "
                f"({_describe(exc)}); nothing more it writes can commit",
                code=LocalCode.CONTROLLER_FENCED,
            )
        if isinstance(exc, TimeoutError):
            what = f"the transaction did not end within {self.timeout_s:g} s"
            health.failed(f"transaction of {tid!r}: timed out")
        else:
            what = f"the transaction failed: {_describe(exc)}"
        return TransactionOutcomeUnknown(
            f"transactional producer {tid!r}: {what}; it may still commit or abort "
            "(a new producer's init settles it): read the log again before deciding"
        )


def _failed_state(exc: BaseException) -> TxnState:
    """FENCED for a fencing error, and for aiokafka's AssertionError "Invalid state transition
    FATAL_ERROR -> ...", which every step raises once the producer was fenced; else UNKNOWN."""
    if isinstance(exc, _FENCING_ERRORS):
        return TxnState.FENCED
    if isinstance(exc, AssertionError) and "FATAL_ERROR" in str(exc):
        return TxnState.FENCED
    return TxnState.UNKNOWN


def _describe(exc: BaseException) -> str:
    """``Type: message`` once (aiokafka's errors already start with their type's name)."""
    text = str(exc)
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}"
