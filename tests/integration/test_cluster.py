"""The local 3-node KRaft cluster: it starts as one cluster, replicated writes survive a crashed
leader, and a crashed node rejoins.

One cluster for the whole session (``kafka_cluster``); every test here leaves all three nodes
running (the ``cluster`` fixture restarts any node a failing test left down).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from controlplane.coordinator.follower import Follower
from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.bus import Admin, Producer, probe, probe_sync
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.registry import lost_at
from controlplane.wire.protocol import encode, utcnow
from tests.conftest import partition_leader
from tests.factories import fake_heartbeat, heal

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

NODES = 3


@pytest.fixture
def cluster(kafka_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield kafka_cluster
    heal(kafka_cluster, NODES)


async def _until(predicate: Callable[[], Awaitable[bool]], *, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.25)
    pytest.fail(f"not within {timeout:.0f}s: {what}")


async def _partition(admin: AIOKafkaAdminClient, topic: str) -> dict[str, Any]:
    """Partition 0's metadata; empty while the topic is not yet known (just created), or while
    the admin client still asks a node that crashed (it finds a live one on its next call)."""
    try:
        [described] = await admin.describe_topics([topic])
    except KafkaError:
        return {}
    partitions = [p for p in described["partitions"] if p["partition"] == 0]
    return dict(partitions[0]) if described["error_code"] == 0 and partitions else {}


def test_three_nodes_one_cluster(cluster: LocalCluster) -> None:
    status = cluster.status()
    assert status.running and status.running_nodes == [1, 2, 3]
    assert len(status.bootstrap.split(",")) == NODES
    info = probe_sync(cluster.bootstrap, timeout=20)
    assert info.brokers == NODES
    assert info.controller_id in (1, 2, 3)
    # Every node answers for the same cluster, the one its storage was formatted with.
    for node in cluster.nodes:
        assert probe_sync(node.bootstrap, timeout=20).cluster_id == status.cluster_id
        meta = (node.data_dir / "kraft-logs" / "meta.properties").read_text()
        assert f"cluster.id={status.cluster_id}" in meta
        assert f"node.id={node.config.node_id}" in meta


async def test_replication_defaults_follow_the_node_count(cluster: LocalCluster) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:
        wanted = {
            "default.replication.factor": "3",
            "min.insync.replicas": "2",
            "offsets.topic.replication.factor": "3",
            "transaction.state.log.replication.factor": "3",
        }
        for node_id in range(1, NODES + 1):
            [resp] = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, str(node_id), dict.fromkeys(wanted))]
            )
            [resource] = resp.resources
            assert resource[0] == 0, resource
            got = {entry[0]: entry[1] for entry in resource[4]}
            assert {k: got.get(k) for k in wanted} == wanted, node_id
    finally:
        await admin.close()


async def test_acks_all_survives_a_crashed_leader_and_the_node_rejoins(
    cluster: LocalCluster,
) -> None:
    topic = f"rf3-{uuid.uuid4().hex[:8]}"
    bootstrap = cluster.bootstrap
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    try:
        await admin.create_topics(
            [
                NewTopic(
                    topic,
                    num_partitions=1,
                    replication_factor=3,
                    topic_configs={"min.insync.replicas": "2"},
                )
            ]
        )

        async def fully_replicated() -> bool:
            p = await _partition(admin, topic)
            return p.get("error_code") == 0 and len(p["isr"]) == NODES

        await _until(fully_replicated, timeout=60, what=f"{topic} has 3 in-sync replicas")
        await producer.start()
        async with asyncio.timeout(60):
            await producer.send_and_wait(topic, b"before")

        leader = await partition_leader(bootstrap, topic)
        assert leader in (1, 2, 3)
        assert await asyncio.to_thread(cluster.stop_node, leader, kill=True)
        # The crash is seen: KRaft fences the dead broker, leaving two.
        await asyncio.to_thread(cluster.wait_for_brokers, NODES - 1, timeout=120)

        # Two in-sync replicas are left: min.insync.replicas=2 still takes acks=all writes.
        async with asyncio.timeout(120):
            await producer.send_and_wait(topic, b"after")

        async def failed_over() -> bool:
            p = await _partition(admin, topic)
            return p.get("error_code") == 0 and p["leader"] != leader and leader not in p["isr"]

        await _until(failed_over, timeout=60, what=f"a new leader for {topic}, without {leader}")

        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            values: list[bytes] = []
            async with asyncio.timeout(60):
                while len(values) < 2:
                    batch = await consumer.getmany(tp, timeout_ms=1000)
                    values += [m.value for m in batch.get(tp, []) if m.value is not None]
            assert values == [b"before", b"after"]
        finally:
            await consumer.stop()

        # The crashed node comes back: three brokers, and it catches up into the ISR.
        await asyncio.to_thread(cluster.start_node, leader, timeout=180)
        assert (await probe(bootstrap, timeout=20)).brokers == NODES
        await _until(fully_replicated, timeout=120, what=f"node {leader} back in {topic}'s ISR")
    finally:
        await producer.stop()
        await admin.close()


def test_clean_stop_and_start_of_one_node(cluster: LocalCluster) -> None:
    assert cluster.stop_node(3, kill=False)
    assert not cluster.node(3).status().running
    assert cluster.wait_for_brokers(NODES - 1, timeout=120) == NODES - 1
    assert cluster.status().running_nodes == [1, 2]
    status = cluster.start_node(3, timeout=180)
    assert status.running_nodes == [1, 2, 3]
    assert probe_sync(cluster.bootstrap, timeout=20).brokers == NODES


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "broker", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_finds_the_cluster_in_its_data_dir(cluster: LocalCluster) -> None:
    data_dir = str(cluster.data_dir)
    out = _cli("status", "--data-dir", data_dir)
    assert out.returncode == 0, out.stderr
    assert "3 of 3 nodes" in out.stdout and cluster.bootstrap in out.stdout
    # Starting it again is a no-op that prints the bootstrap list.
    out = _cli("start", "--nodes", "3", "--data-dir", data_dir)
    assert out.returncode == 0, out.stderr
    assert cluster.bootstrap in out.stdout
    # A different size for the same directory is a coded error, not a second cluster.
    out = _cli("start", "--nodes", "2", "--data-dir", data_dir)
    assert out.returncode == 3  # invalid input
    assert "SETTINGS_INVALID" in out.stderr and "Traceback" not in out.stderr
    out = _cli("start", "--data-dir", data_dir)
    assert out.returncode == 3
    assert "SETTINGS_INVALID" in out.stderr and "--nodes 3" in out.stderr


async def test_the_products_topics_on_the_cluster_are_replicated(
    cluster: LocalCluster, kafka_on_cluster: KafkaSettings
) -> None:
    """topics ensure with default settings takes the cluster's RF 3 and sets min ISR 2."""
    names = [spec.name for spec in kafka_on_cluster.topics.all()]
    assert len(names) == 3
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:
        for name in names:
            # The broker asked may not have applied the new topic's metadata yet: it answers
            # UNKNOWN_TOPIC_OR_PARTITION (3) until it has (a condition, with a deadline).
            deadline = time.monotonic() + 60
            while True:
                [described] = await admin.describe_topics([name])
                if described["error_code"] != 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert described["error_code"] == 0, described
            assert {len(p["replicas"]) for p in described["partitions"]} == {NODES}, name
        # A broker that has not applied the new topics' metadata yet answers without their
        # configs: ask again until every topic's is there (a condition, with a deadline).
        deadline = time.monotonic() + 60
        while True:
            responses = await admin.describe_configs(
                [
                    ConfigResource(ConfigResourceType.TOPIC, n, {"min.insync.replicas": None})
                    for n in names
                ]
            )
            got = {
                resource[3]: {entry[0]: entry[1] for entry in resource[4]}
                for resp in responses
                for resource in resp.resources
            }
            if all("min.insync.replicas" in got.get(n, {}) for n in names):
                break
            assert time.monotonic() < deadline, f"configs never described: {got}"
            await asyncio.sleep(0.2)
        assert {n: got[n]["min.insync.replicas"] for n in names} == dict.fromkeys(names, "2")
    finally:
        await admin.close()


