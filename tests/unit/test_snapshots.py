"""Snapshots of the coordinator's fold (controlplane/coordinator/snapshots.py), without Kafka:
the payload's codec and the manifest's checks.

The property that matters: a fleet restored from a snapshot, with the workers topic read whole
again (heartbeats are never in a snapshot) and then the same tail folded, answers every
question exactly as the fleet that folded everything itself. The Kafka side (chunks and manifests
on the topic, a coordinator that restores from them) is in tests/integration/test_snapshots.py.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.coordinator.snapshots import (
    CHUNK_BYTES,
    FORMAT,
    Manifest,
    SnapshotError,
    check,
    chunked,
    decode_payload,
    encode_sections,
    ranked,
    read_manifest,
    restore_control,
)
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.targets import ControlState
from controlplane.wire.control import ActionKind, ControlPhase, ControlRecord
from controlplane.wire.errors import LocalCode
from controlplane.wire.protocol import AckState, Heartbeat
from tests.factories import Event, ack, at, command, feed, heartbeat, nack
from tests.unit.strategies import fuzz
from tests.unit.test_targets_fold import _LOG, action, fold, rollout, state, summary, weights

WORKERS = ("w1", "w2", "w3")
ROLLOUTS = ("r1", "r2", "r3")
STATES = (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED, AckState.FAILED)


def view(f: Fleet, now: float) -> dict[str, Any]:
    """Every answer a reader can get from the fleet at ``now``, comparable."""
    when = at(now)
    return {
        "ids": f.rollout_ids(),
        "status": {r: f.status(r, when).model_dump() for r in f.rollout_ids()},
        "tally": {r: f.tally(r, when) for r in f.rollout_ids()},
        "keys": f.rollout_keys(),
        "levels": [lv.model_dump() for lv in f.worker_levels(when)],
        "orphans": [o.model_dump() for o in f.orphans()],
        "stats": f.stats(),
        "ended": {r: f.ended(r) for r in f.rollout_ids()},
        "excess": f.excess(),
        "unended": f.unended(),
        "workers": [w.model_dump() for w in f.registry.workers(when)],
    }


def restored(f: Fleet, heartbeats: list[Heartbeat], **kw: Any) -> Fleet:
    """A new fleet from ``f``'s snapshot, the heartbeats read again (the workers topic)."""
    again = Fleet(**kw)
    again.restore(decode_payload(encode_sections(f.fold_state(), None)).fold)
    feed(again, heartbeats)
    return again


@st.composite
def events(draw: st.DrawFn) -> Event:
    kind = draw(st.sampled_from(["command", "ack", "ack", "ack", "nack", "heartbeat"]))
    rollout_id = draw(st.sampled_from(ROLLOUTS))
    worker = draw(st.sampled_from(WORKERS))
    when = draw(st.integers(0, 900)) / 1.0
    if kind == "command":
        pinned = draw(st.booleans())
        return command(
            rollout_id,
            draw(st.sampled_from(["c1", "c2"])),
            workers=list(WORKERS[: draw(st.integers(1, 3))]) if pinned else None,
            labels=None if pinned else {"model": "m"},
            issued=when,
            version=draw(st.sampled_from(["v1", "v2"])),
        )
    if kind == "heartbeat":
        version = draw(st.sampled_from([None, "v1", "v2"]))
        return heartbeat(worker, when, version=version, labels={"model": "m"})
    if kind == "nack":
        return nack(worker, when, "SCHEMA_INVALID", rollout_id=rollout_id)
    return ack(
        worker,
        draw(st.sampled_from(STATES)),
        when,
        rollout_id=rollout_id,
        command_id=draw(st.sampled_from(["c1", "c2"])),
    )


