"""Snapshots of the coordinator's fold on a compacted topic, so that a restart folds only the tail.

A snapshot is the fold's state at a batch boundary (between two polls of the follower: every
record before the partitions' positions folded, none after) and those positions, for the
commands, acks and controller partitions. The workers topic is not covered: it is compacted to
about one record per worker and read whole at every start, so the registry, liveness
(``received_at``) and the in-flight spans are exactly what a full replay gives.

On ``<prefix>.snapshots`` (compacted, one partition; ``topics.snapshots``), keys are

- ``chunk/<writer>/<snapshot id>/<i>``: the i-th piece (at most :data:`CHUNK_BYTES`) of the
  payload, a sequence of length-prefixed msgpack sections (:class:`_Section`);
- ``manifest/<writer>``: JSON :class:`Manifest`, written once every chunk is confirmed: the
  format version, the offsets, each chunk's sha256, when and by whom it was written, and the
  fold's settings (with a trust store, its sha256: the commands a snapshot holds were verified
  by that store, so one made under another is not restored and the log is replayed).

Each writer's manifest key holds its latest snapshot; the writer tombstones its older chunks only
after the new manifest is confirmed, so the latest manifest of a key always names chunks that
exist (several coordinators may write, each under its own writer id; two with the same id only
waste space). At start, a coordinator reads the (small) topic, ranks the manifests (covering the
most records first, then the newest), takes the first that is valid and falls back on the next,
and on a full replay when none is: never a crash, never a state that a full replay would not give.
Each rejection is logged with its code (:class:`~controlplane.wire.errors.LocalCode`
``SNAPSHOT_*``).

Pure where it can be: :func:`encode_sections` / :func:`decode_payload` are the codec; the
:class:`Snapshots` class does the Kafka side.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import msgspec
from pydantic import BaseModel, ConfigDict

from controlplane.kafka.bus import Consumer, Producer, collector_paused
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet, FoldState
from controlplane.rollout.ledger import CommandLedger, Report, WorkerLedger
from controlplane.rollout.models import RolloutStatus, UnverifiedCommand
from controlplane.rollout.targets import ControlState, Rollout, StableEntry, Target
from controlplane.rollout.track import Abort
from controlplane.wire.codec import decode_command, encode
from controlplane.wire.control import (
    Desired,
    LeaderRecord,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    TargetSpec,
    decode_control,
)
from controlplane.wire.errors import BusError, ControlPlaneError, LocalCode
from controlplane.wire.protocol import AckError, Command
from controlplane.wire.topics import snapshot_key

log = logging.getLogger(__name__)

#: The payload's format; a manifest of another is rejected (SNAPSHOT_VERSION_UNKNOWN).
FORMAT: Final = 2
#: The largest chunk: under Kafka's default 1 MiB ``max.message.bytes`` with room for the key.
CHUNK_BYTES: Final = 900_000
#: Rollouts' commands per section (a section is encoded in one go, the loop free between two;
#: a command pinned to 10,000 workers takes about 10 ms to encode).
COMMANDS_PER_SECTION: Final = 1
MANIFEST: Final = "manifest"
CHUNK: Final = "chunk"
_WRITER: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")
_LENGTH: Final = 4


class SnapshotError(ControlPlaneError):
    """A snapshot that cannot be used (its code says why)."""


# --------------------------------------------------------------------------- the payload


class _FleetSection(msgspec.Struct, tag="fleet"):
    commands_seen: int
    acks_seen: int
    dropped_acks: int
    ended: list[tuple[str, datetime]]
    aborts: list[tuple[str, datetime, str]]
    #: (the status's JSON, its command ids)
    summaries: list[tuple[bytes, list[str]]]
    #: (issued_at, rollout id, version, the workers it is desired for)
    summary_desired: list[tuple[datetime, str, str, list[str]]]
    #: (rollout id, command id, worker id, its earliest NACK)
    unreadable: list[tuple[str, str, str, Report]]
    #: The commands the trust store did not verify (each an UnverifiedCommand's JSON).
    unverified: list[bytes]
    #: (rollout id, command id) of unverified commands whose NACKs were dropped, oldest first.
    forged: list[tuple[str, str]] = []
    unverified_dropped: int = 0


class _CommandsSection(msgspec.Struct, tag="commands"):
    #: (rollout id, its commands as on the wire)
    rollouts: list[tuple[str, list[bytes]]]


class _LedgerSection(msgspec.Struct, tag="ledger"):
    rollout_id: str
    command_id: str
    acks: int
    workers: dict[str, WorkerLedger]


#: A stable state: (the Desired's JSON, the rollout that made it, since)
_Stable = tuple[bytes, str | None, datetime]


class _ControlSection(msgspec.Struct, tag="control"):
    #: (the spec as on the wire, its history)
    targets: list[tuple[bytes, list[_Stable]]]
    #: (the spec, seq, its actions, its state), each record as on the wire
    rollouts: list[tuple[bytes, int, list[bytes], bytes | None]]
    leader: bytes | None
    records: int
    early_actions: list[tuple[str, list[bytes]]]
    early_stables: list[tuple[str, list[_Stable]]]


_Section = _FleetSection | _CommandsSection | _LedgerSection | _ControlSection


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, BaseModel):  # an AckError in a Report
        return obj.model_dump(mode="json")
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is AckError:
        return AckError.model_validate(obj)
    raise NotImplementedError(f"cannot decode {kind!r}")


_ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER: Final = msgspec.msgpack.Decoder(_Section, dec_hook=_dec_hook)


def _stables(history: list[StableEntry]) -> list[_Stable]:
    return [(encode(e.desired), e.rollout_id, e.since) for e in history]


def _history(stables: list[_Stable]) -> list[StableEntry]:
    return [StableEntry(Desired.model_validate_json(d), r, since) for d, r, since in stables]


def sections(fold: FoldState, control: ControlState | None) -> Iterator[Callable[[], bytes]]:
    """The payload's sections, each a function that encodes one (call them in order, nothing
    folding meanwhile): the fleet's small parts, its commands a few rollouts at a time, one
    section per command ledger, then the controller's state."""

    def fleet() -> bytes:
        desired: dict[tuple[datetime, str, str], list[str]] = {}
        for worker_id, value in fold.summary_desired.items():
            desired.setdefault(value, []).append(worker_id)
        return _ENCODER.encode(
            _FleetSection(
                commands_seen=fold.commands_seen,
                acks_seen=fold.acks_seen,
                dropped_acks=fold.dropped_acks,
                ended=list(fold.ended.items()),
                aborts=[(r, a.at, a.reason) for r, a in fold.aborts.items()],
                summaries=[
                    (status.model_dump_json(round_trip=True).encode(), sorted(ids))
                    for status, ids in fold.summaries.values()
                ],
                summary_desired=[(*key, ids) for key, ids in desired.items()],
                unreadable=[
                    (r, c, w, report)
                    for r, nacks in fold.unreadable.items()
                    for (c, w), report in nacks.items()
                ],
                unverified=[
                    entry.model_dump_json(round_trip=True).encode()
                    for held in fold.unverified.values()
                    for entry in held.values()
                ],
                forged=list(fold.forged),
                unverified_dropped=fold.unverified_dropped,
            )
        )

    yield fleet
    rollout_ids = list(fold.commands)
    for start in range(0, len(rollout_ids), COMMANDS_PER_SECTION):
        part = rollout_ids[start : start + COMMANDS_PER_SECTION]

        def commands(part: list[str] = part) -> bytes:
            return _ENCODER.encode(
                _CommandsSection([(r, [encode(c) for c in fold.commands[r]]) for r in part])
            )

        yield commands
    for key in list(fold.ledgers):

        def ledger(key: tuple[str, str] = key) -> bytes:
            held = fold.ledgers[key]
            return _ENCODER.encode(
                _LedgerSection(held.rollout_id, held.command_id, held.acks, held.workers)
            )

        yield ledger
    if control is not None:
        yield lambda: _ENCODER.encode(_control_section(control))


