"""The agent's heartbeats: every interval, at start, at stop and when stopped, and beside a command.

Built from the worker's view of itself when sent (``seq`` in order), and never waiting for the
runner or the disk. A failure is said once when heartbeats start failing, and once when they go
out again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime

from controlplane.wire.channels import HEARTBEATS
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.protocol import Degraded, Heartbeat, WorkerStatus
from workers.agent.producer import ProducerLink, PublishHealth
from workers.agent.session import AgentLog, StopSignal, WorkerView
from workers.agent.settings import WorkerSettings

AGENT_VERSION = "0.1.0"


class Heartbeater:
    """Sends the worker's heartbeats while :meth:`run` runs, until :meth:`finish`."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        runner_name: str,
        link: ProducerLink,
        health: PublishHealth,
        view: WorkerView,
        stop: StopSignal,
        incarnation: int,
        started_at: datetime,
        clock: Callable[[], datetime],
        log: AgentLog,
    ) -> None:
        self._settings = settings
        self._runner_name = runner_name
        self._link = link
        self._health = health
        self._view = view
        self._stop = stop
        self._incarnation = incarnation
        self._started_at = started_at
        self._clock = clock
        self._log = log
        self._topics = settings.kafka.topics
        self._seq = 0
        self._last_beat = 0.0  # time.monotonic() of the last heartbeat built
        self._wakeup = asyncio.Event()
        stop.add_wakeup(self._wakeup)
        self._done = asyncio.Event()
        #: Heartbeats sent beside the command path (see beat_soon), until sent.
        self._beats: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Every interval, at start, at stop and when stopped; the command path adds its own."""
        while True:
            self._wakeup.clear()  # before reading the state: a wake-up from now on counts
            final = self._done.is_set()
            if final:
                self._view.status = WorkerStatus.STOPPED
            elif self._stop.is_set():
                self._view.status = WorkerStatus.STOPPING
            await self.beat()
            if final:
                return
            # Until woken (stop, end), or an interval has passed since the last heartbeat,
            # whoever sent it: one sent beside a command (beat_soon) restarts the period.
            while (
                due := self._last_beat + self._settings.heartbeat_interval_s - time.monotonic()
            ) > 0:
                try:
                    async with asyncio.timeout(due):  # not wait_for: see StopSignal.sleep
                        await self._wakeup.wait()
                    break
                except TimeoutError:
                    pass

    def finish(self) -> None:
        """The worker has stopped: :meth:`run` sends the last heartbeat, then returns."""
        self._done.set()
        self._wakeup.set()

    def beat_soon(self) -> None:
        """Send a heartbeat now, beside the command path (not awaited).

        Its task appends it to the producer at the loop's next turn, before the producer's
        sender runs, so it shares a request with what the command path appends just after
        this call. Out of order with the loop's own beats is harmless: readers order by ``seq``.
        """
        task = asyncio.create_task(self.beat())
        self._beats.add(task)
        task.add_done_callback(self._beats.discard)

    async def drain(self) -> None:
        """Wait for the heartbeats sent beside the command path."""
        await asyncio.gather(*self._beats, return_exceptions=True)

    async def beat(self) -> None:
        """Build a heartbeat of the current state and send it (built when sent: seq in order)."""
        hb = self.build()
        self._last_beat = time.monotonic()
        # While Kafka is down a send waits for it (the record stays queued and goes out when
        # Kafka is back): the loop, and a stop, do not wait longer than this for it.
        producer = self._link.current
        limit = max(1.0, min(3 * self._settings.heartbeat_interval_s, producer.delivery_timeout_s))
        deadline = time.monotonic() + limit
        topic, key, value = HEARTBEATS.record(self._topics, hb)
        try:
            delivery = await producer.submit(topic, value, key=key, timeout_s=limit)
            try:
                await delivery.wait(max(0.0, deadline - time.monotonic()))
            except BusError as exc:
                if exc.code is not LocalCode.PUBLISH_OUTCOME_UNKNOWN:  # gave up on it
                    await self._link.renew(producer, exc)
                raise
        except BusError as exc:  # logged when they start failing, not each time
            if self._health.beats_failing_since is None:
                self._health.beats_failing_since = hb.sent_at
                self._log(logging.WARNING, "heartbeat failed: %s", exc)
            else:
                self._log(logging.DEBUG, "heartbeat failed: %s", exc)
        else:
            if self._health.beats_failing_since is not None:
                self._log(logging.INFO, "heartbeats sent again")
            self._health.beats_failing_since = None

    def build(self) -> Heartbeat:
        """The next heartbeat (``seq`` + 1), from the worker's view of itself now."""
        desc = self._view.describe
        degraded = self._view.degraded
        if degraded is None and desc is not None and desc.degraded is not None:
            d = desc.degraded
            degraded = Degraded(
                code=d.code,
                message=d.message[:4096],
                from_version=d.from_version,
                to_version=d.to_version,
                since=d.since,
            )
        self._seq += 1
        return Heartbeat(
            worker_id=self._settings.worker_id,
            labels=self._settings.labels,
            runner=self._runner_name,
            device=desc.device if desc else "unknown",
            status=self._view.status,
            weights_version=desc.weights_version if desc else None,
            config_digest=desc.config_digest if desc else None,
            weights_digest=desc.weights_digest if desc and desc.model_loaded else None,
            in_flight=self._view.in_flight,
            degraded=degraded,
            seq=self._seq,
            sent_at=self._clock(),
            started_at=self._started_at,
            incarnation=self._incarnation,
            interval_s=self._settings.heartbeat_interval_s,
            lease_s=self._settings.effective_lease_s,
            acks_unpublished=self._health.acks_unpublished(),
            publish_failing_since=self._health.failing_since(),
            agent_version=AGENT_VERSION,
        )
