"""The coordinator service: a replica of the log (Follower + Fleet) with a write path into Kafka.

Rebuilt from the topics on start, so a restart shows the same status; then follows live and
fans changes out to subscribers (server-sent events). Holds no state of its own. HTTP lives in
api.py; process settings, signals and uvicorn in the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.coordinator.controller import Controller
from controlplane.coordinator.follower import Batch, Follower, verify_command
from controlplane.coordinator.publisher import (
    RolloutRequest,
    prepare_rollout,
    publish,
    publish_control,
)
from controlplane.coordinator.snapshots import Captured, Manifest, Snapshots
from controlplane.kafka.bus import Producer
from controlplane.kafka.client import collector_paused
from controlplane.kafka.lifecycle import AsyncService
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import (
    DEFAULT_MAX_ENDED_ROLLOUTS,
    DEFAULT_MAX_ENDED_WORKERS,
    DEFAULT_PROGRESS_DEADLINE_S,
    Fleet,
)
from controlplane.rollout.targets import ControlState
from controlplane.wire.channels import ACKS, COMMANDS, CONTROL
from controlplane.wire.errors import CommandRejected, ControlPlaneError, LocalCode
from controlplane.wire.messages import CommandKind, WireModel
from controlplane.wire.protocol import Command, CommandSpec, Selector, utcnow
from controlplane.wire.signing import (
    Signer,
    Verifier,
    command_object,
    fingerprint,
    load_private_key,
    public_key_text,
    read_trust_store,
    store_digest,
)

log = logging.getLogger(__name__)

ENV_PREFIX = "FLEET_COORDINATOR_"

#: What a change-feed subscriber gets instead of the changes it fell behind on (its queue
#: was full): re-read everything.
RESYNC: Final = "*resync"
#: Change sets a subscriber may have waiting before it is told to resync instead.
SUBSCRIBER_QUEUE: Final = 64
#: How often ended rollouts beyond ``max_ended_rollouts`` are summarized.
COMPACT_EVERY_S: Final = 10.0
#: Compaction idles this many times what judging one rollout cost before the next.
COMPACT_IDLE_PER_COST: Final = 1.0


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
    max_ended_rollouts: int = Field(
        default=DEFAULT_MAX_ENDED_ROLLOUTS,
        ge=0,
        description="Ended rollouts kept in full; older ones are kept as a final summary "
        "(phase, reason, counts, times), their per-worker details dropped.",
    )
    max_ended_workers: int = Field(
        default=DEFAULT_MAX_ENDED_WORKERS,
        ge=0,
        description="And at most the newest ended rollouts that hold this many workers' reports "
        "together (about 0.5 KB each) in full: memory bounded whatever the fleet's size (the "
        "newest ended rollout is always kept in full).",
    )
    issuer: str = "coordinator"
    probe_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="How often the coordinator appends a probe to the workers topic and reads "
        "it back: it judges liveness only up to the last one read (docs/rollouts.md, Liveness).",
    )
    controller: bool = Field(
        default=True,
        description="Campaign for the controller (progressive rollouts, targets): one "
        "coordinator of the fleet leads, the others stand by (docs/controller.md).",
    )
    controller_session_timeout_ms: int = Field(
        default=10_000,
        ge=6_000,
        le=300_000,
        description="How long a silent controller keeps the lead before another takes over.",
    )
    snapshot_interval_s: float = Field(
        default=300.0,
        ge=0,
        description="How often, once caught up, the coordinator writes a snapshot of its fold "
        "to the snapshots topic (when commands, acks or control records came since the last "
        "one), so that a restart folds only the tail (0: never; docs/architecture.md, "
        "Snapshots).",
    )
    snapshot_restore: bool = Field(
        default=True,
        description="At start, restore the fold from the best valid snapshot and read only "
        "the log after it; false: always replay the log in full.",
    )
    snapshot_writer: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]{1,128}$",
        description="This coordinator's id on the snapshots topic (its latest snapshot is "
        "kept under it); default: the host name. Give each coordinator of a fleet its own.",
    )
    trust_store: Path | None = Field(
        default=None,
        description="The command trust store (the workers' format, docs/signing.md): with one, "
        "a command it does not verify never becomes or changes a rollout; it is listed as "
        "COMMAND_UNVERIFIED. Give the coordinators the store the workers hold.",
    )
    signing_key: Path | None = Field(
        default=None,
        description="The Ed25519 private key (PEM) the coordinator signs its own commands with "
        "(API posts, progressive waves, rollbacks); its public key must be in ``trust_store``.",
    )
    signing_key_id: str | None = Field(
        default=None,
        description="The id of ``signing_key`` in the trust store; default: its fingerprint.",
    )
    max_ttl_s: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="Commands that claim a longer ttl_s are unverified (the workers refuse them).",
    )
    api_read_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for the API's reads (GET /api/v1/...); without one, reads are "
        "open. The write token (api_token) reads too.",
    )


#: The kinds the coordinator's own commands have: its key's scope must allow both.
SIGNED_KINDS: Final = (CommandKind.RELOAD_WEIGHTS, CommandKind.UPDATE_CONFIG)


@dataclass(frozen=True)
class Trust:
    """What a coordinator verifies commands with, and signs its own with (None: nothing)."""

    verifier: Verifier | None = None
    signer: Signer | None = None
    #: The sha256 of the trust store (a snapshot folded under another store is not restored).
    digest: str | None = None


def load_trust(settings: CoordinatorSettings) -> Trust:
    """The trust store and signing key ``settings`` name, read once; SETTINGS_INVALID for one
    that cannot be read, a key id without a key, a key without a store, or a key its own store
    does not trust with reload_weights and update_config (its commands would be unverified by
    itself, and refused by the workers)."""
    if settings.signing_key is None:
        if settings.signing_key_id is not None:
            raise _invalid("signing_key_id without signing_key: give the key to sign with")
        if settings.trust_store is None:
            return Trust()
    elif settings.trust_store is None:
        raise _invalid(
            "signing_key without trust_store: the coordinator verifies commands, its own too,"
            " with the store the workers hold"
        )
    assert settings.trust_store is not None
    store = read_trust_store(settings.trust_store)
    trust = Trust(Verifier(store), None, store_digest(store))
    if settings.signing_key is None:
        return trust
    path = settings.signing_key
    try:
        pem = path.read_bytes()
    except OSError as exc:
        raise _invalid(f"signing key {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    key = load_private_key(pem, source=f"signing key {str(path)!r}")
    key_id = settings.signing_key_id or fingerprint(key.public_key())
    where = f"trust store {str(settings.trust_store)!r}"
    trusted = store.keys.get(key_id)
    if key_id in store.revoked:
        raise _invalid(f"signing key id {key_id!r} is revoked in its own {where}")
    if trusted is None:
        raise _invalid(f"signing key id {key_id!r} is not in its own {where}")
    if trusted.public_key != public_key_text(key.public_key()):
        raise _invalid(
            f"signing key {str(path)!r} is not the key {key_id!r} of its own {where}"
            " (another public key)"
        )
    kinds = trusted.scope.kinds
    missing = [k.value for k in SIGNED_KINDS if kinds is not None and k not in kinds]
    if missing:
        raise _invalid(
            f"signing key {key_id!r} may not sign {', '.join(missing)} in its own {where}:"
            " the coordinator's commands (API posts, progressive waves, rollbacks) need both"
        )
    return Trust(trust.verifier, Signer(key, key_id), trust.digest)


def _invalid(message: str) -> ControlPlaneError:
    return ControlPlaneError(message, code=LocalCode.SETTINGS_INVALID)


class Coordinator(AsyncService):
    """``async with Coordinator(settings) as c:`` runs the follower in the background."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        clock: Callable[[], datetime] = utcnow,
        current_as_of: Callable[[], datetime | None] | None = None,
    ) -> None:
        """``current_as_of``: up to when the replica knows it has read the whole log (None:
        not known); the follower's by default. Tests pass their clock."""
        self.settings = settings
        self.clock = clock
        self.trust = load_trust(settings)
        self.signer = self.trust.signer
        self.fleet = Fleet(
            progress_deadline_s=settings.progress_deadline_s,
            max_ended_rollouts=settings.max_ended_rollouts,
            max_ended_workers=settings.max_ended_workers,
        )
        self.control = ControlState()
        self.follower = Follower(
            settings.kafka,
            self.fleet,
            probe=True,
            probe_interval_s=settings.probe_interval_s,
            control=self.control,
            control_optional=True,
            verifier=self.trust.verifier,
            max_ttl_s=settings.max_ttl_s,
        )
        self.follower.listeners.append(self._on_batch)
        self.controller: Controller | None = None
        if settings.controller:
            self.controller = Controller(
                settings.kafka,
                self.follower,
                self.judge_time,
                issuer=settings.issuer,
                session_timeout_ms=settings.controller_session_timeout_ms,
                signer=self.signer,
                verify=self.verify if self.trust.verifier is not None else None,
            )
        self._controller_task: asyncio.Task[None] | None = None
        fold: dict[str, float | int | str | None] = {
            "progress_deadline_s": settings.progress_deadline_s,
            "max_ended_rollouts": settings.max_ended_rollouts,
            "max_ended_workers": settings.max_ended_workers,
        }
        if self.trust.digest is not None:  # folded under another store, a snapshot is not used
            fold["trust_store"] = self.trust.digest
            fold["max_ttl_s"] = settings.max_ttl_s  # nor one that verified other TTLs
        self.snapshots = Snapshots(
            settings.kafka,
            self.fleet,
            self.control,
            writer=settings.snapshot_writer or default_writer(),
            fold=fold,
        )
        #: The partitions a snapshot covers (commands, acks, controller), found at start.
        self._covered: set[tuple[str, int]] = set()
        self._snapshot_at = time.monotonic()
        #: What the last snapshot was of: its offsets and the rollouts summarized then.
        self._snapshot_of: tuple[dict[tuple[str, int], int], int] | None = None
        self._writing: asyncio.Task[Manifest | None] | None = None
        self._current_as_of = current_as_of or self.follower.current_as_of
        self._producer = Producer(settings.kafka)
        self._subscribers: set[asyncio.Queue[set[str] | None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._compaction: asyncio.Task[int] | None = None
        self._compacted_at = time.monotonic()
        #: Whether a compaction pass ran to its end since the log was read: until then the fold
        #: may hold, in full, ended rollouts it summarizes (a whole replayed history).
        self._compacted_once = False
        self.started_at = clock()

    @property
    def ready(self) -> bool:
        return self.follower.caught_up.is_set()

    def judge_time(self) -> datetime | None:
        """The instant to judge status and liveness at: ``min(clock, current_as_of)``, never
        later than the replica knows the log (cut off from Kafka, it knows nothing about
        workers since: no false ``lost``). None while it has not caught up."""
        if not self.ready:
            return None
        as_of = self._current_as_of()
        if as_of is None:
            return None
        return min(self.clock(), as_of)

    def now(self) -> datetime:
        """:meth:`judge_time`, or the clock while there is none (callers that must answer)."""
        when = self.judge_time()
        return self.clock() if when is None else when

    def compact(self) -> int:
        """Summarize ended rollouts beyond ``max_ended_rollouts`` (see :meth:`Fleet.compact`)."""
        when = self.judge_time()
        self._compacted_at = time.monotonic()
        return 0 if when is None else self.fleet.compact(when)

    async def compact_stepwise(self) -> int:
        """:meth:`compact`, one rollout judged at a time with the loop free between two (and
        idle for as long as each judgment took: at most half the loop), so that the first
        compaction after a restart with a long history never blocks the fold or the API.
        Rollouts a reader's judgment already found ended are not judged again."""
        self._compacted_at = time.monotonic()
        fleet = self.fleet
        if fleet.max_ended_rollouts is None:
            self._compacted_once = self.ready
            return 0
        for rollout_id in fleet.unended():
            when = self.judge_time()
            if when is None:
                return 0
            started = time.monotonic()
            if rollout_id in fleet:
                with collector_paused():  # makes no cycles; see collector_paused
                    fleet.check_ended(rollout_id, when)
            await asyncio.sleep(COMPACT_IDLE_PER_COST * (time.monotonic() - started))
        when = self.judge_time()
        if when is None:
            return 0
        with collector_paused():  # at most about 2 * max_unverified entries: one step
            fleet.compact_unverified(when)
        summarized = 0
        for rollout_id in fleet.excess():
            when = self.judge_time()
            if when is None:
                break
            started = time.monotonic()
            if fleet.ended(rollout_id) is not None and not fleet.is_summarized(rollout_id):
                with collector_paused():
                    fleet.summarize(rollout_id, when)
                summarized += 1
            await asyncio.sleep(COMPACT_IDLE_PER_COST * (time.monotonic() - started))
        if summarized:
            log.info(
                "summarized %d ended rollout(s) beyond the last %d",
                summarized,
                fleet.max_ended_rollouts,
            )
        self._compacted_once = True
        return summarized

    async def start(self) -> None:
        await self._restore()
        await self.follower.start()
        await self._producer.start()
        self._task = asyncio.create_task(self._run(), name="coordinator-follower")
        if self.controller is not None and not self.follower.control_missing:
            self._controller_task = asyncio.create_task(
                self._run_controller(self.controller), name="coordinator-controller"
            )

    async def stop(self) -> None:
        if self._controller_task is not None:
            self._controller_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._controller_task
        for task in (self._task, self._compaction, self._writing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for queue in list(self._subscribers):
            _offer(queue, None)
        await self._producer.stop()
        await self.follower.stop()

    # ------------------------------------------------------------------ snapshots

    async def _restore(self) -> None:
        """Before the follower starts: restore the fold from the best valid snapshot and have
        the follower resume the partitions it covers where it was taken (see snapshots.py).
        Nothing restored (none, none valid, off, or anything failing): a full replay."""
        topics = self.settings.kafka.topics
        names = [COMMANDS.topic(topics), ACKS.topic(topics), CONTROL.topic(topics)]
        try:
            partitions = await self.snapshots.partitions(names)
            self._covered = {(t, p) for t, ps in partitions.items() for p in ps}
            offsets = await self.snapshots.restore(partitions, use=self.settings.snapshot_restore)
        except Exception as exc:  # never keep a coordinator from starting: replay in full
            if self.fleet.stats().commands or self.control.records:
                raise  # restored partly: unreachable (restores are all or nothing), but never go on
            log.warning("full replay of the log: reading the snapshots failed: %s", _described(exc))
            self.snapshots.replayed(f"reading the snapshots failed: {_described(exc)}")
            return
        self.follower.resume_at(offsets)
        if offsets:
            self._snapshot_of = (offsets, self.fleet.stats().compacted)

    def _snapshot_due(self) -> bool:
        interval = self.settings.snapshot_interval_s
        compaction = self._compaction
        return (
            interval > 0
            and self.ready
            and self.snapshots.topic_exists
            and bool(self._covered)
            and (self._writing is None or self._writing.done())
            and (compaction is None or compaction.done())
            # Never the fold of a replay before its first compaction: a snapshot would carry
            # every ended rollout of the history in full (155 MB instead of ~20 at 10,000
            # workers x 100 rollouts), and so would every start restored from it.
            and self._compacted_once
            and time.monotonic() - self._snapshot_at >= interval
        )

    async def snapshot(self) -> bool:
        """Capture the fold now (the caller folds nothing meanwhile: the loop calls it between
        two polls) and start writing it; False when there is nothing new to write (the same
        offsets as the last one, and no rollout summarized since) or a position is not known."""
        self._snapshot_at = time.monotonic()
        offsets = self.follower.positions({t for t, _ in self._covered})
        of = (offsets, self.fleet.stats().compacted)
        if set(offsets) != self._covered or of == self._snapshot_of:
            return False
        control = self.follower.follows(CONTROL.topic(self.settings.kafka.topics))
        captured = await self.snapshots.capture(offsets, control=control)
        self._snapshot_of = of
        self._writing = asyncio.create_task(self._write_snapshot(captured), name="snapshot")
        return True

    async def _write_snapshot(self, captured: Captured) -> Manifest | None:
        try:
            return await self.snapshots.write(captured, self._producer)
        except ControlPlaneError as exc:
            self._snapshot_of = None  # written again at the next interval
            log.warning("error: %s: the snapshot was not written: %s", exc.code, exc.message)
        except Exception as exc:
            self._snapshot_of = None
            log.warning("the snapshot was not written: %s", _described(exc))
        return None

    async def wait_ready(self, timeout: float = 60.0) -> None:
        await asyncio.wait_for(self.follower.caught_up.wait(), timeout)

    @staticmethod
    async def _run_controller(controller: Controller) -> None:
        while True:
            try:
                await controller.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Kafka away while joining: campaign again
                controller.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("controller stopped: %s; campaigning again", controller.last_error)
                await asyncio.sleep(1.0)

    async def _run(self) -> None:
        while True:
            try:
                await self.follower.poll(timeout_s=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Kafka away: keep serving what we have, retry
                log.warning("follower poll failed: %s", exc)
                await asyncio.sleep(1.0)
            if self._snapshot_due():
                try:
                    await self.snapshot()
                except Exception as exc:  # never stop folding for a snapshot
                    log.warning("the snapshot was not captured: %s", _described(exc))
            compaction = self._compaction
            compacting = compaction is not None and not compaction.done()
            if compaction is not None and compaction.done() and not compaction.cancelled():
                self._compaction = None
                if compaction.exception() is not None:
                    log.warning("compaction failed: %r", compaction.exception())
            due = time.monotonic() - self._compacted_at >= COMPACT_EVERY_S
            if not compacting and (due or (self.ready and not self._compacted_once)):
                self._compacted_at = time.monotonic()
                self._compaction = asyncio.create_task(
                    self.compact_stepwise(), name="coordinator-compaction"
                )

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
        """Resolve the selector against live workers, publish the command; returns it.

        Refuses a rollout id that is already in the log (``ROLLOUT_EXISTS``): workers would
        skip the new command as a duplicate and the old status would answer for it."""
        request = RolloutRequest(spec, selector, ttl_s, timeout_s, rollout_id)
        return await self.publish_rollout(request, issuer=issuer)

    async def publish_rollout(
        self, request: RolloutRequest, *, issuer: str | None = None
    ) -> Command:
        """:meth:`create_rollout` for a request already made: issued by the clock, its workers
        those alive at :meth:`now`."""
        now = self.clock()
        command = prepare_rollout(
            request,
            self.fleet,
            as_of=self.now(),
            now=now,
            issuer=issuer or self.settings.issuer,
            signer=self.signer,
        )
        self._check_own(command)
        await publish(self.settings.kafka, command, self._producer)
        return command

    def verify(self, command: Command) -> None:
        """What the follower checks of a command read from the log, for one this coordinator
        built (its JSON as our encoder writes it): CommandRejected with the code, or nothing
        (also without a trust store)."""
        verifier = self.trust.verifier
        if verifier is not None:
            verify_command(
                verifier, command, command_object(command), max_ttl_s=self.settings.max_ttl_s
            )

    def _check_own(self, command: Command) -> None:
        """Refuse, before publishing, a command its own store would not verify (a selector or
        path outside its key's scope, or no signing key at all): it would be no rollout here,
        and every worker would refuse it. SCOPE_DENIED, SIGNATURE_MISSING (or the verifier's
        code)."""
        if self.trust.verifier is None:
            return
        try:
            self.verify(command)
        except CommandRejected as exc:
            signer = self.signer
            who = (
                "the coordinator has no signing key (FLEET_COORDINATOR_SIGNING_KEY) and its trust"
                " store takes signed commands only"
                if signer is None
                else f"the coordinator's key {signer.key_id!r} may not sign this command"
            )
            raise CommandRejected(f"not published: {who}: {exc.message}", code=exc.code) from None

    async def publish_control(self, record: WireModel) -> int:
        """Append an operator's request (a target spec, a rollout, an action) to the controller
        topic through this coordinator's producer; its offset (see :func:`publish_control`)."""
        return await publish_control(self.settings.kafka, record, self._producer)

    # ------------------------------------------------------------------ change feed

    def _on_batch(self, batch: Batch) -> None:
        changed = batch.rollout_ids
        if batch.heartbeats:
            changed.add("*workers")
        for record in batch.control:
            rollout_id = getattr(record, "rollout_id", None)
            changed.add(rollout_id if isinstance(rollout_id, str) else "*targets")
        if batch.control:
            changed.add("*targets")
        for queue in self._subscribers:
            _offer(queue, changed)

    @property
    def subscribers(self) -> int:
        """Change-feed subscribers (open SSE streams, waits for a rollout)."""
        return len(self._subscribers)

    @property
    def backlog(self) -> int:
        """Change sets queued for subscribers and not yet taken (bounded per subscriber)."""
        return sum(queue.qsize() for queue in self._subscribers)

    async def changes(
        self, tick_s: float = 1.0, *, maxsize: int = SUBSCRIBER_QUEUE
    ) -> AsyncGenerator[set[str], None]:
        """Sets of changed rollout ids ("*workers" for the registry); an empty set every tick.

        A subscriber that falls ``maxsize`` sets behind gets ``{RESYNC}`` instead of them:
        memory stays bounded whatever a slow client does."""
        queue: asyncio.Queue[set[str] | None] = asyncio.Queue(maxsize=max(2, maxsize))
        self._subscribers.add(queue)
        try:
            while True:
                try:
                    async with asyncio.timeout(tick_s):  # not wait_for: see Controller._wait_change
                        item = await queue.get()
                except TimeoutError:
                    item = set()
                if item is None:
                    return
                yield item
        finally:
            self._subscribers.discard(queue)


def default_writer() -> str:
    """The host name, as a snapshot writer id (characters outside ``[A-Za-z0-9._-]`` as ``-``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:128]
    return name or "coordinator"


def _described(exc: BaseException) -> str:
    if isinstance(exc, ControlPlaneError):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


def _offer(queue: asyncio.Queue[set[str] | None], item: set[str] | None) -> None:
    """Queue ``item``; when the queue is full, replace what waits by one resync (and ``None``,
    the end, if that is what came)."""
    try:
        queue.put_nowait(item)
        return
    except asyncio.QueueFull:
        pass
    ended = item is None
    while not queue.empty():
        ended = ended or queue.get_nowait() is None
    queue.put_nowait({RESYNC})
    if ended:
        queue.put_nowait(None)