def _control_section(control: ControlState) -> _ControlSection:
    # ControlState (rollout/targets.py) has no export of its own: its parts are read here.
    return _ControlSection(
        targets=[(encode(t.spec), _stables(t.history)) for t in control._targets.values()],
        rollouts=[
            (
                encode(r.spec),
                r.seq,
                [encode(a) for a in r.actions],
                None if r.state is None else encode(r.state),
            )
            for r in control._rollouts.values()
        ],
        leader=None if control.leader is None else encode(control.leader),
        records=control.records,
        early_actions=[
            (r, [encode(a) for a in acts]) for r, acts in control._early_actions.items()
        ],
        early_stables=[(t, _stables(h)) for t, h in control._early_stables.items()],
    )


def frame(section: bytes) -> bytes:
    """One section as it goes in the payload: its length (4 bytes, big-endian), then it."""
    return len(section).to_bytes(_LENGTH, "big") + section


def encode_sections(fold: FoldState, control: ControlState | None) -> bytes:
    """The whole payload in one go (tests; the coordinator encodes it stepwise)."""
    return b"".join(frame(encode_one()) for encode_one in sections(fold, control))


@dataclass
class Decoded:
    """A payload decoded: what to restore."""

    fold: FoldState
    control: ControlState | None


def _split(payload: bytes) -> Iterator[bytes]:
    view = memoryview(payload)
    at = 0
    while at < len(view):
        if at + _LENGTH > len(view):
            raise ValueError("a section's length is cut short")
        size = int.from_bytes(view[at : at + _LENGTH], "big")
        at += _LENGTH
        if at + size > len(view):
            raise ValueError("a section is cut short")
        yield bytes(view[at : at + size])
        at += size


