"""Shared fixtures: a real Apache Kafka broker for the session, and isolated topics per test.

Set KAFKA_BOOTSTRAP=host:port to run the Kafka tests against an existing cluster instead.
``kafka_cluster`` is a local 3-node KRaft cluster (started only by the tests that ask for it,
once per session): tests may crash and restart its nodes, and must leave all three running;
``kafka_on_cluster`` is ``kafka`` on it. ``kafka_secure`` is a secured broker (SASL_SSL with
SCRAM-SHA-512, ACLs enforced; started only by the tests that ask for it, once per session): the
settings of each of its users on the topics of :data:`SECURE_PREFIX`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from controlplane.kafka.broker import BrokerConfig, ClusterConfig, LocalBroker, LocalCluster
from controlplane.kafka.bus import Admin, probe_sync
from controlplane.kafka.secure import PRINCIPALS
from controlplane.kafka.settings import KafkaSettings
from tests.factories import free_port


def say(config: pytest.Config, line: str) -> None:
    """Write to the terminal now, past output capturing (the broker's version belongs in CI logs)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line(line)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a usable CUDA device the ``gpu`` tests are deselected (counted, not skipped).

    They run wherever a GPU is (``bash bench/gpu.sh OUTDIR`` runs exactly them with ``-m gpu``).
    """
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu or _cuda_available():
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    say(config, f"[gpu] no CUDA device: {len(gpu)} GPU tests deselected (run: bash bench/gpu.sh)")


@pytest.fixture(scope="session")
def kafka_bootstrap(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The bootstrap address of a real broker: $KAFKA_BOOTSTRAP, or one this session starts."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        info = probe_sync(external, timeout=20)
        say(request.config, f"\n[kafka] external cluster {external}: {info.brokers} broker(s)")
        yield external
        return
    broker = LocalBroker(
        BrokerConfig(
            port=free_port(),
            controller_port=free_port(),
            data_dir=tmp_path_factory.mktemp("kafka"),
        )
    )
    status = broker.start(timeout=120)
    say(
        request.config,
        f"\n[kafka] started Apache Kafka {status.kafka_version} (KRaft, pid {status.pid}) "
        f"at {status.bootstrap}",
    )
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """A local 3-node KRaft cluster (combined broker+controller nodes 1..3, RF 3, min ISR 2)."""
    cluster = LocalCluster(
        ClusterConfig(
            nodes=3,
            ports=[free_port() for _ in range(3)],
            controller_ports=[free_port() for _ in range(3)],
            data_dir=tmp_path_factory.mktemp("kafka-cluster"),
            heap_mb=256,
        )
    )
    status = cluster.start(timeout=180)
    say(
        request.config,
        f"\n[kafka] started a {len(status.nodes)}-node Apache Kafka {status.kafka_version} "
        f"cluster (KRaft, pids {', '.join(str(n.pid) for n in status.nodes)}) at {status.bootstrap}",
    )
    try:
        yield cluster
    finally:
        cluster.stop()


#: The one topic prefix of ``kafka_secure`` (its ACLs name the topics: each grant is a JVM run,
#: so they are made once); its tests tell themselves apart by worker and rollout ids.
SECURE_PREFIX = "sec"


async def _ensure_all_topics(settings: KafkaSettings) -> None:
    """What ``topics ensure`` makes: the fleet's topics and the snapshots topic."""
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
        await admin.ensure_topics(settings.topics.snapshots_only())


@pytest.fixture(scope="session")
def kafka_secure_broker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalBroker]:
    """A secured local broker (SASL_SSL, SCRAM-SHA-512, ACLs enforced, its controller on SSL
    with client certificates), the topics of :data:`SECURE_PREFIX` made by admin, the other
    users' ACLs on them granted."""
    broker = LocalBroker(
        BrokerConfig(
            port=free_port(),
            controller_port=free_port(),
            data_dir=tmp_path_factory.mktemp("kafka-secure"),
            secure=True,
        )
    )
    status = broker.start(timeout=120)
    try:
        asyncio.run(_ensure_all_topics(broker.settings("admin", topic_prefix=SECURE_PREFIX)))
        runs = broker.grant_acls(SECURE_PREFIX)
        say(
            request.config,
            f"\n[kafka] started a secured Apache Kafka {status.kafka_version} (SASL_SSL, "
            f"SCRAM-SHA-512, ACLs granted in {runs} JVM run(s); pid {status.pid}) at "
            f"{status.bootstrap}",
        )
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_secure(kafka_secure_broker: LocalBroker) -> dict[str, KafkaSettings]:
    """``kafka_secure_broker``'s users (admin, coordinator, ci, worker) -> their settings on the
    topics of :data:`SECURE_PREFIX`."""
    return {p: kafka_secure_broker.settings(p, topic_prefix=SECURE_PREFIX) for p in PRINCIPALS}


async def partition_leader(bootstrap: str, topic: str, partition: int = 0) -> int | None:
    """The node id leading ``topic``'s ``partition`` now, or None while it has none (or the
    metadata request went to a node that just crashed): for fault tests on ``kafka_cluster``."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        [described] = await admin.describe_topics([topic])
    except KafkaError:
        return None
    finally:
        await admin.close()
    if described["error_code"] != 0:
        return None
    for p in described["partitions"]:
        if p["partition"] == partition and p["error_code"] == 0 and p["leader"] >= 0:
            return int(p["leader"])
    return None


@pytest.fixture
async def kafka_on_cluster(kafka_cluster: LocalCluster) -> AsyncIterator[KafkaSettings]:
    """Like ``kafka``, on the 3-node cluster: a fresh set of topics (the cluster's RF 3)."""
    settings = KafkaSettings(
        bootstrap_servers=kafka_cluster.bootstrap, topic_prefix=f"c{uuid.uuid4().hex[:10]}"
    )
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
    yield settings


@pytest.fixture
async def kafka(kafka_bootstrap: str) -> AsyncIterator[KafkaSettings]:
    """Settings for a fresh set of topics (a unique prefix) on the session's broker."""
    settings = KafkaSettings(
        bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}"
    )
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
    yield settings


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