@fuzz(150)
@given(
    log=st.lists(events(), max_size=40),
    cut=st.integers(0, 40),
    compact_at=st.one_of(st.none(), st.integers(0, 1000)),
    now=st.integers(0, 2000),
)
def test_restored_plus_the_tail_answers_as_the_fleet_that_folded_it_all(
    log: list[Event], cut: int, compact_at: int | None, now: int
) -> None:
    """Fold a prefix, maybe compact (summaries, ended rollouts), snapshot; restore it into a
    new fleet that reads the heartbeats again; fold the same tail into both: every answer is
    equal, and so is a snapshot of each."""
    kw: dict[str, Any] = {"max_ended_rollouts": 1, "progress_deadline_s": 300.0}
    prefix, tail = log[:cut], log[cut:]
    first = feed(Fleet(**kw), prefix)
    if compact_at is not None:
        first.compact(at(compact_at))
    second = restored(first, [e for e in prefix if isinstance(e, Heartbeat)], **kw)
    assert view(second, now) == view(first, now)
    feed(first, tail)
    feed(second, tail)
    assert view(second, now) == view(first, now)
    assert encode_sections(second.fold_state(), None) == encode_sections(first.fold_state(), None)


def test_a_summarized_rollout_and_what_it_desired_come_back() -> None:
    f = Fleet(max_ended_rollouts=0)
    feed(f, [command("r1", workers=["w1", "w2"], version="v7")])
    feed(f, [a for w in ("w1", "w2") for a in _done(w, "r1")])
    feed(f, [heartbeat("w1", 50.0, version="v7"), heartbeat("w2", 50.0, version="v7")])
    assert f.compact(at(100.0)) == 1 and f.is_summarized("r1")
    again = restored(f, [heartbeat("w1", 50.0, version="v7"), heartbeat("w2", 50.0, version="v7")])
    assert again.is_summarized("r1")
    assert view(again, 100.0) == view(f, 100.0)
    assert [lv.desired_version for lv in again.worker_levels(at(100.0))] == ["v7", "v7"]
    # An ack for it, redelivered after the restart, is dropped as before.
    feed(again, [ack("w1", AckState.SUCCEEDED, 9.0)])
    feed(f, [ack("w1", AckState.SUCCEEDED, 9.0)])
    assert again.stats() == f.stats() and again.stats().dropped_acks == 1


def _done(worker: str, rollout_id: str) -> list[Event]:
    return [
        ack(worker, AckState.ACCEPTED, 1.0, rollout_id=rollout_id),
        ack(worker, AckState.RUNNING, 2.0, rollout_id=rollout_id),
        ack(worker, AckState.SUCCEEDED, 3.0, rollout_id=rollout_id, started=2.0, version="v7"),
    ]


def test_an_ack_error_and_conflicting_terminals_come_back() -> None:
    f = Fleet()
    feed(f, [command("r1", workers=["w1"])])
    feed(f, [ack("w1", AckState.FAILED, 5.0, code="RUNNER_FAILED")])
    feed(f, [ack("w1", AckState.SUCCEEDED, 6.0)])  # a conflict: both held
    feed(f, [ack("w9", AckState.SUCCEEDED, 6.0, rollout_id="r9")])  # an orphan
    again = restored(f, [])
    assert view(again, 10.0) == view(f, 10.0)
    assert again.orphans() and again.status("r1", at(10.0)).anomalies


# --------------------------------------------------------------------------- the controller


def test_the_controller_s_fold_comes_back_and_folds_on_alike() -> None:
    early: list[ControlRecord] = [
        action("r9", "a9", ActionKind.PAUSE),  # an action before its rollout
        rollout("late-1", weights("v5"), "late"),  # a stable state before its target's spec
        state("late-1", 0, ControlPhase.SUCCEEDED, "late"),
    ]
    control = fold(*_LOG, *early)
    decoded = decode_payload(encode_sections(Fleet().fold_state(), control)).control
    assert decoded is not None
    again = ControlState()
    restore_control(again, decoded)
    assert summary(again) == summary(control) and again.records == control.records
    tail: list[ControlRecord] = [
        rollout("r9", weights("v9")),
        state("r9", 0),
        *_LOG[-3:],  # read again: changes nothing
    ]
    for record in tail:
        control.observe(record)
        again.observe(record)
    assert summary(again) == summary(control)
    r9 = again.rollout("r9")
    assert r9 is not None and [a.action_id for a in r9.actions] == ["a9"]


def test_restoring_into_a_fold_that_folded_something_is_refused() -> None:
    f = feed(Fleet(), [command("r1")])
    with pytest.raises(ValueError, match="folded no command"):
        f.restore(f.fold_state())
    control = fold(*_LOG)
    with pytest.raises(ValueError, match="folded nothing"):
        restore_control(control, ControlState())


