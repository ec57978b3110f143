"""Replication of the topics: the min.insync.replicas rule, the specs, and the settings that set them."""

from __future__ import annotations

import pytest

from controlplane.coordinator.service import CoordinatorSettings
from controlplane.kafka.settings import KafkaSettings, load_settings
from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.topics import Topics, default_min_insync_replicas
from workers.agent.settings import WorkerSettings


@pytest.mark.parametrize(
    ("replication_factor", "min_insync"), [(1, 1), (2, 1), (3, 2), (4, 3), (5, 4)]
)
def test_min_insync_is_rf_minus_one_from_three_replicas(
    replication_factor: int, min_insync: int
) -> None:
    assert default_min_insync_replicas(replication_factor) == min_insync


def test_min_insync_of_no_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match="replication factor 0"):
        default_min_insync_replicas(0)


def test_unresolved_topics_leave_replication_to_the_cluster() -> None:
    topics = Topics(prefix="x")
    assert topics.replication_factor is None
    assert topics.effective_min_insync_replicas is None
    for spec in topics.all():
        assert spec.replication_factor is None
        assert "min.insync.replicas" not in spec.config


def test_resolved_topics_take_the_clusters_factor_and_the_rule() -> None:
    topics = Topics(prefix="x").resolved(3)
    assert topics.replication_factor == 3
    for spec in topics.all():
        assert spec.replication_factor == 3
        assert spec.config["min.insync.replicas"] == "2"


def test_an_explicit_factor_is_not_replaced_by_the_clusters() -> None:
    topics = Topics(prefix="x", replication_factor=2).resolved(3)
    assert topics.replication_factor == 2
    assert topics.commands.config["min.insync.replicas"] == "1"


def test_an_explicit_min_insync_wins_over_the_rule() -> None:
    topics = Topics(prefix="x", replication_factor=3, min_insync_replicas=3)
    assert {s.config["min.insync.replicas"] for s in topics.all()} == {"3"}


def test_commands_and_acks_refuse_unclean_leader_election() -> None:
    topics = Topics(prefix="x")
    assert topics.commands.config["unclean.leader.election.enable"] == "false"
    assert topics.acks.config["unclean.leader.election.enable"] == "false"


def test_kafka_settings_pass_replication_to_the_topics() -> None:
    topics = KafkaSettings(replication_factor=3).topics
    assert topics.replication_factor == 3
    assert topics.acks.config["min.insync.replicas"] == "2"
    assert KafkaSettings().topics.replication_factor is None


def test_min_insync_above_the_factor_is_a_coded_settings_error() -> None:
    with pytest.raises(ControlPlaneError) as info:
        load_settings(KafkaSettings, replication_factor=2, min_insync_replicas=3)
    assert info.value.code is WireCode.SCHEMA_INVALID
    assert "min_insync_replicas 3 exceeds replication_factor 2" in info.value.message


def test_replication_settings_come_from_each_processs_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_WORKER_KAFKA__REPLICATION_FACTOR", "3")
    monkeypatch.setenv("FLEET_COORDINATOR_KAFKA__REPLICATION_FACTOR", "5")
    monkeypatch.setenv("FLEET_COORDINATOR_KAFKA__MIN_INSYNC_REPLICAS", "2")
    worker = WorkerSettings(worker_id="w1")
    assert worker.kafka.topics.replication_factor == 3
    assert worker.kafka.topics.effective_min_insync_replicas == 2
    coordinator = CoordinatorSettings()
    assert coordinator.kafka.topics.replication_factor == 5
    assert coordinator.kafka.topics.effective_min_insync_replicas == 2


def test_the_controller_topic_is_one_compacted_partition_with_fixed_ids() -> None:
    topics = Topics(prefix="x", replication_factor=3)
    spec = topics.controller
    assert (spec.name, spec.partitions, spec.replication_factor) == ("x.controller", 1, 3)
    assert spec.config == {
        "cleanup.policy": "compact",
        "min.insync.replicas": "2",
        "unclean.leader.election.enable": "false",
    }
    # One id for every coordinator: each new leader's init fences the ones before.
    assert topics.controller_transactional_id == "x.controller"
    assert topics.controller_group == "x.controller"
    assert topics.controller_group not in {topics.worker_group(w) for w in ("controller", "x")}
    assert topics.ensured() == [*topics.all(), spec]
