"""Snapshots of the coordinator's fold on the real broker (controlplane/coordinator/snapshots.py).

A coordinator caught up with a history (ended rollouts, some summarized; one in progress; an
orphan ack; a rollout known only from a NACK; the controller topic's records) writes a snapshot;
more history comes; a second coordinator restores from the snapshot and folds only the tail, a
third replays everything: they answer alike. A snapshot that cannot be used (a chunk corrupt or
missing, another format, offsets the log no longer has) is refused with its code and the start
replays in full, to the same answers.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest

from controlplane.api.app import create_app
from controlplane.coordinator import service
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.coordinator.snapshots import MANIFEST, Snapshots
from controlplane.kafka.bus import Admin, Consumer, Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.channels import ACKS, COMMANDS, CONTROL, HEARTBEATS
from controlplane.wire.control import ActionKind
from controlplane.wire.errors import LocalCode
from controlplane.wire.protocol import AckState, WireModel, utcnow
from controlplane.wire.topics import snapshot_key
from tests.factories import T0, ack, command, full, heartbeat, nack
from tests.fleet import wait_for
from tests.integration.test_topics import topics_ensure
from tests.unit.test_snapshots import view
from tests.unit.test_targets_fold import action, rollout, state, summary, target, weights

pytestmark = pytest.mark.kafka

WORKERS = [f"w{i}" for i in range(4)]


@pytest.fixture
async def fleet(kafka: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """The ``kafka`` fixture's topics and the snapshots topic."""
    async with Admin(kafka) as admin:
        await admin.ensure_topics(kafka.topics.snapshots_only())
    yield kafka


