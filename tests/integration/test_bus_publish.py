"""Bounded produce on a real broker: a publish never hangs, and its error says whether the record
may be in the log (PUBLISH_OUTCOME_UNKNOWN) or certainly is not (BROKER_UNAVAILABLE).

"Below min.insync.replicas" on the 3-node local cluster: a topic with two replicas (nodes
LEADER and VICTIM) and ``min.insync.replicas=2``, then VICTIM SIGKILLed. Until KRaft fences it,
acks=all writes wait for it; after, they fail with the retriable NOT_ENOUGH_REPLICAS (or
NOT_ENOUGH_REPLICAS_AFTER_APPEND: the record *is* in the leader's log), which the idempotent
producer retries for ever. Setting ``min.insync.replicas`` back to 1 lets them through.
(On one broker the trick does not work: Kafka 4 caps the effective min ISR at the replica
count, so RF 1 with ``min.insync.replicas=2`` takes writes.) The helpers here serve the CLI
and API tests too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.bus import Consumer, Producer, Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.topics import Topics
from tests.factories import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: A guard against a hang, far above any bound under test (not a measurement).
HANG_S = 90.0
NODES = 3
#: The node that leads the below-min-ISR topics, and the one whose loss puts them below.
LEADER, VICTIM = 1, 3


# --------------------------------------------------------------------------- helpers


async def _admin(bootstrap: str) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    return admin


async def create_topic(
    bootstrap: str,
    name: str,
    config: Mapping[str, str],
    *,
    partitions: int = 1,
    replicas: Sequence[int] | None = None,
) -> None:
    """Create ``name`` with exactly ``config`` (no checks of ours); ``replicas``: the node ids
    of every partition's replicas, the first its preferred leader (default: RF 1, anywhere)."""
    if replicas is None:
        topic = NewTopic(name, partitions, 1, topic_configs=dict(config))
    else:
        assignment = {p: list(replicas) for p in range(partitions)}
        topic = NewTopic(name, -1, -1, replica_assignments=assignment, topic_configs=dict(config))
    admin = await _admin(bootstrap)
    try:
        resp = await admin.create_topics([topic])
    finally:
        await admin.close()
    errors = [(t[0], t[1]) for t in resp.topic_errors if t[1] != 0]
    assert not errors, errors


async def set_topic_config(bootstrap: str, name: str, config: Mapping[str, str]) -> None:
    """Replace the topic's configs with ``config`` (AlterConfigs is not incremental). Tried
    again while the admin client picks a node that was killed and is not fenced yet."""
    resource = ConfigResource(ConfigResourceType.TOPIC, name, configs=dict(config))
    async with asyncio.timeout(HANG_S):
        while True:
            admin = await _admin(bootstrap)
            try:
                resp = await admin.alter_configs([resource])
                break
            except KafkaError:
                await asyncio.sleep(0.25)  # a retry's pace, not a synchronization
            finally:
                await admin.close()
    [result] = resp[0].resources
    assert result[0] == 0, result


async def all_nodes_up(cluster: LocalCluster) -> None:
    """Start any node a failed test left down (the cluster is shared by the session)."""
    for node_id in range(1, NODES + 1):
        if not cluster.node(node_id).status().running:
            await asyncio.to_thread(cluster.start_node, node_id, timeout=180)
    await asyncio.to_thread(cluster.wait_for_brokers, NODES, timeout=180)


@asynccontextmanager
async def node_down(cluster: LocalCluster, node_id: int = VICTIM) -> AsyncIterator[None]:
    """SIGKILL ``node_id`` for the block; it is started again (and counted back) after."""
    await asyncio.to_thread(cluster.stop_node, node_id, kill=True)
    try:
        yield
    finally:
        await all_nodes_up(cluster)


async def fleet_below_min_isr(cluster: LocalCluster, held: str = "commands") -> KafkaSettings:
    """A fresh prefix on the cluster: the ``held`` topic (commands, acks or workers) on LEADER
    and VICTIM with min ISR 2 (no write gets through while VICTIM is down), the others on
    LEADER alone."""
    await all_nodes_up(cluster)
    settings = KafkaSettings(
        bootstrap_servers=cluster.bootstrap, topic_prefix=f"u{uuid.uuid4().hex[:10]}"
    )
    topics = Topics(prefix=settings.topic_prefix, replication_factor=1)
    for spec in topics.all():
        config = dict(spec.config)
        replicas = [LEADER]
        if spec.name == f"{settings.topic_prefix}.{held}":
            config["min.insync.replicas"] = "2"
            replicas = [LEADER, VICTIM]
        await create_topic(
            settings.bootstrap_servers,
            spec.name,
            config,
            partitions=spec.partitions,
            replicas=replicas,
        )
    return settings


