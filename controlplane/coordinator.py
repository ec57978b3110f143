"""The coordinator service: a replica of the log (Follower + Fleet) with a write path into Kafka.

Rebuilt from the topics on start, so a restart shows the same status; then follows live and
fans changes out to subscribers (server-sent events). Holds no state of its own. HTTP lives in
api.py; process settings, signals and uvicorn in the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from datetime import datetime

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.bus import Producer
from controlplane.follower import Batch, Follower
from controlplane.lifecycle import AsyncService
from controlplane.protocol import Command, CommandSpec, Selector, utcnow
from controlplane.publisher import build_command, publish, resolve_selector
from controlplane.rollout import DEFAULT_PROGRESS_DEADLINE_S, Fleet
from controlplane.settings import KafkaSettings

log = logging.getLogger(__name__)

ENV_PREFIX = "FLEET_COORDINATOR_"


class CoordinatorSettings(BaseSettings):
    """Example: FLEET_COORDINATOR_KAFKA__BOOTSTRAP_SERVERS=kafka:9092 FLEET_COORDINATOR_API_TOKEN=..."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    api_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for POST /rollouts; without one, writes are refused.",
    )
    progress_deadline_s: float = Field(default=DEFAULT_PROGRESS_DEADLINE_S, gt=0)
    issuer: str = "coordinator"


class Coordinator(AsyncService):
    """``async with Coordinator(settings) as c:`` runs the follower in the background."""

    def __init__(
        self, settings: CoordinatorSettings, *, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.fleet = Fleet(progress_deadline_s=settings.progress_deadline_s)
        self.follower = Follower(settings.kafka, self.fleet)
        self.follower.listeners.append(self._on_batch)
        self._producer = Producer(settings.kafka)
        self._subscribers: set[asyncio.Queue[set[str] | None]] = set()
        self._task: asyncio.Task[None] | None = None
        self.started_at = clock()

    @property
    def ready(self) -> bool:
        return self.follower.caught_up.is_set()

    async def start(self) -> None:
        await self.follower.start()
        await self._producer.start()
        self._task = asyncio.create_task(self._run(), name="coordinator-follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for queue in list(self._subscribers):
            queue.put_nowait(None)
        await self._producer.stop()
        await self.follower.stop()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        await asyncio.wait_for(self.follower.caught_up.wait(), timeout)

    async def _run(self) -> None:
        while True:
            try:
                await self.follower.poll(timeout_s=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Kafka away: keep serving what we have, retry
                log.warning("follower poll failed: %s", exc)
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ write path

    async def create_rollout(
        self,
        spec: CommandSpec,
        selector: Selector,
        *,
        issuer: str | None = None,
        ttl_s: float = 3600.0,
        timeout_s: float | None = None,
        rollout_id: str | None = None,
    ) -> Command:
        """Resolve the selector against live workers, publish the command; returns it."""
        now = self.clock()
        pinned = resolve_selector(selector, self.fleet.registry, now)
        command = build_command(
            spec,
            pinned,
            issuer=issuer or self.settings.issuer,
            ttl_s=ttl_s,
            timeout_s=timeout_s,
            rollout_id=rollout_id,
            now=now,
        )
        await publish(self.settings.kafka, command, self._producer)
        return command

    # ------------------------------------------------------------------ change feed

    def _on_batch(self, batch: Batch) -> None:
        changed = batch.rollout_ids
        if batch.heartbeats:
            changed.add("*workers")
        for queue in self._subscribers:
            queue.put_nowait(changed)

    async def changes(self, tick_s: float = 1.0) -> AsyncGenerator[set[str], None]:
        """Sets of changed rollout ids ("*workers" for the registry); an empty set every tick."""
        queue: asyncio.Queue[set[str] | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), tick_s)
                except TimeoutError:
                    item = set()
                if item is None:
                    return
                yield item
        finally:
            self._subscribers.discard(queue)