# --------------------------------------------------------------------------- manifests and checks

FOLD: dict[str, float | int | None] = {"progress_deadline_s": 600.0, "max_ended_rollouts": 10}
PARTS = {("t.commands", 0), ("t.acks", 0)}


def _snapshot(
    payload: bytes, size: int = CHUNK_BYTES, **kw: Any
) -> tuple[Manifest, dict[bytes, bytes]]:
    chunks = chunked(payload, size)
    fields: dict[str, Any] = {
        "format": FORMAT,
        "writer": "w",
        "snapshot_id": "s1",
        "written_at": 1.0,
        "offsets": [("t.commands", 0, 5), ("t.acks", 0, 7)],
        "chunks": [hashlib.sha256(c).hexdigest() for c in chunks],
        "size": len(payload),
        "fold": FOLD,
    } | kw
    manifest = Manifest(**fields)
    records = {manifest.chunk_key(i): c for i, c in enumerate(chunks)}
    return manifest, records


def _check(manifest: Manifest, records: dict[bytes, bytes], **kw: Any) -> bytes:
    bounds: dict[str, Any] = {
        "fold": FOLD,
        "partitions": PARTS,
        "starts": {("t.commands", 0): 0, ("t.acks", 0): 0},
        "ends": {("t.commands", 0): 5, ("t.acks", 0): 9},
    } | kw
    return check(manifest, records, **bounds)


def _code(exc: pytest.ExceptionInfo[SnapshotError]) -> LocalCode:
    code = exc.value.code
    assert isinstance(code, LocalCode)
    return code


def test_a_payload_in_many_chunks_is_put_back_together() -> None:
    f = feed(Fleet(), [command("r1", workers=[f"w{i}" for i in range(300)])])
    feed(f, [ack(f"w{i}", AckState.SUCCEEDED, 3.0) for i in range(300)])
    payload = encode_sections(f.fold_state(), None)
    manifest, records = _snapshot(payload, size=1000)
    assert len(manifest.chunks) > 10
    assert _check(manifest, records) == payload
    manifest = read_manifest(msgspec.json.encode(manifest))
    assert view(restored(f, []), 10.0) == view(f, 10.0)


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        ("flip a byte of a chunk", LocalCode.SNAPSHOT_CORRUPT),
        ("drop a chunk", LocalCode.SNAPSHOT_INCOMPLETE),
        ("other fold settings", LocalCode.SNAPSHOT_MISMATCH),
        ("other partitions", LocalCode.SNAPSHOT_MISMATCH),
        ("log start past its offset", LocalCode.SNAPSHOT_OFFSETS_GONE),
        ("log end before its offset", LocalCode.SNAPSHOT_OFFSETS_GONE),
    ],
)
def test_a_snapshot_that_does_not_hold_is_refused_with_its_code(damage: str, code: str) -> None:
    manifest, records = _snapshot(b"x" * 2500, size=1000)
    kw: dict[str, Any] = {}
    if damage == "flip a byte of a chunk":
        key = manifest.chunk_key(1)
        records[key] = b"y" + records[key][1:]
    elif damage == "drop a chunk":
        del records[manifest.chunk_key(2)]
    elif damage == "other fold settings":
        kw["fold"] = FOLD | {"progress_deadline_s": 60.0}
    elif damage == "other partitions":
        kw["partitions"] = {*PARTS, ("t.acks", 1)}
    elif damage == "log start past its offset":
        kw["starts"] = {("t.commands", 0): 0, ("t.acks", 0): 8}
    else:
        kw["ends"] = {("t.commands", 0): 4, ("t.acks", 0): 9}
    with pytest.raises(SnapshotError) as exc:
        _check(manifest, records, **kw)
    assert _code(exc) == code


