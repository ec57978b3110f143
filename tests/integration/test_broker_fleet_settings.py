"""The broker settings for a fleet of thousands of readers (docs/scaling.md, "Broker and topic
settings"): the local broker and compose.yaml's broker take them, and the broker really runs
with them (read back from the broker, not from the properties we wrote)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import yaml
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from controlplane.kafka.node import LISTEN_BACKLOG, max_connections

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
#: What compose.yaml's broker must hold: 3 connections per agent (producer, fetcher, the
#: group coordinator's connection for offset commits), measured by bench/fanout --broker-probe.
CONNECTIONS_PER_AGENT = 3
AGENTS = 50_000


async def _broker_config(bootstrap: str) -> dict[str, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        brokers = [b["node_id"] for b in (await admin.describe_cluster())["brokers"]]
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, str(brokers[0]))]
        )
    finally:
        await admin.close()
    return {entry[0]: entry[1] for entry in response.resources[0][4]}


async def test_the_local_broker_queues_a_fleets_connections(kafka_bootstrap: str) -> None:
    """Kafka's default backlog (50) overflowed while 1,000 agents connected at once."""
    config = await _broker_config(kafka_bootstrap)
    assert int(config["socket.listen.backlog.size"]) == LISTEN_BACKLOG >= 1024


async def test_the_local_broker_refuses_connections_before_its_files_run_out(
    kafka_bootstrap: str,
) -> None:
    """With every descriptor taken by connections, a broker cannot open its own files: it failed
    its log directory and shut down (500 agents, open files 1,000). ``max.connections`` keeps a
    reserve: the broker refuses connections past it instead."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    config = await _broker_config(kafka_bootstrap)
    expected = max_connections(hard)
    assert expected is not None and hard - expected >= min(1000, hard // 2)
    assert int(config["max.connections"]) == expected


def test_max_connections_keeps_a_reserve_of_descriptors() -> None:
    assert max_connections(20_000) == 15_000  # this machine: ~5,000 agents of 3 connections
    assert max_connections(1024) == 512
    assert max_connections(262_144) == 196_608
    assert max_connections(resource.RLIM_INFINITY) is None


def _kafka_service() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    service: dict[str, Any] = data["services"]["kafka"]
    return service


def test_the_compose_broker_takes_a_fleet() -> None:
    kafka = _kafka_service()
    env = {str(k): str(v) for k, v in kafka["environment"].items()}
    assert int(env["KAFKA_SOCKET_LISTEN_BACKLOG_SIZE"]) == LISTEN_BACKLOG
    # Connections stop short of the descriptors, with the local broker's reserve.
    assert int(env["KAFKA_MAX_CONNECTIONS"]) == max_connections(
        int(kafka["ulimits"]["nofile"]["hard"])
    )
    # The JVM raises its soft limit to the hard one: both must hold every agent's connections.
    nofile = kafka["ulimits"]["nofile"]
    assert min(int(nofile["soft"]), int(nofile["hard"])) >= CONNECTIONS_PER_AGENT * AGENTS
