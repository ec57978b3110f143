"""What the agent's parts share: the stop signal, the worker's view of itself, and its log.

No Kafka, no journal, no runner calls except :meth:`WorkerView.refresh`. Everything logs through
:class:`AgentLog`, on the logger ``workers.agent.loop`` (operators and tests filter on that name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from controlplane.wire.protocol import Degraded, InFlight, WorkerStatus
from workers.runners.base import Runner, RunnerDescription

R = TypeVar("R")

#: The agent's one logger, whichever part logs.
log = logging.getLogger("workers.agent.loop")


class AgentLog:
    """Log a line prefixed with ``[worker=.. command=.. rollout=..]``."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def __call__(
        self,
        level: int,
        msg: str,
        *args: Any,
        command_id: str | None = None,
        rollout_id: str | None = None,
    ) -> None:
        if not log.isEnabledFor(level):
            return
        ctx = f"worker={self.worker_id}"
        if command_id:
            ctx += f" command={command_id}"
        if rollout_id:
            ctx += f" rollout={rollout_id}"
        log.log(level, f"[{ctx}] {msg}", *args)


class StopSignal:
    """A stop, once requested: when it came, and what it cuts short (waits, publishes, a run)."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.drain_timeout_s = drain_timeout_s
        #: ``time.monotonic()`` when the stop was requested; None until then.
        self.stopped_at: float | None = None
        self._event = asyncio.Event()
        self._wakeups: list[asyncio.Event] = []
        # Resolved by request(): what :meth:`unless_stopped` races its call against (one
        # future for every call, not a task per call; made on first use, in the running loop).
        self._stopped: asyncio.Future[None] | None = None

    def request(self) -> None:
        """Stop (once): set the signal and every wake-up registered with :meth:`add_wakeup`."""
        if not self._event.is_set():
            self.stopped_at = time.monotonic()
            self._event.set()
            for wakeup in self._wakeups:
                wakeup.set()
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_result(None)

    def is_set(self) -> bool:
        return self._event.is_set()

    def add_wakeup(self, wakeup: asyncio.Event) -> None:
        """Set ``wakeup`` when the stop comes (at once if it already came)."""
        self._wakeups.append(wakeup)
        if self._event.is_set():
            wakeup.set()

    def drain_deadline(self) -> float | None:
        """When the command in flight must be given up (monotonic), once a stop came."""
        if self.stopped_at is None:
            return None
        return self.stopped_at + self.drain_timeout_s

    def deadline(self, began: float, least_s: float) -> float | None:
        """When a publish that began at ``began`` (monotonic) gives up after a stop: the drain
        timeout after the stop, but at least ``least_s`` after the later of the two."""
        if self.stopped_at is None:
            return None
        return max(
            self.stopped_at + self.drain_timeout_s,
            max(began, self.stopped_at) + least_s,
        )

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or until the stop comes."""
        # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
        # comes as the event is set.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._event.wait()

    async def unless_stopped(self, call: Coroutine[Any, Any, R]) -> R | None:
        """``call``'s result, or None when a stop comes first (``call`` is cancelled).
        After a stop, just ``call``."""
        if self._event.is_set():
            return await call
        task = asyncio.ensure_future(call)
        race: set[asyncio.Future[Any]] = {task, self._stop_future()}
        try:
            await asyncio.wait(race, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        await asyncio.wait({task})  # when cancelled above: until it has unwound
        return None if task.cancelled() else task.result()

    def _stop_future(self) -> asyncio.Future[None]:
        """The future request() resolves, of the running loop (a new one for a new loop)."""
        loop = asyncio.get_running_loop()
        if self._stopped is None or self._stopped.get_loop() is not loop:
            self._stopped = loop.create_future()
        return self._stopped


@dataclass
class WorkerView:
    """What the worker says about itself in heartbeats and acks."""

    status: WorkerStatus = WorkerStatus.STARTING
    in_flight: InFlight | None = None
    #: The runner's last description (None until it gave one).
    describe: RunnerDescription | None = None
    #: Why this worker cannot serve as it should, beyond what its runner says (its model
    #: failed to load, its journal cannot be written); reported in every heartbeat.
    degraded: Degraded | None = None

    def idle_status(self, stopping: bool) -> WorkerStatus:
        if self.degraded is not None or (
            self.describe is not None and self.describe.degraded is not None
        ):
            return WorkerStatus.DEGRADED
        return WorkerStatus.STOPPING if stopping else WorkerStatus.READY

    @property
    def device(self) -> str:
        return self.describe.device if self.describe else "unknown"

    async def refresh(self, runner: Runner, log: AgentLog) -> None:
        """Ask the runner to describe itself (in a thread); a failure keeps the last one."""
        try:
            self.describe = await asyncio.to_thread(runner.describe)
        except Exception as exc:
            log(logging.ERROR, "runner.describe() failed: %s", exc)
