"""Topic administration against the real broker: ensure is idempotent and reports mismatches."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Awaitable

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.bus import LOG_APPEND_TIME, Admin, Consumer, Producer, Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode, TopicMismatch
from controlplane.wire.topics import Topics
from tests.factories import fresh_topics

pytestmark = pytest.mark.kafka


async def test_ensure_creates_then_is_idempotent(kafka_bootstrap: str) -> None:
    settings = fresh_topics(kafka_bootstrap, "e")
    async with Admin(settings) as admin:
        first = await admin.ensure_topics(settings.topics)
        second = await admin.ensure_topics(settings.topics)
    names = [t.name for t in settings.topics.ensured()]
    assert first.created == names and first.existing == []
    assert second.created == [] and second.existing == names


async def test_ensure_reports_partition_and_config_differences(kafka_bootstrap: str) -> None:
    settings = fresh_topics(kafka_bootstrap, "m")
    prefix = settings.topic_prefix
    async with Admin(settings) as admin:
        await admin.ensure_topics(Topics(prefix=prefix, retention_ms=60_000))
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(settings.topics)
    assert info.value.code is LocalCode.TOPIC_MISMATCH
    assert any(f"{prefix}.commands: retention.ms=60000" in d for d in info.value.differences), (
        info.value.differences
    )
    assert any(f"{prefix}.acks: retention.ms=60000" in d for d in info.value.differences), (
        info.value.differences
    )
    assert not any(".workers" in d for d in info.value.differences)


async def test_ensure_reports_a_partition_count_difference(kafka_bootstrap: str) -> None:
    settings = fresh_topics(kafka_bootstrap, "p")
    prefix = settings.topic_prefix

    class FewerAcks(Topics):
        @property
        def acks(self):  # type: ignore[no-untyped-def]
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
    def workers(self):  # type: ignore[no-untyped-def]
        spec = super().workers
        config = {k: v for k, v in spec.config.items() if k != "message.timestamp.type"}
        return type(spec)(spec.name, spec.partitions, config)


async def test_the_workers_topic_stamps_heartbeats_with_the_brokers_clock(
    kafka_bootstrap: str,
) -> None:
    settings = fresh_topics(kafka_bootstrap, "l")
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
    settings = fresh_topics(kafka_bootstrap, "c")
    prefix = settings.topic_prefix
    async with Admin(settings) as admin:
        await admin.ensure_topics(_OlderTopics(prefix=prefix))
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(settings.topics)
    assert info.value.differences == [
        f"{prefix}.workers: message.timestamp.type=CreateTime, expected LogAppendTime"
    ]
    proc = await topics_ensure(kafka_bootstrap, prefix)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: TOPIC_MISMATCH: existing topics differ"), proc.stderr
    assert "message.timestamp.type=CreateTime, expected LogAppendTime" in proc.stderr
    assert "kafka-configs.sh" in proc.stderr


# --------------------------------------------------------------------------- replication


async def _replication(bootstrap: str, names: list[str]) -> dict[str, tuple[set[int], str, str]]:
    """Per topic, as the broker describes it: the replica counts of its partitions, its
    min.insync.replicas and its unclean.leader.election.enable."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        # A broker other than the controller may not know a topic created a moment ago.
        async with asyncio.timeout(30):
            while True:
                described = await admin.describe_topics(names)
                responses = await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
                )
                configs = {
                    resource[3]: {entry[0]: entry[1] for entry in resource[4]}
                    for response in responses
                    for resource in response.resources
                    if resource[0] == 0
                }
                if set(configs) == set(names) and all(d["partitions"] for d in described):
                    break
                await asyncio.sleep(0.1)  # a poll interval, not a wait for something
    finally:
        await admin.close()
    return {
        d["topic"]: (
            {len(p["replicas"]) for p in d["partitions"]},
            configs[d["topic"]]["min.insync.replicas"],
            configs[d["topic"]]["unclean.leader.election.enable"],
        )
        for d in described
    }


