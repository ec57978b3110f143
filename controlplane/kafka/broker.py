"""A local Apache Kafka 4.x broker (KRaft, one combined broker+controller) for development, demos and
tests, and a local cluster of N such nodes (:class:`LocalCluster`) for replication and failover tests.

The node lives in :mod:`~controlplane.kafka.node`, the cluster in :mod:`~controlplane.kafka.cluster`,
what they share in :mod:`~controlplane.kafka.launch`; this module names them all. Every failure
is a coded :class:`BrokerError` with a message a person can act on; never a traceback.
"""

from __future__ import annotations

import sys
import uuid  # noqa: F401 - ``broker.uuid.uuid4`` is where tests force a cluster id

from controlplane.kafka.cluster import CLUSTER_FILE, ClusterConfig, ClusterStatus, LocalCluster
from controlplane.kafka.launch import default_cache_dir, new_cluster_id
from controlplane.kafka.node import (
    DEFAULT_CONTROLLER_PORT,
    DEFAULT_KAFKA_VERSION,
    DEFAULT_PORT,
    MIN_JAVA,
    BrokerConfig,
    BrokerStatus,
    LocalBroker,
)
from controlplane.wire.errors import BrokerError

__all__ = [
    "CLUSTER_FILE",
    "DEFAULT_CONTROLLER_PORT",
    "DEFAULT_KAFKA_VERSION",
    "DEFAULT_PORT",
    "MIN_JAVA",
    "BrokerConfig",
    "BrokerError",
    "BrokerStatus",
    "ClusterConfig",
    "ClusterStatus",
    "LocalBroker",
    "LocalCluster",
    "default_cache_dir",
    "new_cluster_id",
]

if __name__ == "__main__":  # pragma: no cover - convenience: python -m controlplane.kafka.broker
    status = LocalBroker().start()
    print(status, file=sys.stderr)