# --------------------------------------------------------------------------- liveness
#
# A broker dies: until KRaft fences it (broker.session.timeout.ms), acks=all writes wait on
# every partition whose in-sync replicas still list it; after, with min.insync.replicas equal
# to the replication factor, they are refused. Every fetch still answers meanwhile: a reader
# that judged by its fetches alone would call every worker lost.


async def test_a_prober_judges_no_worker_lost_while_kafka_holds_writes_back(
    cluster: LocalCluster,
) -> None:
    prefix = f"p{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(
        bootstrap_servers=cluster.bootstrap,
        topic_prefix=prefix,
        replication_factor=NODES,
        min_insync_replicas=NODES,  # one node down: no write is taken
        delivery_timeout_ms=2000,
    )
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
    # A lease longer than the fencing delay (9 s): both phases, held back then refused, pass.
    hb = fake_heartbeat(
        "w-quiet",
        utcnow(),
        started_at=utcnow(),
        interval_s=5.0,
        lease_s=15.0,
    )
    async with (
        Follower(settings, probe=True, probe_interval_s=0.2) as prober,
        Follower(settings) as reader,
    ):
        await prober.catch_up()
        await reader.catch_up()
        async with Producer(settings) as producer:
            await producer.send(settings.topics.workers.name, encode(hb), key=b"w-quiet")

        def both_see_it() -> bool:
            return all(
                "w-quiet" in f.fleet.registry and f.current_as_of() is not None
                for f in (prober, reader)
            )

        await _poll_until([prober, reader], both_see_it, timeout=60)
        assert prober.probes_read > 0
        lost = lost_at(hb, prober.fleet.registry.received_at("w-quiet"))

        leader = await partition_leader(cluster.bootstrap, settings.topics.workers.name)
        victim = next(n for n in range(1, NODES + 1) if n != leader)
        assert await asyncio.to_thread(cluster.stop_node, victim, kill=True)
        try:
            # Every fetch answers, so a plain reader's time runs on past the lease...
            def fetched_past_the_lease() -> bool:
                fetched = prober.fetched_as_of()
                return fetched is not None and fetched >= lost and _as_of(reader) >= lost

            await _poll_until([prober, reader], fetched_past_the_lease, timeout=120)
            assert not reader.fleet.registry.is_alive("w-quiet", _as_of(reader))
            # ...while the prober judges only up to what it read of the log: alive there.
            assert _as_of(prober) < lost
            assert prober.fleet.registry.is_alive("w-quiet", _as_of(prober))
        finally:
            await asyncio.to_thread(cluster.start_node, victim, timeout=180)
        # Writes go through again: the silence is real now, and the prober sees it.
        await _poll_until([prober], lambda: _as_of(prober) >= lost, timeout=120)
        assert not prober.fleet.registry.is_alive("w-quiet", _as_of(prober))
        # Probes are neither workers nor garbage, to either reader.
        for follower in (prober, reader):
            assert list(follower.fleet.registry.heartbeats()) == [
                follower.fleet.registry.latest("w-quiet")
            ]
            assert follower.undecodable == 0 and follower.fold_errors == 0


async def _poll_until(followers: list[Follower], done: Callable[[], bool], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not done():
            for follower in followers:
                await follower.poll(timeout_s=0.05)


def _as_of(follower: Follower) -> datetime:
    as_of = follower.current_as_of()
    assert as_of is not None
    return as_of
