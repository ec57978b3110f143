"""Acks on their way to Kafka: held while a command is quick, then published until confirmed.

One command's ``accepted`` and ``running`` acks are held; at the grace they are released (handed to
the producer, not awaited); its terminal ack is published after them and awaited until the
cluster confirms it. Acks are keyed by worker id: one partition, kept in order. No journal here:
the caller makes outcomes durable before publishing and marks them published after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime

from controlplane.kafka.bus import Delivery
from controlplane.wire.channels import ACKS
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.protocol import Ack
from controlplane.wire.topics import Topics
from workers.agent.producer import ProducerLink, PublishHealth
from workers.agent.session import AgentLog, StopSignal

#: After a stop, a publish that starts once the drain timeout is over still gets this long
#: (at most the delivery timeout): a healthy cluster confirms in milliseconds.
_STOP_PUBLISH_MIN_S = 5.0


class AcksLeftUnpublished(Exception):
    """A stop's deadline passed while acks were not confirmed: the agent stops without them
    (terminal ones stay in the journal, published at the next start; offset not committed)."""


class AckOutbox:
    """Publishes acks in order, until the cluster confirms them or a stop's deadline passes."""

    def __init__(
        self,
        *,
        link: ProducerLink,
        health: PublishHealth,
        topics: Topics,
        stop: StopSignal,
        clock: Callable[[], datetime],
        log: AgentLog,
    ) -> None:
        self._link = link
        self._health = health
        self._topics = topics
        self._stop = stop
        self._clock = clock
        self._log = log
        #: The command in hand's accepted and running acks, until the grace or its end.
        self._held: tuple[Ack, ...] = ()
        #: Those acks once released at the grace, on their way (see release_held).
        self._progress: asyncio.Task[None] | None = None

    def hold(self, *acks: Ack) -> None:
        """Keep ``acks`` until :meth:`release_held` or :meth:`take_held`."""
        self._held = acks

    def take_held(self) -> tuple[Ack, ...]:
        """The acks still held (none once released), to publish with the terminal one."""
        acks, self._held = self._held, ()
        return acks

    def release_held(self) -> None:
        """Hand the held accepted and running acks to the producer without waiting for them.

        One task, one ``send_many``: appended in this order, they go out in one request, and the
        idempotent producer keeps them in order within the worker's partition.
        :meth:`settle` waits for them before the terminal ack is published.
        """
        acks = self.take_held()
        if acks:
            if self._progress is not None:
                raise RuntimeError("the previous command's acks were not settled")
            self._progress = asyncio.create_task(self.publish(acks))

    async def settle(self) -> None:
        """Wait until the released acks are published (before the terminal one follows)."""
        task, self._progress = self._progress, None
        if task is not None:
            await task

    def cancel(self) -> None:
        """Give up on released acks (only when the command loop was cancelled)."""
        if self._progress is not None:
            self._progress.cancel()

    async def publish(self, acks: Sequence[Ack]) -> None:
        """Publish acks in this order (one request when they fit) and wait until the cluster
        has confirmed them all.

        Nothing is dropped, non-terminal acks included: a coordinator shows "running" from them
        while a long reload runs. Each ack is handed to the producer once and waited on in
        delivery-timeout slices: a wait that times out (PUBLISH_OUTCOME_UNKNOWN: the idempotent
        producer still retries the record) waits again on the same record, so a cluster that
        takes it late gets it once. Only a record the producer could not queue, or gave up on
        (then it was not written), is handed over again after a backoff, with every ack after
        it, in order, so the log still reads accepted, running, terminal (a copy of one that
        was written meanwhile is a duplicate, which readers expect: the earliest of each state
        counts). Said once when acks go unconfirmed and once when they go through (see
        :meth:`_failed`). After a stop this gives up at the stop's deadline (:meth:`_limit`)
        with :class:`AcksLeftUnpublished`.
        """
        pending = [ACKS.record(self._topics, ack) for ack in acks]  # (topic, key, value)
        deliveries: list[Delivery] = []  # of pending's first ones, in order, by `producer`
        producer = self._link.current
        began, began_mono = self._clock(), time.monotonic()
        delay = 0.5
        self._health.acks_unconfirmed += len(pending)
        try:
            while pending:
                limit = self._limit(began_mono)
                if producer is not self._link.current:  # renewed: the old one publishes no more
                    producer, deliveries = self._link.current, []
                queued = False
                try:
                    while len(deliveries) < len(pending):
                        topic, key, value = pending[len(deliveries)]
                        deliveries.append(
                            await producer.submit(topic, value, key=key, timeout_s=limit)
                        )
                    queued = True
                    if deliveries[0].done:  # confirmed with an earlier one: never suspends
                        await deliveries[0].wait(limit)
                    elif await self._stop.unless_stopped(deliveries[0].wait(limit)) is None:
                        continue  # a stop came: its deadline bounds the waits from now on
                except BusError as exc:
                    self._failed(exc, began, timed_out=limit)
                    if exc.code is LocalCode.PUBLISH_OUTCOME_UNKNOWN:
                        continue  # still queued: wait on the same records
                    if queued:  # the producer gave up on it: hand it over again, and all after
                        deliveries.clear()
                        await self._link.renew(producer, exc)
                    await self._backoff(delay, began_mono)
                    delay = min(delay * 2, 10.0)
                    continue
                pending.pop(0)
                deliveries.pop(0)
                self._health.acks_unconfirmed -= 1
                self._recovered()
        except AcksLeftUnpublished:
            if self._health.acks_failing_since is None:  # the last heartbeat reports them
                self._health.acks_failing_since = began
            raise
        except BaseException:
            self._health.acks_unconfirmed -= len(pending)
            raise

    def _failed(self, exc: BusError, began: datetime, *, timed_out: float) -> None:
        """Said once when acks go unconfirmed (then at DEBUG), with how many and why."""
        if (
            exc.code is LocalCode.PUBLISH_OUTCOME_UNKNOWN
            and timed_out < self._link.current.delivery_timeout_s
        ):
            return  # a wait cut short by a stop's deadline, not a failure
        if self._health.acks_failing_since is not None:
            self._log(logging.DEBUG, "acks still unconfirmed: %s", exc)
            return
        self._health.acks_failing_since = began
        self._log(
            logging.WARNING,
            "cannot publish to Kafka since %s: %d ack(s) wait to be published (the outcomes are"
            " in the journal); retrying until Kafka takes them (%s: %s)",
            began.isoformat(timespec="seconds"),
            self._health.acks_unconfirmed,
            exc.code,
            exc.message,
        )

    def _recovered(self) -> None:
        since, self._health.acks_failing_since = self._health.acks_failing_since, None
        if since is not None:
            self._log(
                logging.WARNING,
                "acks published again after %.0f s",
                (self._clock() - since).total_seconds(),
            )

    def _limit(self, began: float) -> float:
        """How long the next attempt to publish acks may wait: the delivery timeout, or what is
        left of a stop's deadline (the drain timeout after the stop; a publish that begins
        later still gets a few seconds). :class:`AcksLeftUnpublished` once it has passed."""
        limit = self._link.current.delivery_timeout_s
        deadline = self._deadline(began)
        if deadline is None:
            return limit
        left = deadline - time.monotonic()
        if left <= 0:
            raise AcksLeftUnpublished()
        return min(limit, left)

    def _deadline(self, began: float) -> float | None:
        least = min(_STOP_PUBLISH_MIN_S, self._link.current.delivery_timeout_s)
        return self._stop.deadline(began, least)

    async def _backoff(self, seconds: float, began: float) -> None:
        """Sleep before publishing again; a stop's deadline cuts it short."""
        deadline = self._deadline(began)
        if deadline is None:
            await self._stop.sleep(seconds)
        else:
            await asyncio.sleep(max(0.0, min(seconds, deadline - time.monotonic())))
