"""The fault suite's reads of the cluster: polling a condition to a deadline, every record of a
topic to its end, partition leaders, replication and ``min.insync.replicas``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from controlplane.coordinator.follower import PROBE_KEY
from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.topics import worker_key

if TYPE_CHECKING:
    from tests.faults.processes import Fleet

JSON = dict[str, Any]
NODES = 3


async def until(
    predicate: Callable[[], Awaitable[bool] | bool], *, timeout: float, what: str
) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.25)


# --------------------------------------------------------------------------- reading the log


async def read_topic(
    bootstrap: str, topic: str, decode: Callable[[bytes], Any], timeout: float = 60.0
) -> list[Any]:
    """Every record of ``topic`` from the beginning to its end now, decoded (but the probe
    records readers append to the workers topic)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        async with asyncio.timeout(timeout):
            partitions: set[int] | None = None
            while not partitions:
                partitions = consumer.partitions_for_topic(topic)
                if not partitions:
                    await consumer._client.force_metadata_update()
            tps = [TopicPartition(topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            items: list[Any] = []

            async def behind() -> bool:
                return any([await consumer.position(tp) < ends[tp] for tp in tps])

            while await behind():
                batch = await consumer.getmany(*tps, timeout_ms=500)
                for records in batch.values():
                    items += [
                        decode(r.value)
                        for r in records
                        if r.value is not None and r.key != PROBE_KEY  # readers' probes
                    ]
            return items
    finally:
        await consumer.stop()


async def readable(bootstrap: str, topics: Iterable[str], timeout: float = 15.0) -> bool:
    """Whether every partition of ``topics`` answers a read to its end now (after a failover a
    new leader answers for its end offset only once its high watermark is established)."""
    try:
        for topic in topics:
            await read_topic(bootstrap, topic, lambda value: value, timeout=timeout)
    except (KafkaError, TimeoutError):
        return False
    return True


async def partition_leaders(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> leader node id, for partitions that have a leader now ({} on an error)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        [described] = await admin.describe_topics([topic])
    except KafkaError:
        return {}
    finally:
        await admin.close()
    if described["error_code"] != 0:
        return {}
    return {
        int(p["partition"]): int(p["leader"])
        for p in described["partitions"]
        if p["error_code"] == 0 and p["leader"] >= 0
    }


def ack_partition(worker_id: str, partitions: int) -> int:
    """The acks partition a worker's acks go to (keyed by worker id, the default partitioner)."""
    every = list(range(partitions))
    return int(DefaultPartitioner()(worker_key(worker_id), every, every))


async def fully_replicated(bootstrap: str, topics: Iterable[str]) -> bool:
    """Every partition of ``topics`` has a leader and all three replicas in sync."""
    return await in_sync_everywhere(bootstrap, topics, NODES)


async def in_sync_everywhere(bootstrap: str, topics: Iterable[str], replicas: int) -> bool:
    """Every partition of ``topics`` has a leader and exactly ``replicas`` replicas in sync."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        described = await admin.describe_topics(list(topics))
    except KafkaError:
        return False
    finally:
        await admin.close()
    for topic in described:
        if topic["error_code"] != 0 or not topic["partitions"]:
            return False
        for p in topic["partitions"]:
            if p["error_code"] != 0 or p["leader"] < 0 or len(p["isr"]) != replicas:
                return False
    return True


async def set_min_insync(fleet: Fleet, value: int, timeout: float = 120.0) -> None:
    """Set ``min.insync.replicas`` of the fleet's three topics, keeping their other configs
    (AlterConfigs replaces a topic's whole config: the product's own is sent with it), and
    wait until the cluster describes the new value."""
    settings = KafkaSettings(
        bootstrap_servers=fleet.bootstrap,
        topic_prefix=fleet.prefix,
        replication_factor=NODES,
        min_insync_replicas=2,
    )
    specs = settings.topics.all()
    wanted = {spec.name: {**spec.config, "min.insync.replicas": str(value)} for spec in specs}
    admin = AIOKafkaAdminClient(bootstrap_servers=fleet.bootstrap)
    await admin.start()
    try:
        responses = await admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n, c) for n, c in wanted.items()]
        )
        for response in responses:
            for resource in response.resources:
                assert resource[0] == 0, f"alter configs: {resource}"

        async def described() -> bool:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, n, None) for n in wanted]
            )
            got = {
                resource[3]: {entry[0]: entry[1] for entry in resource[4]}
                for response in responses
                for resource in response.resources
            }
            return all(got.get(n, {}).items() >= c.items() for n, c in wanted.items())

        await until(described, timeout=timeout, what=f"min.insync.replicas {value} described")
    finally:
        await admin.close()


async def whole(cluster: LocalCluster, topics: Iterable[str], timeout: float = 240.0) -> None:
    """Three brokers, and every partition of ``topics`` (and of the consumer offsets) led and
    with three in-sync replicas: the next node can be crashed without going below min ISR."""
    await asyncio.to_thread(cluster.wait_for_brokers, NODES, timeout=timeout)
    names = [*topics, "__consumer_offsets"]
    await until(
        lambda: fully_replicated(cluster.bootstrap, names),
        timeout=timeout,
        what=f"every partition of {names} has 3 in-sync replicas",
    )