def decode_payload(payload: bytes) -> Decoded:
    """The state a payload holds (SNAPSHOT_CORRUPT when it does not decode)."""
    try:
        return _decode_payload(payload)
    except SnapshotError:
        raise
    except Exception as exc:  # msgspec, pydantic, the wire's decoders: any means corrupt
        raise SnapshotError(
            f"the snapshot's payload does not decode: {type(exc).__name__}: {exc}",
            code=LocalCode.SNAPSHOT_CORRUPT,
        ) from None


def _decode_payload(payload: bytes) -> Decoded:
    fold = FoldState({}, {}, {}, {}, {}, {}, {})
    control: ControlState | None = None
    seen_fleet = False
    for raw in _split(payload):
        section = _DECODER.decode(raw)
        match section:
            case _FleetSection():
                seen_fleet = True
                fold.commands_seen = section.commands_seen
                fold.acks_seen = section.acks_seen
                fold.dropped_acks = section.dropped_acks
                fold.ended = dict(section.ended)
                fold.aborts = {r: Abort(at, reason) for r, at, reason in section.aborts}
                for status_json, ids in section.summaries:
                    status = RolloutStatus.model_validate_json(status_json)
                    fold.summaries[status.rollout_id] = (status, frozenset(ids))
                for issued, rollout_id, version, workers in section.summary_desired:
                    for worker_id in workers:
                        fold.summary_desired[worker_id] = (issued, rollout_id, version)
                for r, c, w, report in section.unreadable:
                    fold.unreadable.setdefault(r, {})[(c, w)] = report
                for entry_json in section.unverified:
                    entry = UnverifiedCommand.model_validate_json(entry_json)
                    fold.unverified.setdefault(entry.rollout_id, {})[entry.command_id] = entry
                fold.forged = dict.fromkeys(section.forged)
                fold.unverified_dropped = section.unverified_dropped
            case _CommandsSection():
                for rollout_id, commands in section.rollouts:
                    fold.commands[rollout_id] = [_command(c) for c in commands]
            case _LedgerSection():
                ledger = CommandLedger(section.rollout_id, section.command_id)
                ledger.acks = section.acks
                ledger.workers = section.workers
                fold.ledgers[(section.rollout_id, section.command_id)] = ledger
            case _ControlSection():
                control = _restore_control(section)
    if not seen_fleet:
        raise SnapshotError("the snapshot has no fleet section", code=LocalCode.SNAPSHOT_CORRUPT)
    return Decoded(fold, control)


