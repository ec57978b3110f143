"""Builds commands and publishes them: the one write path (CLI and HTTP API alike) into Kafka.

Both make a rollout the same way: :func:`prepare_rollout` (no I/O) turns a
:class:`RolloutRequest` into the command, against the fleet as the caller has read it, then
:func:`publish` writes it.

Resolves a label selector to explicit worker ids from the live registry at publish time, so the
expected set of a rollout is written into the log; an empty match is refused, never a success.
A rollout id already in the log is refused (workers would skip the new command as a duplicate
and a waiter would read the old status); every publish gets a command id of its own.

A publish is bounded by the delivery timeout: BROKER_UNAVAILABLE means the command was not
published; :class:`PublishUnconfirmed` (PUBLISH_OUTCOME_UNKNOWN) means it may have been, and
says which rollout to look for.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Container
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Final

from controlplane.kafka.bus import Delivery, Producer, Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.registry import Registry
from controlplane.wire.channels import COMMANDS, CONTROL
from controlplane.wire.errors import BusError, CommandRejected, LocalCode, WireCode
from controlplane.wire.messages import WireModel
from controlplane.wire.protocol import Command, CommandSpec, Selector, utcnow
from controlplane.wire.signing import Signer

if TYPE_CHECKING:
    from controlplane.rollout.fleet import Fleet

#: The longest TTL a command may ask for: the workers' default ``max_ttl_s`` (7 days), which
#: they enforce with a TTL_TOO_LONG rejection; refused here first.
MAX_TTL_S: Final = 7 * 24 * 3600.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def new_command_id(rollout_id: str) -> str:
    """Unique per publish: not guessable from the rollout id (a forged or unreadable record
    under a guessed id must never make workers skip the real command as a duplicate)."""
    return f"{rollout_id}.c-{secrets.token_hex(6)}"


def check_ttl(ttl_s: float) -> None:
    """Refuse a TTL above :data:`MAX_TTL_S` (TTL_TOO_LONG) or not positive (SCHEMA_INVALID)."""
    if not ttl_s > 0:
        raise CommandRejected(
            f"ttl must be a positive number of seconds, got {ttl_s}", code=WireCode.SCHEMA_INVALID
        )
    if ttl_s > MAX_TTL_S:
        raise CommandRejected(
            f"ttl {ttl_s:g} s is longer than the maximum {MAX_TTL_S:g} s (7 days)",
            code=WireCode.TTL_TOO_LONG,
        )


def check_new_rollout(rollout_id: str, known: Container[str]) -> None:
    """Refuse a rollout id already in the log (``known``: a Fleet that has caught up)."""
    if rollout_id in known:
        raise CommandRejected(
            f"rollout {rollout_id!r} already exists in the log; choose another id "
            "(or let one be generated)",
            code=LocalCode.ROLLOUT_EXISTS,
        )


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
    signer: Signer | None = None,
) -> Command:
    """A new command; signed by ``signer`` when given (controlplane/wire/signing.py)."""
    check_ttl(ttl_s)
    issued = now or utcnow()
    rid = rollout_id or new_id("r")
    command = Command(
        command_id=command_id or new_command_id(rid),
        rollout_id=rid,
        issued_at=issued,
        expires_at=issued + timedelta(seconds=ttl_s),
        issuer=issuer,
        selector=selector,
        spec=spec,
        timeout_s=timeout_s,
    )
    return command if signer is None else signer.sign(command)


def resolve_selector(selector: Selector, registry: Registry, now: datetime) -> Selector:
    """Pin the selector to the live workers it matches now (the rollout's expected set)."""
    matched = [w.worker_id for w in registry.matching(selector, now)]
    if not matched:
        raise CommandRejected(
            f"no live worker matches {selector.model_dump(exclude_none=True)}; "
            "check `controlplane workers`",
            code=LocalCode.NO_MATCHING_WORKERS,
        )
    return selector.model_copy(update={"worker_ids": sorted(matched)})


@dataclass(frozen=True)
class RolloutRequest:
    """What a rollout asks for, before its selector is resolved against the fleet."""

    spec: CommandSpec
    selector: Selector
    ttl_s: float = 3600.0
    timeout_s: float | None = None
    #: Generated when None; one already in the log is refused (ROLLOUT_EXISTS).
    rollout_id: str | None = None


def prepare_rollout(
    request: RolloutRequest,
    fleet: Fleet,
    *,
    as_of: datetime,
    now: datetime,
    issuer: str,
    signer: Signer | None = None,
) -> Command:
    """The command for ``request``, no I/O: its rollout id is new to ``fleet`` (a fleet that
    has read the whole log), its selector is pinned to the workers alive at ``as_of`` (the
    rollout's expected set; none is NO_MATCHING_WORKERS), and it is issued at ``now``.

    ``as_of`` is the caller's: the CLI judges as of what its reader has read, the coordinator
    as of :meth:`~controlplane.coordinator.service.Coordinator.now`. Signed by ``signer``
    when given."""
    if request.rollout_id is not None:
        check_new_rollout(request.rollout_id, fleet)
    pinned = resolve_selector(request.selector, fleet.registry, as_of)
    return build_command(
        request.spec,
        pinned,
        issuer=issuer,
        ttl_s=request.ttl_s,
        timeout_s=request.timeout_s,
        rollout_id=request.rollout_id,
        now=now,
        signer=signer,
    )


class PublishUnconfirmed(BusError):
    """PUBLISH_OUTCOME_UNKNOWN for one command: handed to the producer but not confirmed in
    time, so it may be in the log (or land there later). Carries the command, and the
    :class:`~controlplane.kafka.bus.Delivery` to wait on again while its producer is open.

    (A subclass here rather than in errors.py: it carries a Command, and errors.py has no
    wire types.)"""

    def __init__(self, command: Command, delivery: Delivery, why: str, timeout_s: float) -> None:
        self.command = command
        self.delivery = delivery
        self.why = why
        #: How long the publish waited for the confirmation.
        self.timeout_s = timeout_s
        super().__init__(
            f"rollout {command.rollout_id} (command {command.command_id}) may have been "
            f"published: {why}; check `controlplane status {command.rollout_id}` before "
            "publishing it again",
            code=LocalCode.PUBLISH_OUTCOME_UNKNOWN,
        )

    @property
    def rollout_id(self) -> str:
        return self.command.rollout_id

    @property
    def command_id(self) -> str:
        return self.command.command_id


async def publish(
    settings: KafkaSettings,
    command: Command,
    producer: Producer | None = None,
    *,
    timeout_s: float | None = None,
) -> int:
    """Publish ``command``; returns its offset on the commands topic.

    Bounded by ``timeout_s`` (default: ``settings.delivery_timeout_ms``): BROKER_UNAVAILABLE
    when it certainly was not published, :class:`PublishUnconfirmed` when it may have been
    (with a ``producer`` of the caller's, its delivery can be waited on again)."""
    limit = settings.delivery_timeout_ms / 1000 if timeout_s is None else timeout_s
    if producer is not None:
        return (await _send(settings, command, producer, limit)).offset
    async with Producer(settings) as own:
        record = await _send(settings, command, own, limit)
    return record.offset


async def _send(
    settings: KafkaSettings, command: Command, producer: Producer, limit: float
) -> Record:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    topic, key, value = COMMANDS.record(settings.topics, command)
    delivery = await producer.submit(topic, value, key=key, timeout_s=limit)
    try:
        return await delivery.wait(max(0.0, deadline - loop.time()))
    except BusError as exc:
        if exc.code is not LocalCode.PUBLISH_OUTCOME_UNKNOWN:
            raise
        why = (
            f"{delivery.topic} did not confirm it within {limit:g} s (Kafka unreachable, or "
            "fewer in-sync replicas than min.insync.replicas?)"
        )
        raise PublishUnconfirmed(command, delivery, why, limit) from None


async def publish_control(
    settings: KafkaSettings,
    record: WireModel,
    producer: Producer | None = None,
    *,
    timeout_s: float | None = None,
) -> int:
    """Append an operator's request (a target spec, a rollout, an action) to the controller
    topic; returns its offset. Bounded like :func:`publish`: BROKER_UNAVAILABLE when it was
    certainly not written, PUBLISH_OUTCOME_UNKNOWN when it may have been."""
    limit = settings.delivery_timeout_ms / 1000 if timeout_s is None else timeout_s
    topic, key, value = CONTROL.record(settings.topics, record)
    if producer is None:
        async with Producer(settings) as own:
            return await _send_control(own, topic, key, value, limit)
    return await _send_control(producer, topic, key, value, limit)


async def _send_control(
    producer: Producer, topic: str, key: bytes, value: bytes, limit: float
) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    delivery = await producer.submit(topic, value, key=key, timeout_s=limit)
    return (await delivery.wait(max(0.0, deadline - loop.time()))).offset
