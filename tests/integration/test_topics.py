"""Topic administration against the real broker: ensure is idempotent and reports mismatches."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import pytest

from controlplane.bus import LOG_APPEND_TIME, Admin, Consumer, Producer, Record
from controlplane.errors import ErrorCode, TopicMismatch
from controlplane.settings import KafkaSettings
from controlplane.topics import Topics

pytestmark = pytest.mark.kafka


async def test_ensure_creates_then_is_idempotent(kafka_bootstrap: str) -> None:
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, topic_prefix=f"e{uuid.uuid4().hex[:8]}"
    )
    async with Admin(settings) as admin:
        first = await admin.ensure_topics(settings.topics)
        second = await admin.ensure_topics(settings.topics)
    names = [t.name for t in settings.topics.all()]
    assert first.created == names and first.existing == []
    assert second.created == [] and second.existing == names


async def test_ensure_reports_partition_and_config_differences(kafka_bootstrap: str) -> None:
    prefix = f"m{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    async with Admin(settings) as admin:
        await admin.ensure_topics(Topics(prefix=prefix, retention_ms=60_000))
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(settings.topics)
    assert info.value.code is ErrorCode.TOPIC_MISMATCH
    assert any(f"{prefix}.commands: retention.ms=60000" in d for d in info.value.differences), (
        info.value.differences
    )
    assert any(f"{prefix}.acks: retention.ms=60000" in d for d in info.value.differences), (
        info.value.differences
    )
    assert not any(".workers" in d for d in info.value.differences)


async def test_ensure_reports_a_partition_count_difference(kafka_bootstrap: str) -> None:
    prefix = f"p{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)

    class FewerAcks(Topics):
        @property
        def acks(self):  # type: ignore[no-untyped-def,override]
            spec = super().acks
            return type(spec)(spec.name, 2, spec.config)

    async with Admin(settings) as admin:
        await admin.ensure_topics(FewerAcks(prefix=prefix))
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(settings.topics)
    assert info.value.differences == [f"{prefix}.acks: 2 partitions, expected 6"]


class _OlderTopics(Topics):
    """Topics as an earlier version created them: no LogAppendTime on the workers topic."""

    @property
    def workers(self):  # type: ignore[no-untyped-def,override]
        spec = super().workers
        config = {k: v for k, v in spec.config.items() if k != "message.timestamp.type"}
        return type(spec)(spec.name, spec.partitions, config)


async def test_the_workers_topic_stamps_heartbeats_with_the_brokers_clock(
    kafka_bootstrap: str,
) -> None:
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, topic_prefix=f"l{uuid.uuid4().hex[:8]}"
    )
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
    async with Producer(settings) as producer:
        await producer.send(settings.topics.workers.name, b"{}", key=b"w")
    async with Consumer(settings) as consumer:
        await consumer.assign(settings.topics.workers.name)
        await consumer.seek_to_beginning()
        records: list[Record] = []
        async with asyncio.timeout(30):
            while not records:
                records = await consumer.fetch(timeout_s=0.5)
    assert records[0].timestamp_type == LOG_APPEND_TIME


async def test_topics_created_without_log_append_time_are_reported_not_a_crash(
    kafka_bootstrap: str,
) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    async with Admin(settings) as admin:
        await admin.ensure_topics(_OlderTopics(prefix=prefix))
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(settings.topics)
    assert info.value.differences == [
        f"{prefix}.workers: message.timestamp.type=CreateTime, expected LogAppendTime"
    ]
    args = ["topics", "ensure", "-b", kafka_bootstrap, "--topic-prefix", prefix]
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "controlplane", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: TOPIC_MISMATCH: existing topics differ"), proc.stderr
    assert "message.timestamp.type=CreateTime, expected LogAppendTime" in proc.stderr
    assert "kafka-configs.sh" in proc.stderr