def test_an_unknown_format_and_a_broken_manifest_are_refused_with_their_codes() -> None:
    manifest, _ = _snapshot(b"x")
    newer = msgspec.json.encode(msgspec.structs.replace(manifest, format=FORMAT + 1))
    with pytest.raises(SnapshotError) as exc:
        read_manifest(newer)
    assert _code(exc) == LocalCode.SNAPSHOT_VERSION_UNKNOWN
    for broken in (b"{not json", b'{"format": %d, "writer": 3}' % FORMAT, b"[]"):
        with pytest.raises(SnapshotError) as exc:
            read_manifest(broken)
        assert _code(exc) in {LocalCode.SNAPSHOT_CORRUPT, LocalCode.SNAPSHOT_VERSION_UNKNOWN}
    with pytest.raises(SnapshotError) as exc:
        read_manifest(b'{"format": %d, "writer": 3}' % FORMAT)
    assert _code(exc) == LocalCode.SNAPSHOT_CORRUPT


@pytest.mark.parametrize("payload", [b"\x00\x00\x00\x09abc", b"\x00\x00", b"\x00\x00\x00\x01\xc1"])
def test_a_payload_that_does_not_decode_is_corrupt(payload: bytes) -> None:
    with pytest.raises(SnapshotError) as exc:
        decode_payload(payload)
    assert _code(exc) == LocalCode.SNAPSHOT_CORRUPT
    with pytest.raises(SnapshotError) as exc:
        decode_payload(b"")  # no fleet section
    assert _code(exc) == LocalCode.SNAPSHOT_CORRUPT


def test_manifests_are_ranked_by_what_they_cover_then_by_age() -> None:
    def encoded(writer: str, offset: int, written: float) -> tuple[bytes, bytes]:
        manifest, _ = _snapshot(
            b"x", writer=writer, written_at=written, offsets=[("t.acks", 0, offset)]
        )
        return f"manifest/{writer}".encode(), msgspec.json.encode(manifest)

    records = dict(
        [
            encoded("old", 5, 1.0),
            encoded("most", 9, 0.5),
            encoded("new", 5, 2.0),
            (b"manifest/bad", b"{"),
            (b"chunk/x/y/0", b"..."),
        ]
    )
    assert [k for k, _ in ranked(records)] == [
        b"manifest/most",
        b"manifest/new",
        b"manifest/old",
        b"manifest/bad",
    ]


@pytest.mark.parametrize("written_at", [1e12, -1e12, 1e308])
def test_a_manifest_written_at_no_datetime_is_corrupt(written_at: float) -> None:
    """A written_at that is no datetime (year 33658, before year 1) is refused on reading: it
    would fail the restore after the fleet took the state, and rank first as the newest."""
    manifest, _ = _snapshot(b"x", written_at=written_at)
    with pytest.raises(SnapshotError) as exc:
        read_manifest(msgspec.json.encode(manifest))
    assert _code(exc) == LocalCode.SNAPSHOT_CORRUPT
    assert "written_at" in exc.value.message


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"1e400", b"-1e400"])
def test_a_manifest_written_at_no_finite_number_is_corrupt(number: bytes) -> None:
    manifest, _ = _snapshot(b"x", written_at=123.0)
    value = msgspec.json.encode(manifest).replace(b"123.0", number)
    assert number in value
    with pytest.raises(SnapshotError) as exc:
        read_manifest(value)
    assert _code(exc) == LocalCode.SNAPSHOT_CORRUPT


def test_a_manifest_written_at_no_datetime_ranks_after_the_valid_ones() -> None:
    def encoded(writer: str, written: float) -> tuple[bytes, bytes]:
        manifest, _ = _snapshot(b"x", writer=writer, written_at=written)
        return f"manifest/{writer}".encode(), msgspec.json.encode(manifest)

    records = dict([encoded("future", 1e12), encoded("valid", 2.0), encoded("old", 1.0)])
    assert [k for k, _ in ranked(records)] == [
        b"manifest/valid",
        b"manifest/old",
        b"manifest/future",
    ]


def test_datetimes_keep_their_instant() -> None:
    """Timestamps with an offset come back as the same instant (msgpack keeps UTC)."""
    from datetime import timedelta, timezone

    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=5)))
    f = Fleet()
    f.observe_command(
        command("r1").model_copy(update={"issued_at": when, "expires_at": when + timedelta(1)})
    )
    again = restored(f, [])
    assert again.issued("r1") == when