@pytest.fixture(autouse=True)
def compact_often(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(service, "COMPACT_EVERY_S", 0.1)
    yield


class History:
    """Writes the log: commands, acks and heartbeats at times from now on, control records."""

    def __init__(self, settings: KafkaSettings, producer: Producer) -> None:
        self.settings = settings
        self.producer = producer
        self.base = (utcnow() - T0).total_seconds()  # factories' times are seconds after T0

    async def write(self, *messages: Any) -> None:
        channels: dict[str, Any] = {"Command": COMMANDS, "Ack": ACKS, "Heartbeat": HEARTBEATS}
        for message in messages:
            channel = channels.get(type(message).__name__, CONTROL)  # else a control record
            topic, key, value = channel.record(self.settings.topics, message)
            await self.producer.send(topic, value, key=key)

    def command(self, rollout_id: str, at: float, **kw: Any) -> Any:
        return command(
            rollout_id,
            f"c-{rollout_id}",
            workers=WORKERS,
            issued=self.base + at,
            expires=self.base + at + 3600,
            **kw,
        )

    def acks(self, rollout_id: str, at: float, workers: list[str], **kw: Any) -> list[Any]:
        out = []
        for worker in workers:
            out += full(
                worker, self.base + at, self.base + at + 2, rollout_id=rollout_id,
                command_id=f"c-{rollout_id}", **kw,
            )  # fmt: skip
        return out

    def ack(self, worker: str, kind: AckState, at: float, rollout_id: str, **kw: Any) -> Any:
        return ack(
            worker, kind, self.base + at, rollout_id=rollout_id, command_id=f"c-{rollout_id}", **kw
        )

    def heartbeats(self, at: float, version: str) -> list[Any]:
        return [
            heartbeat(w, self.base + at, started=self.base - 100, interval=600.0, version=version)
            for w in WORKERS
        ]


async def history_before(h: History) -> None:
    """Three ended rollouts (the older two summarized at max_ended_rollouts=1), one in
    progress, an orphan ack, a NACK-only rollout, heartbeats, a target and a progressive
    rollout with an action."""
    for i, rid in enumerate(("r-a", "r-b", "r-c")):
        await h.write(h.command(rid, 10 * i, version=f"v{i}"))
        await h.write(*h.acks(rid, 10 * i + 1, WORKERS, version=f"v{i}"))
    await h.write(h.command("r-d", 40, version="v9"))
    await h.write(*[h.ack(w, AckState.ACCEPTED, 41, "r-d") for w in WORKERS[:2]])
    await h.write(h.ack("w9", AckState.SUCCEEDED, 42, "r-orphan"))
    await h.write(nack("w1", h.base + 43, "SCHEMA_INVALID", rollout_id="r-nack", command_id="cn"))
    await h.write(*h.heartbeats(44, "v2"))
    records: list[WireModel] = [
        target(stable=weights("v1")),
        rollout("p-1", weights("v2")),
        action("p-1", "a1", ActionKind.PAUSE),
    ]
    await h.write(*records)


async def history_between(h: History) -> None:
    """While the first coordinator runs (in its snapshot): an in-progress worker moves on."""
    await h.write(h.ack("w2", AckState.ACCEPTED, 50, "r-d"))


async def history_after(h: History) -> None:
    """After the snapshot (the tail): the in-progress rollout ends, a new one starts, a
    redelivered ack of a summarized rollout, another orphan, control records, heartbeats."""
    await h.write(*[h.ack(w, AckState.RUNNING, 60, "r-d", started=h.base + 60) for w in WORKERS])
    await h.write(*[h.ack(w, AckState.SUCCEEDED, 61, "r-d", version="v9") for w in WORKERS])
    await h.write(h.command("r-e", 62, version="v10"))
    await h.write(h.ack("w0", AckState.ACCEPTED, 63, "r-e"))
    await h.write(h.ack("w0", AckState.SUCCEEDED, 12, "r-a", version="v0"))  # redelivered
    await h.write(h.ack("w8", AckState.FAILED, 64, "r-orphan-2"))
    await h.write(state("p-1", 0), action("p-1", "a2", ActionKind.RESUME))
    await h.write(*h.heartbeats(65, "v9"))


def settings_for(kafka: KafkaSettings, writer: str, **kw: Any) -> CoordinatorSettings:
    fields: dict[str, Any] = {
        "kafka": kafka,
        "controller": False,  # nobody acts on the progressive rollout: its records stay as written
        "max_ended_rollouts": 1,
        "snapshot_writer": writer,
        "snapshot_interval_s": 0,
        "probe_interval_s": 0.2,
    } | kw
    return CoordinatorSettings(**fields)


@asynccontextmanager
async def started(settings: CoordinatorSettings) -> AsyncIterator[Coordinator]:
    async with Coordinator(settings) as coordinator:
        await coordinator.wait_ready(60)
        yield coordinator


async def ends(kafka: KafkaSettings) -> dict[str, int]:
    """The end offsets of the partitions a snapshot covers, as SnapshotInfo shows them."""
    out: dict[str, int] = {}
    async with Consumer(kafka) as consumer:
        for channel in (COMMANDS, ACKS, CONTROL):
            topic = channel.topic(kafka.topics)
            for p, end in (await consumer.end_offsets(topic)).items():
                out[f"{topic}[{p}]"] = end
    return out


def comparable(coordinator: Coordinator, now: float) -> dict[str, Any]:
    """Every answer of the fleet, but the count of acks dropped for summarized rollouts: a
    redelivered ack of a rollout the snapshot holds summarized is dropped on arrival, while a
    full replay folds it before it summarizes (the same status either way)."""
    answers = view(coordinator.fleet, now)
    answers["stats"] = dataclasses.replace(answers["stats"], dropped_acks=0)
    return answers


async def settled_alike(first: Coordinator, second: Coordinator) -> None:
    """Wait until both have compacted what they will, then compare every answer."""
    now = utcnow().timestamp() - T0.timestamp()

    def alike() -> bool:
        settled = not first.fleet.excess() and not second.fleet.excess()
        return settled and comparable(first, now) == comparable(second, now)

    try:
        await wait_for(alike, timeout=30)
    finally:  # the diff, if they never agree
        assert comparable(first, now) == comparable(second, now)
        assert summary(first.control) == summary(second.control)
        assert first.control.records == second.control.records


async def test_restored_plus_the_tail_answers_as_a_full_replay(fleet: KafkaSettings) -> None:
    async with Producer(fleet) as producer:
        h = History(fleet, producer)
        await history_before(h)
        async with started(settings_for(fleet, "c1", snapshot_interval_s=0.05)) as c1:
            await wait_for(lambda: c1.fleet.stats().compacted == 3)  # all but r-nack
            await history_between(h)
            wanted = await ends(fleet)
            await wait_for(lambda: c1.snapshots.info.last_offsets == wanted)
            assert c1.snapshots.info.started_from == "full replay"
        await history_after(h)
    async with (
        started(settings_for(fleet, "c2")) as restored,
        started(settings_for(fleet, "c3", snapshot_restore=False)) as replayed,
    ):
        info = restored.snapshots.info
        assert (info.started_from, info.writer, info.offsets) == ("snapshot", "c1", wanted)
        assert replayed.snapshots.info.started_from == "full replay"
        assert (
            replayed.snapshots.info.reason == "restoring from snapshots is off (snapshot_restore)"
        )
        # The tail only: the commands and acks written after the snapshot (and the workers topic).
        assert restored.follower.records_read[fleet.topics.acks.name] == 4 + 4 + 1 + 1 + 1
        assert replayed.follower.records_read[fleet.topics.acks.name] > 30
        await settled_alike(restored, replayed)
        statuses = {r: restored.fleet.status(r, restored.now()) for r in ("r-a", "r-d", "r-e")}
        assert statuses["r-a"].details_dropped and statuses["r-d"].phase.value == "succeeded"
        assert statuses["r-e"].phase.value == "progressing"
        assert [o.rollout_id for o in restored.fleet.orphans()] == ["r-orphan", "r-orphan-2"]
        p1 = restored.control.rollout("p-1")
        assert p1 is not None and [a.action_id for a in p1.actions] == ["a1", "a2"]


async def test_a_restarted_writer_replaces_its_snapshot_and_tombstones_the_old_chunks(
    fleet: KafkaSettings,
) -> None:
    async with Producer(fleet) as producer:
        h = History(fleet, producer)
        await history_before(h)
        async with started(settings_for(fleet, "c1", snapshot_interval_s=0.05)) as c1:
            await wait_for(lambda: c1.snapshots.info.written >= 1)
        first = await on_topic(fleet)
        await history_between(h)
        async with started(settings_for(fleet, "c1", snapshot_interval_s=0.05)) as again:
            assert again.snapshots.info.started_from == "snapshot"
            wanted = await ends(fleet)
            await wait_for(lambda: again.snapshots.info.last_offsets == wanted)
            await wait_for(lambda: again.snapshots.info.written >= 1)
    second = await on_topic(fleet)
    manifests = [k for k in second if k.startswith(b"manifest/")]
    assert manifests == [b"manifest/c1"]
    old_chunks = {k for k in first if k.startswith(b"chunk/")}
    assert old_chunks and not old_chunks & set(second)  # tombstoned: compaction drops them
    assert any(k.startswith(b"chunk/c1/") for k in second)


async def on_topic(kafka: KafkaSettings) -> dict[bytes, bytes]:
    snapshots = Snapshots(kafka, None, None, writer="reader", fold={})  # type: ignore[arg-type]
    records = await snapshots.read_topic()
    assert records is not None
    return records


async def damage(kafka: KafkaSettings, how: str, writer: str = "c1") -> None:
    """Spoil ``writer``'s snapshot on the topic (or the log under it) as ``how`` says."""
    records = await on_topic(kafka)
    key = snapshot_key(MANIFEST, writer)
    manifest = msgspec.json.decode(records[key])
    topic = kafka.topics.snapshots.name
    async with Producer(kafka) as producer:
        if how == "corrupt chunk":
            chunk = snapshot_key("chunk", writer, manifest["snapshot_id"], "0")
            spoiled = records[chunk][:-1] + bytes([records[chunk][-1] ^ 0xFF])
            await producer.send(topic, spoiled, key=chunk)
        elif how == "missing chunk":
            chunk = snapshot_key("chunk", writer, manifest["snapshot_id"], "0")
            await producer.send(topic, None, key=chunk)
        elif how == "unknown version":
            manifest["format"] = 99
            await producer.send(topic, msgspec.json.encode(manifest), key=key)
        elif how == "written in year 33658":
            manifest["written_at"] = 1e12  # no datetime: it failed the restore past the fleet's
            await producer.send(topic, msgspec.json.encode(manifest), key=key)
        elif how == "offsets below log start":
            await delete_acks_before(kafka, manifest)
        else:
            raise AssertionError(how)


async def delete_acks_before(kafka: KafkaSettings, manifest: dict[str, Any]) -> None:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

    acks = kafka.topics.acks.name
    offsets = {(t, p): o for t, p, o in manifest["offsets"] if t == acks and o > 0}
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:  # retention deleted one record after the snapshot's offset of one acks partition
        (topic, partition), offset = next(iter(offsets.items()))
        await admin.delete_records(
            {TopicPartition(topic, partition): RecordsToDelete(before_offset=offset + 1)}
        )
    finally:
        await admin.close()


@pytest.mark.parametrize(
    ("how", "code"),
    [
        ("corrupt chunk", LocalCode.SNAPSHOT_CORRUPT),
        ("missing chunk", LocalCode.SNAPSHOT_INCOMPLETE),
        ("unknown version", LocalCode.SNAPSHOT_VERSION_UNKNOWN),
        ("offsets below log start", LocalCode.SNAPSHOT_OFFSETS_GONE),
        ("written in year 33658", LocalCode.SNAPSHOT_CORRUPT),
    ],
)
async def test_a_snapshot_that_cannot_be_used_means_a_full_replay(
    fleet: KafkaSettings, how: str, code: LocalCode, caplog: pytest.LogCaptureFixture
) -> None:
    async with Producer(fleet) as producer:
        h = History(fleet, producer)
        await history_before(h)
        async with started(settings_for(fleet, "c1", snapshot_interval_s=0.05)) as c1:
            await wait_for(lambda: c1.fleet.stats().compacted == 3)
            await history_between(h)
            wanted = await ends(fleet)
            await wait_for(lambda: c1.snapshots.info.last_offsets == wanted)
        await history_after(h)
    await damage(fleet, how)
    async with (
        started(settings_for(fleet, "c2")) as refused,
        started(settings_for(fleet, "c3", snapshot_restore=False)) as replayed,
    ):
        info = refused.snapshots.info
        assert (info.started_from, info.reason) == ("full replay", str(code))
        assert f"error: {code}: manifest/c1" in caplog.text
        await settled_alike(refused, replayed)


async def test_without_the_snapshots_topic_the_coordinator_replays_and_writes_nothing(
    kafka: KafkaSettings,
) -> None:
    async with Producer(kafka) as producer:
        await history_before(History(kafka, producer))
    async with started(settings_for(kafka, "c1", snapshot_interval_s=0.01)) as c1:
        assert c1.snapshots.info.started_from == "full replay"
        assert c1.snapshots.info.reason is not None and "no snapshots topic" in (
            c1.snapshots.info.reason
        )
        assert not c1.snapshots.topic_exists
        read = c1.follower.probes_read
        await wait_for(lambda: c1.follower.probes_read >= read + 2)  # polls went by
        assert c1.snapshots.info.written == 0


async def test_topics_ensure_creates_the_snapshots_topic_compacted(kafka_bootstrap: str) -> None:
    prefix = f"s{uuid.uuid4().hex[:8]}"
    proc = await topics_ensure(kafka_bootstrap, prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"created  {prefix}.snapshots" in proc.stdout
    again = await topics_ensure(kafka_bootstrap, prefix)
    assert again.returncode == 0 and f"ok       {prefix}.snapshots" in again.stdout
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    async with Admin(settings) as admin:  # what it made is what the spec says
        report = await admin.ensure_topics(settings.topics.snapshots_only())
    assert report.existing == [f"{prefix}.snapshots"] and not report.altered
    assert settings.topics.snapshots.config["cleanup.policy"] == "compact"


async def test_healthz_and_the_metrics_say_what_the_start_restored_from(
    fleet: KafkaSettings,
) -> None:
    async with Producer(fleet) as producer:
        await history_before(History(fleet, producer))
    async with started(settings_for(fleet, "c1", snapshot_interval_s=0.05)) as c1:
        await wait_for(lambda: c1.snapshots.info.written >= 1)
    coordinator = Coordinator(settings_for(fleet, "c2"))
    app = create_app(coordinator)
    async with coordinator:
        await coordinator.wait_ready(60)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            body = (await client.get("/healthz")).json()["snapshot"]
            metrics = (await client.get("/metrics")).text
    assert (body["started_from"], body["writer"]) == ("snapshot", "c1")
    assert body["offsets"] == c1.snapshots.info.last_offsets and body["age_s"] >= 0
    assert "controlplane_snapshot_restored 1.0" in metrics
    assert "controlplane_snapshot_restored_age_seconds" in metrics
    assert "controlplane_snapshots_written_total 0.0" in metrics


async def snapshot_written(kafka: KafkaSettings, writer: str) -> dict[str, int]:
    """Start a coordinator ``writer`` on the log as it is and stop it once its snapshot covers
    the whole log (all but r-nack compacted); the snapshot's offsets."""
    async with started(settings_for(kafka, writer, snapshot_interval_s=0.05)) as coordinator:
        await wait_for(lambda: coordinator.fleet.stats().compacted == 3)
        wanted = await ends(kafka)
        await wait_for(lambda: coordinator.snapshots.info.last_offsets == wanted)
    return wanted


async def test_the_best_snapshot_refused_the_next_valid_one_is_restored(
    fleet: KafkaSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Two writers: the one covering more is corrupt, so the start takes the other's (older,
    covering less) and folds a longer tail, to the same answers as a full replay."""
    async with Producer(fleet) as producer:
        h = History(fleet, producer)
        await history_before(h)
        older = await snapshot_written(fleet, "c1")
        await history_between(h)
        async with started(settings_for(fleet, "c1b", snapshot_interval_s=0.05)) as c1b:
            newer = await ends(fleet)
            await wait_for(lambda: c1b.snapshots.info.last_offsets == newer)
        await history_after(h)
    await damage(fleet, "corrupt chunk", writer="c1b")
    async with (
        started(settings_for(fleet, "c2")) as restored,
        started(settings_for(fleet, "c3", snapshot_restore=False)) as replayed,
    ):
        info = restored.snapshots.info
        assert (info.started_from, info.writer, info.offsets) == ("snapshot", "c1", older)
        assert f"error: {LocalCode.SNAPSHOT_CORRUPT}: manifest/c1b" in caplog.text
        await settled_alike(restored, replayed)


async def test_a_manifest_written_at_no_datetime_is_refused_and_the_valid_one_restored(
    fleet: KafkaSettings,
) -> None:
    """A copy of a valid manifest under another key, written_at 1e12 (year 33658): it covers as
    much and looks newest, but it does not read (SNAPSHOT_CORRUPT), so it ranks last and the
    valid one is restored, never a coordinator that fails to start with the fleet half restored
    (alone on the topic, it means a full replay: test_a_snapshot_that_cannot_be_used_...)."""
    async with Producer(fleet) as producer:
        h = History(fleet, producer)
        await history_before(h)
        wanted = await snapshot_written(fleet, "c1")
        await history_after(h)
        records = await on_topic(fleet)
        manifest = msgspec.json.decode(records[snapshot_key(MANIFEST, "c1")])
        manifest["written_at"] = 1e12  # its chunks are c1's: the manifest names its writer
        await producer.send(
            fleet.topics.snapshots.name,
            msgspec.json.encode(manifest),
            key=snapshot_key(MANIFEST, "future"),
        )
    async with (
        started(settings_for(fleet, "c2")) as restored,
        started(settings_for(fleet, "c3", snapshot_restore=False)) as replayed,
    ):
        info = restored.snapshots.info
        assert (info.started_from, info.writer, info.offsets) == ("snapshot", "c1", wanted)
        await settled_alike(restored, replayed)


async def test_the_first_snapshot_after_a_replay_holds_the_compacted_fold(
    fleet: KafkaSettings,
) -> None:
    """A coordinator that replayed a history writes its first snapshot only once it has
    compacted: what a start restores from holds the old ended rollouts summarized (a snapshot
    of the whole replayed history in full would make every later start as big)."""
    async with Producer(fleet) as producer:
        await history_before(History(fleet, producer))
    async with started(settings_for(fleet, "c1", snapshot_interval_s=0.01)) as c1:
        await wait_for(lambda: c1.snapshots.info.written >= 1)
    reader = Coordinator(settings_for(fleet, "c2"))
    try:
        await reader._restore()  # what start() restores, before it folds anything itself
        assert reader.snapshots.info.started_from == "snapshot"
        assert reader.fleet.is_summarized("r-a") and reader.fleet.is_summarized("r-b")
    finally:
        await reader.stop()