def _command(data: bytes) -> Command:
    return decode_command(data)


def _restore_control(section: _ControlSection) -> ControlState:
    control = ControlState()
    for spec_bytes, history in section.targets:
        spec = decode_control(spec_bytes)
        assert isinstance(spec, TargetSpec)
        control._targets[spec.name] = Target(spec, _history(history))
    for spec_bytes, seq, actions, state in section.rollouts:
        rspec = decode_control(spec_bytes)
        assert isinstance(rspec, RolloutSpec)
        rollout = Rollout(rspec, seq)
        for action in actions:
            decoded = decode_control(action)
            assert isinstance(decoded, RolloutAction)
            rollout.actions.append(decoded)
        if state is not None:
            decoded_state = decode_control(state)
            assert isinstance(decoded_state, RolloutState)
            rollout.state = decoded_state
        control._rollouts[rspec.rollout_id] = rollout
    if section.leader is not None:
        leader = decode_control(section.leader)
        assert isinstance(leader, LeaderRecord)
        control.leader = leader
    control.records = section.records
    for rollout_id, actions in section.early_actions:
        early = [decode_control(a) for a in actions]
        assert all(isinstance(a, RolloutAction) for a in early)
        control._early_actions[rollout_id] = early  # type: ignore[assignment]
    for target, history in section.early_stables:
        control._early_stables[target] = _history(history)
    return control


def _check_fresh(control: ControlState) -> None:
    if control.records or control._targets or control._rollouts:
        raise ValueError("a snapshot is restored only into a ControlState that folded nothing")


def restore_control(into: ControlState, restored: ControlState) -> None:
    """Make ``into`` (a fresh ControlState, folded nothing) hold what ``restored`` holds."""
    _check_fresh(into)
    into._targets = restored._targets
    into._rollouts = restored._rollouts
    into.leader = restored.leader
    into.records = restored.records
    into._early_actions = restored._early_actions
    into._early_stables = restored._early_stables


# --------------------------------------------------------------------------- the manifest


class Manifest(msgspec.Struct, frozen=True):
    """What a snapshot is; JSON on the topic under ``manifest/<writer>``."""

    format: int
    writer: str
    snapshot_id: str
    #: Unix seconds, the writer's clock.
    written_at: float
    #: (topic, partition, the next offset to fold) of every partition the snapshot covers.
    offsets: list[tuple[str, int, int]]
    #: Each chunk's sha256 (hex), in order.
    chunks: list[str]
    size: int
    #: The fold's settings it was made with (another coordinator's would judge otherwise).
    fold: dict[str, float | int | str | None]

    @property
    def covered(self) -> int:
        """How many records it covers (the sum of its offsets): the most is the best."""
        return sum(offset for _, _, offset in self.offsets)

    def written(self) -> datetime:
        """When it was written (SNAPSHOT_CORRUPT for a ``written_at`` that is no datetime: not
        finite, or past the years 1-9999)."""
        try:
            return datetime.fromtimestamp(self.written_at, UTC)
        except (ValueError, OverflowError, OSError):
            raise SnapshotError(
                f"the manifest's written_at {self.written_at!r} is no time",
                code=LocalCode.SNAPSHOT_CORRUPT,
            ) from None

    def offset_map(self) -> dict[tuple[str, int], int]:
        return {(t, p): o for t, p, o in self.offsets}

    def chunk_key(self, index: int) -> bytes:
        return snapshot_key(CHUNK, self.writer, self.snapshot_id, str(index))


def chunked(payload: bytes, size: int = CHUNK_BYTES) -> list[bytes]:
    """The payload cut into chunks of at most ``size`` bytes (at least one)."""
    return [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]


