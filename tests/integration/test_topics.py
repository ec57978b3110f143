"""Topic administration against the real broker: ensure is idempotent and reports mismatches."""

from __future__ import annotations

import uuid

import pytest

from controlplane.bus import Admin
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
