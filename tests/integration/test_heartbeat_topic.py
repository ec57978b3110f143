"""The workers topic stays near one record per worker, on a real broker (issue 18).

``topics ensure`` creates it with a short segment roll, a low dirty ratio and a short tombstone
retention (``Topics.workers``), sets those on an existing topic in place (they change when
segments roll and the cleaner runs, never a record a reader gets), and the broker's cleaner
then really compacts the heartbeats away: a reader replays about one record per worker.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from controlplane.kafka.bus import Admin, Consumer, Producer, Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import TopicMismatch
from controlplane.wire.protocol import decode_heartbeat, encode, utcnow
from controlplane.wire.topics import Topics, TopicSpec, worker_key
from tests.factories import fake_heartbeat, fresh_topics

pytestmark = pytest.mark.kafka

ROLL_AND_CLEAN = {
    "cleanup.policy": "compact",
    "segment.ms": "60000",
    "segment.bytes": str(8 * 1024 * 1024),
    "min.cleanable.dirty.ratio": "0.1",
    "delete.retention.ms": "3600000",
    "message.timestamp.type": "LogAppendTime",
}


async def topic_configs(bootstrap: str, topic: str) -> dict[str, str]:
    """The topic's configs as the broker describes them (asked again while a topic created a
    moment ago is not known yet)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        async with asyncio.timeout(30):
            while True:
                [response] = await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, topic)]
                )
                [resource] = response.resources
                if resource[0] == 0:
                    return {entry[0]: entry[1] for entry in resource[4]}
                assert resource[0] == 3, resource  # UNKNOWN_TOPIC_OR_PARTITION: not yet
    finally:
        await admin.close()


class _PreviousTopics(Topics):
    """The workers topic as the version before this one made it: an hour's segments of 1 GiB
    (the broker's default), tombstones kept a day (the default)."""

    @property
    def workers(self) -> TopicSpec:
        spec = super().workers
        config = dict(spec.config, **{"segment.ms": str(60 * 60 * 1000)})
        del config["segment.bytes"], config["delete.retention.ms"]
        return TopicSpec(spec.name, spec.partitions, config, spec.replication_factor)


async def test_the_workers_topic_is_made_to_roll_and_be_cleaned_often(
    kafka: KafkaSettings,
) -> None:
    """As ``topics ensure`` created it (the ``kafka`` fixture does), and checked again."""
    have = await topic_configs(kafka.bootstrap_servers, kafka.topics.workers.name)
    assert {k: have[k] for k in ROLL_AND_CLEAN} == ROLL_AND_CLEAN
    async with Admin(kafka) as admin:
        report = await admin.ensure_topics(kafka.topics)
    assert kafka.topics.workers.name in report.existing and report.altered == []


async def test_an_existing_workers_topic_gets_them_in_place_and_keeps_its_records(
    kafka_bootstrap: str,
) -> None:
    settings = fresh_topics(kafka_bootstrap, "hp")
    workers = settings.topics.workers.name
    async with Admin(settings) as admin:
        await admin.ensure_topics(_PreviousTopics(prefix=settings.topic_prefix))
    before = await topic_configs(kafka_bootstrap, workers)
    assert before["segment.ms"] == "3600000" and before["segment.bytes"] == "1073741824"
    await beat(settings, ["w-1"], rounds=1)
    async with Admin(settings) as admin:
        report = await admin.ensure_topics(settings.topics)  # no TopicMismatch: set in place
        again = await admin.ensure_topics(settings.topics)
    assert sorted(report.altered) == [
        f"{workers}: delete.retention.ms 86400000 -> 3600000",
        f"{workers}: segment.bytes 1073741824 -> 8388608",
        f"{workers}: segment.ms 3600000 -> 60000",
    ]
    assert again.altered == []
    after = await topic_configs(kafka_bootstrap, workers)
    assert {k: after[k] for k in ROLL_AND_CLEAN} == ROLL_AND_CLEAN
    # Only the keys named changed: the topic's other overrides are still there.
    assert after["min.insync.replicas"] == before["min.insync.replicas"]
    assert after["unclean.leader.election.enable"] == before["unclean.leader.election.enable"]
    assert [r.key for r in await read_all(settings)] == [b"w-1"]


async def test_a_setting_the_broker_refuses_is_reported_not_half_done(
    kafka_bootstrap: str,
) -> None:
    """Kafka 4.1 wants segment.bytes of at least 1 MiB: an existing topic is left as it is and
    the difference reported with the broker's reason (exit 1 from `topics ensure`)."""
    settings = fresh_topics(kafka_bootstrap, "hr")
    workers = settings.topics.workers.name
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(
                Topics(prefix=settings.topic_prefix, workers_segment_bytes=1000)
            )
    [difference] = info.value.differences
    assert difference.startswith(
        f"{workers}: segment.bytes=8388608, expected 1000 (not set in place: "
    )
    assert "INVALID_CONFIG" in difference or "InvalidConfig" in difference, difference
    assert (await topic_configs(kafka_bootstrap, workers))["segment.bytes"] == "8388608"


async def test_the_cleaner_compacts_heartbeats_to_about_one_record_per_worker(
    kafka_bootstrap: str,
) -> None:
    """With segments that roll fast (here 100 ms, for a test that takes seconds: the broker's
    cleaner looks every ``log.cleaner.backoff.ms``, 5 s on the test broker), the rolled
    heartbeats are compacted away and each worker's latest heartbeat survives."""
    settings = fresh_topics(kafka_bootstrap, "hc")
    topics = Topics(prefix=settings.topic_prefix, workers_segment_ms=100)
    async with Admin(settings) as admin:
        await admin.ensure_topics(topics)
    workers = [f"w-{i}" for i in range(10)]
    await beat(settings, workers, rounds=30)
    written = 30 * len(workers)
    replayed = await read_all(settings)
    assert len(replayed) >= written
    async with asyncio.timeout(120):
        while len(replayed) > written // 4:
            # A round more: segments roll on an append (the active one is never cleaned).
            await beat(settings, workers, rounds=1)
            written += len(workers)
            replayed = await read_all(settings)
    latest: dict[str, int] = {}
    for record in replayed:
        if record.value is not None:
            hb = decode_heartbeat(record.value)
            latest[hb.worker_id] = max(latest.get(hb.worker_id, 0), hb.seq)
    assert latest == {w: written // len(workers) for w in workers}  # every worker's latest


async def beat(settings: KafkaSettings, workers: list[str], rounds: int) -> None:
    """``rounds`` heartbeats of each worker, ``seq`` counting them from 1 per worker."""
    async with Producer(settings) as producer:
        for _ in range(rounds):
            items = []
            for worker_id in workers:
                seq = _sent.get((settings.topic_prefix, worker_id), 0) + 1
                _sent[(settings.topic_prefix, worker_id)] = seq
                hb = fake_heartbeat(worker_id, utcnow(), interval_s=3.0, seq=seq)
                items.append((worker_key(worker_id), encode(hb)))
            await producer.send_many(settings.topics.workers.name, items)


_sent: dict[tuple[str, str], int] = {}


async def read_all(settings: KafkaSettings) -> list[Record]:
    """Every record of the workers topic, from its beginning to its end now."""
    topic = settings.topics.workers.name
    async with Consumer(settings) as consumer:
        await consumer.assign(topic)
        await consumer.seek_to_beginning()
        [end] = (await consumer.end_offsets(topic)).values()
        records: list[Record] = []
        async with asyncio.timeout(30):
            while not records or records[-1].offset + 1 < end:
                records += await consumer.fetch(timeout_s=0.5)
    return records
