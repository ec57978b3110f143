"""Helpers for the fault suite on the local 3-node cluster (tests/integration/test_cluster_faults.py).

Real processes only: fake-runner worker agents (`python -m workers run`) and the `controlplane`
CLI, each with its output in a file; the topics are read back with a plain consumer, to their
end, to count what the fault left in the log. No sleeps to synchronize: every wait polls a
condition until a deadline.

``processes`` (WorkerProcess, CliRun, Fleet), ``reading`` (until, read_topic and the cluster's
replication state), ``counting`` (Tally, count_log, report).
"""

from __future__ import annotations

from tests.faults.counting import Tally, count_log, report
from tests.faults.processes import CliRun, Fleet, WorkerProcess
from tests.faults.reading import (
    JSON,
    NODES,
    ack_partition,
    fully_replicated,
    in_sync_everywhere,
    partition_leaders,
    read_topic,
    readable,
    set_min_insync,
    until,
    whole,
)

__all__ = [
    "JSON",
    "NODES",
    "CliRun",
    "Fleet",
    "Tally",
    "WorkerProcess",
    "ack_partition",
    "count_log",
    "fully_replicated",
    "in_sync_everywhere",
    "partition_leaders",
    "read_topic",
    "readable",
    "report",
    "set_min_insync",
    "until",
    "whole",
]