def read_manifest(value: bytes) -> Manifest:
    """A manifest from its record: SNAPSHOT_VERSION_UNKNOWN for another format,
    SNAPSHOT_CORRUPT for anything that does not decode or a ``written_at`` that is no time."""
    try:
        raw = msgspec.json.decode(value)
    except msgspec.DecodeError as exc:
        raise SnapshotError(
            f"the manifest is not JSON: {exc}", code=LocalCode.SNAPSHOT_CORRUPT
        ) from None
    version = raw.get("format") if isinstance(raw, dict) else None
    if version != FORMAT:
        raise SnapshotError(
            f"the manifest's format {version!r} is not {FORMAT}, the one this version reads",
            code=LocalCode.SNAPSHOT_VERSION_UNKNOWN,
        )
    try:
        manifest = msgspec.json.decode(value, type=Manifest)
    except msgspec.DecodeError as exc:
        raise SnapshotError(
            f"the manifest does not decode: {exc}", code=LocalCode.SNAPSHOT_CORRUPT
        ) from None
    manifest.written()  # refused here, not once the fleet holds the state; ranked() reads it
    return manifest


def check(
    manifest: Manifest,
    records: Mapping[bytes, bytes],
    *,
    fold: Mapping[str, float | int | str | None],
    partitions: set[tuple[str, int]],
    starts: Mapping[tuple[str, int], int],
    ends: Mapping[tuple[str, int], int],
) -> bytes:
    """The payload of ``manifest``, checked against the log as it is: the same fold settings
    and partitions as this reader's (SNAPSHOT_MISMATCH), every offset within its partition's
    log start and end (SNAPSHOT_OFFSETS_GONE), every chunk present (SNAPSHOT_INCOMPLETE) and
    of its sha256 (SNAPSHOT_CORRUPT)."""
    if dict(manifest.fold) != dict(fold):
        raise SnapshotError(
            f"made with fold settings {manifest.fold}, this coordinator's are {dict(fold)}",
            code=LocalCode.SNAPSHOT_MISMATCH,
        )
    offsets = manifest.offset_map()
    if set(offsets) != partitions:
        raise SnapshotError(
            f"covers partitions {sorted(offsets)}, this coordinator reads {sorted(partitions)}",
            code=LocalCode.SNAPSHOT_MISMATCH,
        )
    for key, offset in sorted(offsets.items()):
        start, end = starts.get(key, 0), ends.get(key, 0)
        if offset < start:
            raise SnapshotError(
                f"{key[0]}[{key[1]}] starts at offset {start} now, past the snapshot's "
                f"{offset}: records it did not fold were deleted (retention)",
                code=LocalCode.SNAPSHOT_OFFSETS_GONE,
            )
        if offset > end:
            raise SnapshotError(
                f"{key[0]}[{key[1]}] ends at offset {end}, before the snapshot's {offset} "
                "(the topic was recreated?)",
                code=LocalCode.SNAPSHOT_OFFSETS_GONE,
            )
    parts = []
    for index, digest in enumerate(manifest.chunks):
        chunk = records.get(manifest.chunk_key(index))
        if chunk is None:
            raise SnapshotError(
                f"chunk {index} of {len(manifest.chunks)} is missing",
                code=LocalCode.SNAPSHOT_INCOMPLETE,
            )
        if hashlib.sha256(chunk).hexdigest() != digest:
            raise SnapshotError(
                f"chunk {index} of {len(manifest.chunks)} does not match its sha256",
                code=LocalCode.SNAPSHOT_CORRUPT,
            )
        parts.append(chunk)
    payload = b"".join(parts)
    if len(payload) != manifest.size:
        raise SnapshotError(
            f"the chunks hold {len(payload)} bytes, the manifest says {manifest.size}",
            code=LocalCode.SNAPSHOT_CORRUPT,
        )
    return payload


