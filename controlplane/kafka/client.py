"""What every Kafka client shares: our :class:`Record`, the translation of aiokafka's errors into a
coded :class:`~controlplane.wire.errors.BusError`, the connection options, and start/stop.

Only ``controlplane/kafka`` imports aiokafka; nothing above it sees aiokafka's types or errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from aiokafka.conn import CloseReason
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from controlplane.kafka.diagnose import classify, diagnose_client
from controlplane.kafka.health import health, log
from controlplane.kafka.lifecycle import AsyncService
from controlplane.kafka.settings import KafkaSettings, connection_options
from controlplane.wire.errors import BusError, LocalCode

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
new_record: Callable[[tuple[str, int, int, bytes | None, bytes | None, int, int]], Record] = (
    functools.partial(tuple.__new__, Record)
)


def being_cancelled() -> bool:
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
            f"{what}: Kafka unreachable: {exc}", code=LocalCode.BROKER_UNAVAILABLE
        ) from exc
    except KafkaError as exc:
        refused = classify(exc, what)  # an ACL's: KAFKA_ACCESS_DENIED
        if refused is not None:
            raise refused from exc
        retryable = bool(getattr(exc, "retriable", False))
        code = LocalCode.BROKER_UNAVAILABLE if retryable else LocalCode.KAFKA_ERROR
        raise BusError(f"{what}: {type(exc).__name__}: {exc}", code=code) from exc
    except TimeoutError as exc:
        health.failed(f"{what}: timed out")
        raise BusError(f"{what}: timed out", code=LocalCode.BROKER_UNAVAILABLE) from exc


def client_options(settings: KafkaSettings) -> dict[str, Any]:
    """Connection and security options shared by every aiokafka client (TLS/SASL pass through)."""
    return {"bootstrap_servers": settings.bootstrap_servers, **connection_options(settings)}


def _close_after_bootstrap(client: Any, task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: its caller went away
    close_now(client)


def close_now(client: Any) -> None:
    """What aiokafka's ``client.close()`` does, without waiting: stop its metadata task and
    close every connection it holds (each socket closes on the loop's next turn)."""
    sync_task = getattr(client, "_sync_task", None)
    if sync_task is not None:
        sync_task.cancel()
        client._sync_task = None
    for conn in list(client._conns.values()):
        conn.close(reason=CloseReason.SHUTDOWN)


async def stop_producer(producer: Any, timeout_s: float, on_timeout: Callable[[], None]) -> None:
    """aiokafka's ``producer.stop()`` (an ``AIOKafkaProducer``), within ``timeout_s``.

    It delivers the records still pending first, and with Kafka down it would wait for them for
    ever: past ``timeout_s``, ``on_timeout()`` (the caller says so) and the producer is closed
    without them, its sender and then its connections."""
    try:
        async with asyncio.timeout(timeout_s):
            await producer.stop()
        return
    except TimeoutError:
        on_timeout()
    sender = getattr(producer, "_sender", None)
    if sender is not None:
        with contextlib.suppress(Exception):
            await sender.close()
    await producer.client.close()


#: How long stop() waits for a bootstrap its start() abandoned (milliseconds while Kafka
#: answers); past it, what that bootstrap opens is closed when it ends.
ABANDONED_BOOTSTRAP_WAIT_S = 5.0


class ClientLifecycle(AsyncService):
    """start()/stop() with a null state: stop() works after a failed start() and twice."""

    _started = False
    _closed = False
    #: The bootstrap of a start() that was cancelled, running on to its end.
    _abandoned_bootstrap: asyncio.Future[None] | None = None
    #: aiokafka's client under this one (see :meth:`_finish_bootstrap_when_cancelled`): asked
    #: why its bootstrap failed when that is not plain unreachability.
    _kafka_client: Any = None

    def _finish_bootstrap_when_cancelled(self, client: Any) -> None:
        """Make a cancelled ``client.bootstrap()`` (of aiokafka's ``AIOKafkaClient`` under this
        client: the first step of its start) leave no connection open.

        aiokafka's bootstrap opens a connection, asks it for the cluster's metadata and closes
        it; cancelled in between (a stop, or a timeout around start(), in the milliseconds that
        takes) it drops that connection unclosed, where no close() reaches it: the socket stays
        open until the garbage collector finds it ("Unclosed AIOKafkaConnection"). So the
        caller's cancellation no longer reaches the bootstrap: it runs on to its end (each of
        its steps is bounded by the request timeout), stop() waits for that, and whatever it
        opened is closed when it ends. A cancelled start is followed by stop(), never start().
        """
        self._kafka_client = client
        original = client.bootstrap

        async def bootstrap() -> None:
            task = asyncio.ensure_future(original())
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                self._abandoned_bootstrap = task
                task.add_done_callback(functools.partial(_close_after_bootstrap, client))
                raise

        client.bootstrap = bootstrap

    async def start(self) -> None:
        if self._closed:
            raise BusError(f"{type(self).__name__} was stopped and cannot be reused")
        if self._started:
            return
        try:
            await self._start()
        except BusError as exc:
            if exc.code is LocalCode.BROKER_UNAVAILABLE and self._kafka_client is not None:
                # On TLS or SASL, "Unable to bootstrap" may be a refusal: one connection says.
                refused = await diagnose_client(self._kafka_client)
                if refused is not None:
                    health.failed(refused.message)
                    raise refused from exc
            raise
        self._started = True

    async def stop(self) -> None:
        """Never raises, except our own task's cancellation: aiokafka's close() awaits tasks it
        cancelled and lets their CancelledError out (seen when Kafka was down)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._abandoned_bootstrap is not None:
                await asyncio.wait({self._abandoned_bootstrap}, timeout=ABANDONED_BOOTSTRAP_WAIT_S)
            await self._stop()
        except asyncio.CancelledError:
            if being_cancelled():
                raise
        except Exception as exc:
            log.debug("stopping %s: %s", type(self).__name__, exc)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError
