"""The agent's link to Kafka for what it publishes (acks and heartbeats), and how that fares.

:class:`ProducerLink` holds the current producer and replaces it after it gave up on a record;
:class:`PublishHealth` says since when acks or heartbeats fail (heartbeats report it). The link
never builds a producer itself: the agent hands it a factory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from controlplane.kafka.bus import Producer
from controlplane.wire.errors import BusError
from workers.agent.session import AgentLog


@dataclass
class PublishHealth:
    """How publishing fares, for heartbeats and logs."""

    #: Acks handed to the outbox and not confirmed by the cluster yet.
    acks_unconfirmed: int = 0
    #: Since when acks go unconfirmed (the publish that first failed began), None while they
    #: go through: said once when it starts and once when it ends.
    acks_failing_since: datetime | None = None
    #: Since when heartbeats fail (the first failed one was built), None while they go out.
    beats_failing_since: datetime | None = None

    def acks_unpublished(self) -> int:
        """Acks on their way for milliseconds are not news: counted while publishes fail."""
        return self.acks_unconfirmed if self.acks_failing_since else 0

    def failing_since(self) -> datetime | None:
        """Since when acks or heartbeats fail, whichever began first."""
        return min(
            (t for t in (self.acks_failing_since, self.beats_failing_since) if t),
            default=None,
        )


class ProducerLink:
    """The producer acks and heartbeats go through now; replaced when it gives up on a record."""

    def __init__(
        self,
        first: Producer,
        make: Callable[[], Producer],
        *,
        health: PublishHealth,
        log: AgentLog,
    ) -> None:
        #: The producer to publish with (compare with it: a renewal replaces it).
        self.current = first
        self._first = first  # started and stopped by its owner
        self._make = make
        self._health = health
        self._log = log
        self._renewing = asyncio.Lock()
        #: Producers replaced after they gave up on a record, stopping.
        self._retired: set[asyncio.Task[None]] = set()

    async def renew(self, gave_up: Producer, exc: BusError) -> None:
        """Replace ``gave_up`` after it gave up on a record (then it was not written).

        The idempotent producer numbers the records of each partition; one it gave up on (a
        batch that waited for a leader longer than the request timeout, or that the broker
        refused for good) leaves a gap, and the broker refuses every later record of that
        partition (OutOfOrderSequenceNumber) for as long as the producer lives: acks or
        heartbeats would never go out again. A new producer (a new producer id) starts a new
        sequence. If it cannot start (Kafka unreachable), the old one stays until the next
        give-up. The old one is stopped in the background (its records are abandoned).
        """
        async with self._renewing:
            if gave_up is not self.current:
                return  # already replaced
            fresh = self._make()
            try:
                async with asyncio.timeout(fresh.delivery_timeout_s):
                    await fresh.start()
            except (BusError, TimeoutError) as start_exc:
                await fresh.stop()
                self._log(logging.DEBUG, "no new producer yet: %s", start_exc)
                return
            except BaseException:  # cancelled while starting: never leave it open
                await fresh.stop()
                raise
            self.current = fresh
        failing = self._health.acks_failing_since or self._health.beats_failing_since
        self._log(
            logging.DEBUG if failing else logging.INFO,
            "the producer gave up on a record (%s: %s); publishing with a new one",
            exc.code,
            exc.message,
        )
        task = asyncio.create_task(gave_up.stop())
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def close(self) -> None:
        """Stop a producer that replaced the first one, and wait for the retired ones."""
        if self.current is not self._first:
            await self.current.stop()
        await asyncio.gather(*self._retired, return_exceptions=True)
