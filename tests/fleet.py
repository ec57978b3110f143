"""Test helpers that cross the real broker: publish commands, collect acks and heartbeats."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from controlplane.kafka.bus import Consumer, Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import (
    Ack,
    Command,
    CommandSpec,
    Heartbeat,
    Selector,
    decode_ack,
    decode_heartbeat,
    encode,
    utcnow,
)


def make_command(
    spec: CommandSpec,
    *,
    selector: Selector | None = None,
    ttl_s: float = 300.0,
    timeout_s: float | None = None,
    command_id: str | None = None,
    rollout_id: str | None = None,
    **kw: Any,
) -> Command:
    now = utcnow()
    cid = command_id or f"c-{uuid.uuid4().hex[:12]}"
    return Command(
        command_id=cid,
        rollout_id=rollout_id or f"r-{cid[2:]}",
        issued_at=kw.pop("issued_at", now),
        expires_at=kw.pop("expires_at", now + timedelta(seconds=ttl_s)),
        issuer="tests",
        selector=selector or Selector(),
        spec=spec,
        timeout_s=timeout_s,
        **kw,
    )


async def publish(settings: KafkaSettings, *payloads: Command | bytes) -> None:
    async with Producer(settings) as producer:
        for item in payloads:
            value = item if isinstance(item, bytes) else encode(item)
            await producer.send(settings.topics.commands.name, value)


class Tail:
    """Reads a topic from the beginning, decoding into a list, until a predicate holds."""

    def __init__(self, settings: KafkaSettings, topic: str, decode: Callable[[bytes], Any]) -> None:
        self.settings = settings
        self.topic = topic
        self.decode = decode
        self.items: list[Any] = []
        self._consumer = Consumer(settings)

    async def __aenter__(self) -> Tail:
        await self._consumer.start()
        await self._consumer.assign(self.topic)
        await self._consumer.seek_to_beginning()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def until(
        self, predicate: Callable[[list[Any]], bool], timeout: float = 60.0
    ) -> list[Any]:
        deadline = time.monotonic() + timeout
        while not predicate(self.items):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out on {self.topic}; have {len(self.items)}: {self.items[-5:]}"
                )
            for rec in await self._consumer.fetch(timeout_s=0.2):
                if rec.value is not None:
                    self.items.append(self.decode(rec.value))
        return self.items

    async def drain(self, seconds: float) -> list[Any]:
        """Collect whatever arrives within ``seconds`` (to show that nothing more does)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for rec in await self._consumer.fetch(timeout_s=0.2):
                if rec.value is not None:
                    self.items.append(self.decode(rec.value))
        return self.items


async def settled(settings: KafkaSettings, acks: Tail, command: Command, **kw: Any) -> list[Ack]:
    """Publish ``command`` and read ``acks`` until its terminal ack is there (``kw``: ``until``'s)."""
    await publish(settings, command)
    return await acks.until(has_terminal(command.command_id), **kw)


def acks_tail(settings: KafkaSettings) -> Tail:
    return Tail(settings, settings.topics.acks.name, decode_ack)


def heartbeats_tail(settings: KafkaSettings) -> Tail:
    return Tail(settings, settings.topics.workers.name, decode_heartbeat)


def terminal(acks: list[Ack], command_id: str) -> list[Ack]:
    return [a for a in acks if a.command_id == command_id and a.state.terminal]


def has_terminal(command_id: str, n: int = 1) -> Callable[[list[Ack]], bool]:
    return lambda acks: len(terminal(acks, command_id)) >= n


def latest(heartbeats: list[Heartbeat], worker_id: str) -> Heartbeat | None:
    mine = [h for h in heartbeats if h.worker_id == worker_id]
    return mine[-1] if mine else None


async def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
