"""Leader election by consumer group: the member assigned partition 0 of a one-partition topic leads.

Every candidate (coordinator) joins the same group on the controller topic; the group
coordinator gives its one partition to exactly one member per generation. Leading is a fact of
one generation, learnt only from the rebalance callbacks: :attr:`LeaderElection.leader_generation`
is set when ``on_partitions_assigned`` hands this member partition 0 and cleared when
``on_partitions_revoked`` takes it back. ``consumer.assignment()`` is never trusted: after the
group dropped a member (paused past its session timeout), aiokafka keeps the old assignment
until it has rejoined, and a member that believed it would re-init the transactional producer and
fence the real leader (docs/controller.md, pitfall 1).

Being elected is not enough to write safely: a paused former leader acts before it learns it
lost (pitfall 2). Only the transactional producer's fencing stops its writes
(:mod:`controlplane.kafka.transactions`); the election decides who inits that producer. A revoke
waits, through :attr:`LeaderElection.lock`, for the transaction in flight, so no transaction of
a generation starts after its revoke began::

    async with LeaderElection(settings) as election:
        generation = await election.wait_leader()
        async with election.leading(generation):      # LeadershipLost once revoked
            async with producer.transaction() as txn:
                txn.send(...)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.sticky.sticky_assignor import StickyPartitionAssignor

from controlplane.kafka.client import (
    ClientLifecycle,
    being_cancelled,
    client_options,
    translate,
)
from controlplane.kafka.health import log
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode


class LeadershipLost(BusError):
    """This member does not lead the generation it was asked about (any more)."""


class LeaderElection(ClientLifecycle):
    """One candidate in the controller's group; see the module's docstring."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str | None = None,
        topic: str | None = None,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int | None = None,
    ) -> None:
        """``session_timeout_ms``: how long a silent leader keeps the partition before another
        member takes over (the broker's minimum, ``group.min.session.timeout.ms``, is 6000)."""
        topics = settings.topics
        self.topic = topic if topic is not None else topics.controller.name
        self.group_id = group_id if group_id is not None else topics.controller_group
        #: Hold it while a transaction of the leading generation is open: a revoke waits for it.
        #: Never stop() the election while holding it (closing waits for a revoke in progress).
        self.lock = asyncio.Lock()
        #: The generation whose assignment gave this member partition 0; None while not leading.
        self.leader_generation: int | None = None
        #: The generation of this member's latest assignment, leading or not (observability).
        self.member_generation: int | None = None
        self._leading = asyncio.Event()
        self._partition = TopicPartition(self.topic, 0)
        self._listener = _Listener(self)
        #: The sticky assignor keeps what it assigned, and the generation, on its class: one
        #: class of its own per election, so two elections in a process never share them.
        self._assignor: Any = type(
            "ElectionStickyAssignor",
            (StickyPartitionAssignor,),
            {
                "member_assignment": None,
                "generation": StickyPartitionAssignor.DEFAULT_GENERATION_ID,
            },
        )
        self._consumer = AIOKafkaConsumer(
            **client_options(settings),
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="latest",
            isolation_level="read_committed",
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms or max(1000, session_timeout_ms // 3),
            partition_assignment_strategy=(self._assignor,),
        )
        self._finish_bootstrap_when_cancelled(self._consumer._client)
        self._poller: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        self._consumer.subscribe([self.topic], listener=self._listener)
        with translate(f"joining the controller group {self.group_id!r}"):
            await self._consumer.start()
        self._poller = asyncio.create_task(self._poll(), name=f"election:{self.group_id}")

    async def _stop(self) -> None:
        self._set_leader(None)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
        try:
            await self._consumer.stop()
        except asyncio.CancelledError:
            if being_cancelled():
                raise

    async def _poll(self) -> None:
        """Keeps the member in the group (aiokafka drops one that does not poll) and runs the
        rebalance callbacks; the topic's records are not needed here. A member that stopped
        polling leads nothing (the group may keep it, through its heartbeats, a while)."""
        try:
            while True:
                with translate(f"polling the controller group {self.group_id!r}"):
                    await self._consumer.getmany(timeout_ms=1000)
        finally:
            self._set_leader(None)

    # ----------------------------------------------------------------- leadership

    def is_leader(self, generation: int) -> bool:
        """Whether this member still leads ``generation`` (as far as the callbacks told it)."""
        return self.leader_generation is not None and self.leader_generation == generation

    async def wait_leader(self) -> int:
        """Wait until this member leads a generation; return it. A coded BusError when the
        member's consumer failed (it would never lead)."""
        while True:
            generation = self.leader_generation
            if generation is not None:
                return generation
            poller = self._poller
            if poller is None:
                raise BusError("the leader election is not running", code=LocalCode.KAFKA_ERROR)
            leading = asyncio.ensure_future(self._leading.wait())
            try:
                await asyncio.wait({leading, poller}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                leading.cancel()
            if poller.done():
                raise _poller_error(poller, self.group_id)

    @contextlib.asynccontextmanager
    async def leading(self, generation: int) -> AsyncIterator[None]:
        """Hold :attr:`lock` for the block, which runs only while this member leads
        ``generation`` (:class:`LeadershipLost` otherwise); a revoke waits for the block."""
        async with self.lock:
            if not self.is_leader(generation):
                raise LeadershipLost(
                    f"not the controller's leader in generation {generation} "
                    f"(now: {self.leader_generation})"
                )
            yield

    async def rejoin(self, generation: int) -> bool:
        """Step down from ``generation`` after its producer was fenced, and make the group
        elect again if it still thinks this member leads it.

        The broker may fence a leader the group still counts as such (its transaction timed
        out while it was paused for less than the session timeout): without a new generation
        nobody would init again. But when aiokafka is already rejoining (it learnt the member
        was dropped), forcing another rejoin costs the group one more session timeout; so
        this forces one only while the member still sits in ``generation``. True if it did."""
        if self.leader_generation == generation:
            self._set_leader(None)
        coordinator: Any = getattr(self._consumer, "_coordinator", None)
        if coordinator is None or coordinator.generation != generation:
            return False
        log.info("controller fenced in generation %s: leaving the group to rejoin", generation)
        self._consumer.unsubscribe()
        self._consumer.subscribe([self.topic], listener=self._listener)
        return True

    def _set_leader(self, generation: int | None) -> None:
        self.leader_generation = generation
        if generation is None:
            self._leading.clear()
        else:
            self._leading.set()

    # ----------------------------------------------------------------- callbacks

    def _assigned(self, assigned: set[TopicPartition]) -> None:
        coordinator: Any = self._consumer._coordinator
        generation = int(coordinator.generation)
        if generation < 0:  # not a generation the group gave: never lead on it
            return
        # aiokafka 0.14 never tells the sticky assignor the generation: every member then says
        # -1, the group's leader sees two claims to the partition (a paused former leader's and
        # the current one's) and may hand it back to the one that just stalled. Say it.
        self._assignor.on_generation_assignment(generation)
        self.member_generation = generation
        if self._partition not in assigned:
            return
        log.info("leading the controller group %r in generation %s", self.group_id, generation)
        self._set_leader(generation)

    async def _revoked(self) -> None:
        was = self.leader_generation
        self._set_leader(None)  # first: no transaction of it starts from here on
        async with self.lock:  # ... and the one in flight ends before the group moves on
            pass
        if was is not None:
            log.info(
                "no longer leading the controller group %r (generation %s)", self.group_id, was
            )


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, election: LeaderElection) -> None:
        self._election = election

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._election._revoked()

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._election._assigned(assigned)


def _poller_error(poller: asyncio.Task[None], group_id: str) -> BusError:
    exc = None if poller.cancelled() else poller.exception()
    if isinstance(exc, BusError):
        return exc
    return BusError(
        f"the controller group {group_id!r}: the member stopped ({exc!r})",
        code=LocalCode.KAFKA_ERROR,
    )
