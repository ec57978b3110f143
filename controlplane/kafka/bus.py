"""The Kafka seam, one import away: producers, consumers and topic administration over our own
types and errors (every aiokafka exception becomes a coded
:class:`~controlplane.wire.errors.BusError`, once).

The parts live beside it: :mod:`~controlplane.kafka.client` (Record, error translation, connection
options, start/stop), :mod:`~controlplane.kafka.health` (Kafka's reachability, the aiokafka log
filter), :mod:`~controlplane.kafka.producer`, :mod:`~controlplane.kafka.consumer` and
:mod:`~controlplane.kafka.admin`. Only ``controlplane/kafka`` imports aiokafka.
"""

from __future__ import annotations

from controlplane.kafka.admin import (
    Admin,
    ClusterInfo,
    EnsureReport,
    probe,
    probe_sync,
)
from controlplane.kafka.client import (
    LOG_APPEND_TIME,
    ClientLifecycle,
    Record,
    client_options,
    collector_paused,
    translate,
)
from controlplane.kafka.consumer import Consumer, PartitionProgress
from controlplane.kafka.health import (
    ConnectionLogFilter,
    KafkaHealth,
    health,
    install_log_filter,
    log,
    log_filter,
)
from controlplane.kafka.producer import Delivery, Producer

__all__ = [
    "LOG_APPEND_TIME",
    "Admin",
    "ClientLifecycle",
    "ClusterInfo",
    "ConnectionLogFilter",
    "Consumer",
    "Delivery",
    "EnsureReport",
    "KafkaHealth",
    "PartitionProgress",
    "Producer",
    "Record",
    "client_options",
    "collector_paused",
    "health",
    "install_log_filter",
    "log",
    "log_filter",
    "probe",
    "probe_sync",
    "translate",
]