async def restore_commands_topic(settings: KafkaSettings) -> None:
    """The commands topic takes writes with one replica in sync again (min ISR 1)."""
    spec = Topics(prefix=settings.topic_prefix, replication_factor=1).commands
    await set_topic_config(settings.bootstrap_servers, spec.name, spec.config)


async def read_topic(settings: KafkaSettings, topic: str) -> list[Record]:
    """Every record of ``topic`` (one partition) up to its end now."""
    async with Consumer(settings) as consumer:
        await consumer.assign(topic)
        await consumer.seek_to_beginning()
        end = (await consumer.end_offsets(topic))[0]
        records: list[Record] = []
        async with asyncio.timeout(HANG_S):
            while end and (not records or records[-1].offset < end - 1):
                records.extend(await consumer.fetch(timeout_s=0.5))
        return records


# --------------------------------------------------------------------------- tests


async def test_below_min_isr_a_publish_is_unknown_in_time_and_lands_once_when_waited_again(
    kafka_cluster: LocalCluster,
) -> None:
    settings = KafkaSettings(
        bootstrap_servers=kafka_cluster.bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:10]}"
    )
    topic = f"{settings.topic_prefix}.below-min-isr"
    await all_nodes_up(kafka_cluster)
    await create_topic(
        settings.bootstrap_servers, topic, {"min.insync.replicas": "2"}, replicas=[LEADER, VICTIM]
    )
    async with Producer(settings) as producer:
        await producer.send(topic, b"before", key=b"k")  # both replicas in sync: confirmed
        async with node_down(kafka_cluster, VICTIM):
            # send(): bounded by its timeout, and not "not published": it may still be.
            with pytest.raises(BusError) as info:
                async with asyncio.timeout(HANG_S):
                    await producer.send(topic, b"maybe", key=b"k", timeout_s=3)
            assert info.value.code is LocalCode.PUBLISH_OUTCOME_UNKNOWN
            assert "may still be written" in info.value.message
            # submit() + wait(): the same record is waited on again, never sent twice.
            delivery = await producer.submit(topic, b"once", key=b"k", timeout_s=10)
            with pytest.raises(BusError) as again:
                await delivery.wait(1)
            assert again.value.code.value == "PUBLISH_OUTCOME_UNKNOWN"
            assert not delivery.done  # still queued, still retried
            await set_topic_config(settings.bootstrap_servers, topic, {"min.insync.replicas": "1"})
            record = await delivery.wait(HANG_S)
            assert delivery.done and record == await delivery.wait(0)  # the same answer again
    log = await read_topic(settings, topic)
    # The "unknown" record was published after all (retried by the producer), and once.
    assert [r.value for r in log] == [b"before", b"maybe", b"once"]
    assert log[-1].offset == record.offset


async def test_a_send_to_a_topic_the_cluster_lacks_is_broker_unavailable(
    kafka_cluster: LocalCluster,
) -> None:
    """The record never reaches the producer's queue (no metadata: auto-create is off): certainly
    not published, so BROKER_UNAVAILABLE, not an unknown outcome."""
    await all_nodes_up(kafka_cluster)
    settings = KafkaSettings(bootstrap_servers=kafka_cluster.bootstrap)
    async with Producer(settings) as producer:
        with pytest.raises(BusError) as info:
            async with asyncio.timeout(HANG_S):
                await producer.send(f"x{uuid.uuid4().hex[:10]}.nowhere", b"v", timeout_s=2)
    assert info.value.code is LocalCode.BROKER_UNAVAILABLE
    assert "nothing was published" in info.value.message


async def test_a_producer_on_an_unreachable_bootstrap_is_broker_unavailable() -> None:
    settings = KafkaSettings(
        bootstrap_servers=f"127.0.0.1:{free_port()}",
        request_timeout_ms=2000,
        delivery_timeout_ms=2000,
    )
    with pytest.raises(BusError) as info:
        async with asyncio.timeout(HANG_S), Producer(settings) as producer:
            await producer.send("anything", b"v")
    assert info.value.code is LocalCode.BROKER_UNAVAILABLE