def ranked(records: Mapping[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The manifests' (key, value), best first: the most records covered, then the newest (a
    manifest that does not read comes last; it is rejected with its reason)."""

    def rank(item: tuple[bytes, bytes]) -> tuple[int, int, float]:
        try:
            manifest = read_manifest(item[1])
        except SnapshotError:
            return (0, 0, 0.0)
        return (1, manifest.covered, manifest.written_at)

    manifests = [(k, v) for k, v in records.items() if k.startswith(MANIFEST.encode() + b"/")]
    return sorted(manifests, key=rank, reverse=True)


# --------------------------------------------------------------------------- what a start used


class SnapshotInfo(BaseModel):
    """What this coordinator's start restored from, and the snapshots it wrote since."""

    model_config = ConfigDict(frozen=True)

    #: "snapshot": the fold was restored and only the tail read; "full replay" otherwise.
    started_from: str = "full replay"
    #: Why the start replayed in full (a code, or a plain reason: no snapshot, disabled).
    reason: str | None = None
    writer: str | None = None
    snapshot_id: str | None = None
    written_at: datetime | None = None
    #: The snapshot's age when restored (its writer's clock against this one's).
    age_s: float | None = None
    #: "topic[partition]" -> the offset folding resumed at.
    offsets: dict[str, int] = {}
    bytes: int | None = None
    restore_s: float | None = None
    #: Snapshots this coordinator wrote, and the latest one's time and offsets.
    written: int = 0
    last_written_at: datetime | None = None
    last_offsets: dict[str, int] = {}
    #: The last write that failed, if the latest did.
    last_error: str | None = None


def _offsets_shown(offsets: Mapping[tuple[str, int], int]) -> dict[str, int]:
    return {f"{t}[{p}]": o for (t, p), o in sorted(offsets.items())}


# --------------------------------------------------------------------------- the Kafka side


@dataclass
class Captured:
    """A snapshot encoded at a batch boundary, to be written."""

    payload: bytes
    offsets: dict[tuple[str, int], int]
    encode_s: float


@dataclass
class Snapshots:
    """One coordinator's snapshots: :meth:`restore` at start, :meth:`capture` and :meth:`write`."""

    settings: KafkaSettings
    fleet: Fleet
    control: ControlState
    #: This coordinator's writer id (its manifest key).
    writer: str
    #: The fold's settings: a snapshot made with others is not restored.
    fold: dict[str, float | int | str | None]
    info: SnapshotInfo = field(default_factory=SnapshotInfo)
    #: Chunk keys of this writer to tombstone once a newer manifest of it is confirmed.
    _own_chunks: list[bytes] = field(default_factory=list)
    #: Whether the snapshots topic exists (found at :meth:`restore`); no writes when it does not.
    topic_exists: bool = True

    def __post_init__(self) -> None:
        if not _WRITER.fullmatch(self.writer):
            raise ControlPlaneError(
                f"snapshot writer id {self.writer!r}: 1-128 of A-Z a-z 0-9 . _ -",
                code=LocalCode.SETTINGS_INVALID,
            )

    @property
    def topic(self) -> str:
        return self.settings.topics.snapshots.name

    # ------------------------------------------------------------------ start

    async def read_topic(self) -> dict[bytes, bytes] | None:
        """Every key's latest value on the snapshots topic (tombstoned keys left out); None
        when the topic does not exist."""
        consumer = Consumer(self.settings, max_partition_fetch_bytes=8 * 1024 * 1024)
        async with consumer:
            try:
                await consumer.partitions(self.topic, wait_s=0.0)
            except BusError as exc:
                if "does not exist" not in exc.message:
                    raise
                return None
            await consumer.assign(self.topic)
            await consumer.seek_to_beginning()
            ends = await consumer.end_offsets(self.topic)
            latest: dict[bytes, bytes] = {}
            while not _reached(consumer, self.topic, ends):
                for record in await consumer.fetch(timeout_s=0.5):
                    if record.key is None:
                        continue
                    if record.value is None:
                        latest.pop(record.key, None)
                    else:
                        latest[record.key] = record.value
        return latest

    async def partitions(self, topics: list[str]) -> dict[str, list[int]]:
        """topic -> its partitions, of those of ``topics`` that exist (the controller topic
        may not), and whether the snapshots topic does (:attr:`topic_exists`)."""
        found: dict[str, list[int]] = {}
        async with Consumer(self.settings) as consumer:
            for topic in [*topics, self.topic]:
                try:
                    parts = await consumer.partitions(topic, wait_s=0.0)
                except BusError as exc:
                    if "does not exist" not in exc.message:
                        raise
                    continue
                found[topic] = sorted(parts)
        self.topic_exists = found.pop(self.topic, None) is not None
        return found

    async def restore(
        self, partitions: dict[str, list[int]], *, use: bool = True
    ) -> dict[tuple[str, int], int]:
        """Restore the fleet (and the controller's state) from the best valid snapshot; the
        offsets to resume each covered partition at ({}: none, replay in full). ``partitions``:
        topic -> its partitions, of the topics the follower will fold (workers aside), from
        :meth:`partitions`. ``use`` False: restore nothing (the setting is off)."""
        started = time.monotonic()
        if not self.topic_exists:
            self.replayed(
                f"no snapshots topic {self.topic} (`controlplane topics ensure` creates it); "
                "snapshots are off until it exists and the coordinator restarts",
                warn=True,
            )
            return {}
        try:
            records = await self.read_topic()
        except BusError as exc:
            self.replayed(f"{exc.code}: the snapshots topic could not be read: {exc.message}")
            return {}
        if records is None:
            self.topic_exists = False
            self.replayed(f"no snapshots topic {self.topic}", warn=True)
            return {}
        mine = snapshot_key(CHUNK, self.writer) + b"/"
        self._own_chunks = [k for k in records if k.startswith(mine)]  # a former run's
        if not use:
            self.replayed("restoring from snapshots is off (snapshot_restore)")
            return {}
        candidates = ranked(records)
        if not candidates:
            self.replayed("no snapshot on the topic yet")
            return {}
        wanted = {(t, p) for t, ps in partitions.items() for p in ps}
        starts, ends = await self._bounds(partitions)
        reasons = []
        for key, value in candidates:
            try:
                manifest = read_manifest(value)
                payload = check(
                    manifest,
                    records,
                    fold=self.fold,
                    partitions=wanted,
                    starts=starts,
                    ends=ends,
                )
                await asyncio.sleep(0)
                decoded = decode_payload(payload)
                offsets = manifest.offset_map()
                written_at = manifest.written()
            except SnapshotError as exc:
                reason = f"{exc.code}: {key.decode(errors='replace')}: {exc.message}"
                log.warning("error: %s; not restored from it", reason)
                reasons.append(str(exc.code))
                continue
            # Everything that can fail before the fleet takes the state: a restore is all or
            # nothing (the coordinator refuses to start on a half-restored fold).
            info = SnapshotInfo(
                started_from="snapshot",
                writer=manifest.writer,
                snapshot_id=manifest.snapshot_id,
                written_at=written_at,
                age_s=round(time.time() - manifest.written_at, 3),
                offsets=_offsets_shown(offsets),
                bytes=manifest.size,
            )
            if decoded.control is not None:
                _check_fresh(self.control)
            self.fleet.restore(decoded.fold)  # checks the fleet is fresh before taking anything
            if decoded.control is not None:
                restore_control(self.control, decoded.control)
            self.info = info.model_copy(update={"restore_s": round(time.monotonic() - started, 3)})
            log.info(
                "restored the fold from snapshot %s of %s written %s (%d bytes, %d chunks); "
                "folding the log from %s",
                manifest.snapshot_id,
                manifest.writer,
                written_at.isoformat(),
                manifest.size,
                len(manifest.chunks),
                self.info.offsets,
            )
            return offsets
        self.replayed(f"no valid snapshot ({', '.join(reasons)})", reason=reasons[0])
        return {}

    def replayed(self, why: str, *, warn: bool = False, reason: str | None = None) -> None:
        """Say (and show in :attr:`info`) that the start replays the log in full, and why."""
        log.log(logging.WARNING if warn else logging.INFO, "full replay of the log: %s", why)
        self.info = SnapshotInfo(reason=reason or why)

    async def _bounds(
        self, partitions: dict[str, list[int]]
    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        starts: dict[tuple[str, int], int] = {}
        ends: dict[tuple[str, int], int] = {}
        async with Consumer(self.settings) as consumer:
            for topic in partitions:
                for p, o in (await consumer.beginning_offsets(topic)).items():
                    starts[(topic, p)] = o
                for p, o in (await consumer.end_offsets(topic)).items():
                    ends[(topic, p)] = o
        return starts, ends

    # ------------------------------------------------------------------ writing

    async def capture(self, offsets: dict[tuple[str, int], int], *, control: bool) -> Captured:
        """Encode the fold as it is now, one section at a time with the loop free between two.
        The caller folds nothing meanwhile (the coordinator's loop calls it between two polls,
        with no compaction running), so the state matches ``offsets``."""
        started = time.monotonic()
        parts: list[bytes] = []
        for encode_one in sections(self.fleet.fold_state(), self.control if control else None):
            with collector_paused():  # encoding makes no cycles; see collector_paused
                parts.append(frame(encode_one()))
            await asyncio.sleep(0)
        return Captured(b"".join(parts), dict(offsets), time.monotonic() - started)

    async def write(self, captured: Captured, producer: Producer) -> Manifest:
        """Write the chunks, then the manifest once they are confirmed, then tombstone this
        writer's older chunks. A failure leaves the previous manifest in place."""
        try:
            manifest = await self._write(captured, producer)
        except ControlPlaneError as exc:
            self.info = self.info.model_copy(update={"last_error": f"{exc.code}: {exc.message}"})
            raise
        self.info = self.info.model_copy(
            update={
                "written": self.info.written + 1,
                "last_written_at": datetime.fromtimestamp(manifest.written_at, UTC),
                "last_offsets": _offsets_shown(captured.offsets),
                "last_error": None,
            }
        )
        return manifest

    async def _write(self, captured: Captured, producer: Producer) -> Manifest:
        chunks = chunked(captured.payload)
        manifest = Manifest(
            format=FORMAT,
            writer=self.writer,
            snapshot_id=uuid.uuid4().hex,
            written_at=time.time(),
            offsets=sorted((t, p, o) for (t, p), o in captured.offsets.items()),
            chunks=[hashlib.sha256(c).hexdigest() for c in chunks],
            size=len(captured.payload),
            fold=dict(self.fold),
        )
        keys = [manifest.chunk_key(i) for i in range(len(chunks))]
        try:
            await producer.send_many(self.topic, list(zip(keys, chunks, strict=True)))
            await producer.send(
                self.topic, msgspec.json.encode(manifest), key=snapshot_key(MANIFEST, self.writer)
            )
        except BaseException:
            self._own_chunks.extend(keys)  # tombstoned after the next manifest is confirmed
            raise
        older, self._own_chunks = self._own_chunks, keys
        if older:
            try:
                await producer.send_many(self.topic, [(k, None) for k in older])
            except BaseException:
                self._own_chunks.extend(older)
                raise
        log.info(
            "snapshot %s written: %d bytes in %d chunk(s), encoded in %.2f s, offsets %s",
            manifest.snapshot_id,
            manifest.size,
            len(chunks),
            captured.encode_s,
            _offsets_shown(captured.offsets),
        )
        return manifest


def _reached(consumer: Consumer, topic: str, ends: Mapping[int, int]) -> bool:
    progress = consumer.progress()
    for partition, end in ends.items():
        if end == 0:
            continue
        p = progress.get((topic, partition))
        if p is None or p.position is None or p.position < end:
            return False
    return True
