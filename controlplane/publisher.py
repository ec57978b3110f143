"""Builds commands and publishes them: the one write path (CLI and HTTP API alike) into Kafka.

Resolves a label selector to explicit worker ids from the live registry at publish time, so the
expected set of a rollout is written into the log; an empty match is refused, never a success.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from controlplane.bus import Producer
from controlplane.errors import CommandRejected, ErrorCode
from controlplane.protocol import Command, CommandSpec, Selector, encode, utcnow
from controlplane.registry import Registry
from controlplane.settings import KafkaSettings
from controlplane.topics import command_key


def new_id(prefix: str) -> str:
    return f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def build_command(
    spec: CommandSpec,
    selector: Selector,
    *,
    issuer: str,
    ttl_s: float = 3600.0,
    timeout_s: float | None = None,
    rollout_id: str | None = None,
    command_id: str | None = None,
    now: datetime | None = None,
) -> Command:
    issued = now or utcnow()
    rid = rollout_id or new_id("r")
    return Command(
        command_id=command_id or f"{rid}.c1",
        rollout_id=rid,
        issued_at=issued,
        expires_at=issued + timedelta(seconds=ttl_s),
        issuer=issuer,
        selector=selector,
        spec=spec,
        timeout_s=timeout_s,
    )


def resolve_selector(selector: Selector, registry: Registry, now: datetime) -> Selector:
    """Pin the selector to the live workers it matches now (the rollout's expected set)."""
    matched = [w.worker_id for w in registry.matching(selector, now)]
    if not matched:
        raise CommandRejected(
            f"no live worker matches {selector.model_dump(exclude_none=True)}; "
            "check `controlplane workers`",
            code=ErrorCode.NO_MATCHING_WORKERS,
        )
    return selector.model_copy(update={"worker_ids": sorted(matched)})


async def publish(
    settings: KafkaSettings, command: Command, producer: Producer | None = None
) -> int:
    """Publish ``command``; returns its offset on the commands topic."""
    if producer is not None:
        record = await producer.send(
            settings.topics.commands.name, encode(command), key=command_key(command.rollout_id)
        )
        return record.offset
    async with Producer(settings) as own:
        record = await own.send(
            settings.topics.commands.name, encode(command), key=command_key(command.rollout_id)
        )
    return record.offset