async def _cluster(bootstrap: str) -> tuple[int, int]:
    """(brokers, default.replication.factor) of the cluster, read without the product's code."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        brokers = [b["node_id"] for b in (await admin.describe_cluster())["brokers"]]
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, str(brokers[0]))]
        )
    finally:
        await admin.close()
    entries = {entry[0]: entry[1] for entry in response.resources[0][4]}
    return len(brokers), int(entries["default.replication.factor"])


async def test_defaults_take_the_clusters_replication_factor_and_pass_the_check(
    kafka_bootstrap: str,
) -> None:
    settings = fresh_topics(kafka_bootstrap, "r")
    prefix = settings.topic_prefix
    async with Admin(settings) as admin:
        created = await admin.ensure_topics(settings.topics)
        checked = await admin.ensure_topics(settings.topics)
    names = [t.name for t in settings.topics.ensured()]
    assert created.created == names and checked.existing == names
    brokers, default_rf = await _cluster(kafka_bootstrap)
    min_isr = str(default_rf - 1 if default_rf >= 3 else 1)
    if brokers == 1:
        assert (default_rf, min_isr) == (1, "1")
    assert (created.replication_factor, created.min_insync_replicas) == (default_rf, int(min_isr))
    assert (checked.replication_factor, checked.min_insync_replicas) == (default_rf, int(min_isr))
    described = await _replication(kafka_bootstrap, names)
    assert described == {
        f"{prefix}.commands": ({default_rf}, min_isr, "false"),
        f"{prefix}.acks": ({default_rf}, min_isr, "false"),
        f"{prefix}.workers": ({default_rf}, min_isr, "false"),
        f"{prefix}.controller": ({default_rf}, min_isr, "false"),
    }


async def test_a_topic_made_by_hand_with_another_min_insync_is_reported(
    kafka_bootstrap: str,
) -> None:
    settings = fresh_topics(kafka_bootstrap, "i")
    prefix = settings.topic_prefix
    _, default_rf = await _cluster(kafka_bootstrap)
    acks = settings.topics.resolved(default_rf).acks
    want = acks.config["min.insync.replicas"]
    other = str(int(want) + 1)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        config = {**acks.config, "min.insync.replicas": other}
        await admin.create_topics(
            [NewTopic(acks.name, acks.partitions, default_rf, topic_configs=config)]
        )
    finally:
        await admin.close()
    async with Admin(settings) as ours:
        with pytest.raises(TopicMismatch) as info:
            await ours.ensure_topics(settings.topics)
    assert info.value.code is LocalCode.TOPIC_MISMATCH
    assert info.value.differences == [
        f"{prefix}.acks: min.insync.replicas={other}, expected {want}"
    ]
    assert "kafka-configs.sh" in info.value.message
    # As a user sees it: `topics ensure` exits 1 and names the difference, no traceback.
    proc = await topics_ensure(kafka_bootstrap, prefix)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: TOPIC_MISMATCH: existing topics differ"), proc.stderr
    assert f"{prefix}.acks: min.insync.replicas={other}, expected {want}" in proc.stderr


async def test_topics_with_fewer_replicas_than_wanted_are_reported_not_a_crash(
    kafka_bootstrap: str,
) -> None:
    prefix = f"f{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, replication_factor=1
    )
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
        with pytest.raises(TopicMismatch) as info:
            await admin.ensure_topics(Topics(prefix=prefix, replication_factor=2))
    assert info.value.differences == [
        f"{prefix}.commands: replication factor 1, expected 2",
        f"{prefix}.acks: replication factor 1, expected 2",
        f"{prefix}.workers: replication factor 1, expected 2",
        f"{prefix}.controller: replication factor 1, expected 2",
    ]
    assert "kafka-reassign-partitions.sh" in info.value.message


async def test_more_replicas_than_brokers_is_a_coded_error_in_the_brokers_words(
    kafka_bootstrap: str,
) -> None:
    brokers, _ = await _cluster(kafka_bootstrap)
    prefix = f"b{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, replication_factor=brokers + 1
    )
    async with Admin(settings) as admin:
        with pytest.raises(BusError) as info:
            async with asyncio.timeout(60):
                await admin.ensure_topics(settings.topics)
    assert info.value.code is LocalCode.SETTINGS_INVALID
    message = info.value.message
    assert message.startswith(f"creating topics with replication factor {brokers + 1} failed")
    assert f"{prefix}.commands: INVALID_REPLICATION_FACTOR (38): " in message
    # The broker's own explanation, e.g. "... only 1 broker(s) are registered."
    assert "broker" in message.split("INVALID_REPLICATION_FACTOR (38): ", 1)[1]


async def test_min_insync_above_the_replication_factor_is_refused_before_creating(
    kafka_bootstrap: str,
) -> None:
    settings = fresh_topics(kafka_bootstrap, "n")
    prefix = settings.topic_prefix
    async with Admin(settings) as admin:
        with pytest.raises(BusError) as info:
            await admin.ensure_topics(
                Topics(prefix=prefix, replication_factor=1, min_insync_replicas=2)
            )
    assert info.value.code is LocalCode.SETTINGS_INVALID
    assert "min.insync.replicas 2 exceeds the replication factor 1" in info.value.message
    assert not {t.name for t in settings.topics.ensured()} & set(
        await _topic_names(kafka_bootstrap)
    )


async def _topic_names(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        names: list[str] = await admin.list_topics()
    finally:
        await admin.close()
    return names


# --------------------------------------------------------------------------- on the 3-node cluster


@pytest.mark.slow
async def test_on_the_3_node_cluster_ensure_makes_rf_3_min_isr_2_and_reports_rf_1(
    kafka_cluster: LocalCluster,
) -> None:
    bootstrap = kafka_cluster.bootstrap
    settings = fresh_topics(bootstrap, "k")
    prefix = settings.topic_prefix
    async with Admin(settings) as admin:
        report = await admin.ensure_topics(settings.topics)
    assert (report.replication_factor, report.min_insync_replicas) == (3, 2)
    names = [t.name for t in settings.topics.ensured()]
    assert await _replication(bootstrap, names) == {
        f"{prefix}.commands": ({3}, "2", "false"),
        f"{prefix}.acks": ({3}, "2", "false"),
        f"{prefix}.workers": ({3}, "2", "false"),
        f"{prefix}.controller": ({3}, "2", "false"),
    }
    # Topics made as the product made them before (RF 1) are a mismatch, not `ok`.
    old = f"k{uuid.uuid4().hex[:8]}"
    async with Admin(settings) as admin:
        await admin.ensure_topics(Topics(prefix=old, replication_factor=1))
    proc = await topics_ensure(bootstrap, old)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{old}.acks: replication factor 1, expected 3" in proc.stderr
    assert f"{old}.acks: min.insync.replicas=1, expected 2" in proc.stderr


@pytest.mark.slow
async def test_ensure_works_while_a_crashed_node_is_not_yet_fenced(
    kafka_cluster: LocalCluster,
) -> None:
    """A SIGKILLed node stays in the metadata for seconds; admin requests sent to it (aiokafka
    picks a random broker) failed `topics ensure` with BROKER_UNAVAILABLE."""
    bootstrap = kafka_cluster.bootstrap
    existing = f"u{uuid.uuid4().hex[:8]}"
    async with Admin(KafkaSettings(bootstrap_servers=bootstrap)) as admin:
        await admin.ensure_topics(Topics(prefix=existing))
    kafka_cluster.stop_node(2, kill=True)
    try:
        for _ in range(3):
            for prefix in (existing, f"u{uuid.uuid4().hex[:8]}"):
                settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix)
                async with Admin(settings) as admin:
                    report = await admin.ensure_topics(settings.topics)
                assert (report.replication_factor, report.min_insync_replicas) == (3, 2)
    finally:
        await asyncio.to_thread(kafka_cluster.start_node, 2, timeout=180)


async def test_topics_ensure_takes_replication_options_and_refuses_bad_ones(
    kafka_bootstrap: str,
) -> None:
    """As a user types it: more replicas than brokers, or a min ISR above the factor, is
    invalid input (exit 3, one coded line in the broker's or our words); a valid pair is made
    and said."""
    brokers, _ = await _cluster(kafka_bootstrap)

    def ensure(*extra: str) -> Awaitable[subprocess.CompletedProcess[str]]:
        return topics_ensure(kafka_bootstrap, f"o{uuid.uuid4().hex[:8]}", *extra)

    proc = await ensure("--replication-factor", str(brokers + 1))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: SETTINGS_INVALID: "), proc.stderr
    assert "INVALID_REPLICATION_FACTOR (38)" in proc.stderr and "Traceback" not in proc.stderr
    proc = await ensure("--replication-factor", "2", "--min-insync-replicas", "3")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "min" in proc.stderr and "Traceback" not in proc.stderr
    proc = await ensure("--replication-factor", str(brokers), "--min-insync-replicas", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"replication factor {brokers}, min.insync.replicas 1" in proc.stdout


async def topics_ensure(
    bootstrap: str, prefix: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    """`controlplane topics ensure` as a user runs it, in a process of its own."""
    args = ["topics", "ensure", "-b", bootstrap, "--topic-prefix", prefix, *extra]
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "controlplane", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
