"""A local cluster of N KRaft nodes (:class:`LocalCluster`), for replication and failover tests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.kafka.launch import (
    Launched,
    default_cache_dir,
    new_cluster_id,
    port_open,
    wait_for_metadata,
)
from controlplane.kafka.node import (
    DEFAULT_CONTROLLER_PORT,
    DEFAULT_KAFKA_VERSION,
    DEFAULT_PORT,
    BrokerConfig,
    BrokerStatus,
    LocalBroker,
)
from controlplane.wire.errors import BrokerError, LocalCode

if TYPE_CHECKING:
    from controlplane.kafka.admin import ClusterInfo

CLUSTER_FILE = "cluster.json"


@dataclass
class ClusterConfig:
    """N combined broker+controller nodes on 127.0.0.1 with a static controller quorum.

    Node ``i`` (1..N) listens on ``port + 2*(i-1)`` for clients and ``controller_port + 2*(i-1)``
    for the quorum unless ``ports``/``controller_ports`` name them, and keeps its data in
    ``data_dir/node-i``. Replication defaults follow N: RF = min(3, N) for new and internal
    topics, ``min.insync.replicas`` = RF-1 when RF >= 3, else 1.
    """

    nodes: int = 3
    port: int = DEFAULT_PORT
    controller_port: int = DEFAULT_CONTROLLER_PORT
    ports: list[int] | None = None
    controller_ports: list[int] | None = None
    data_dir: Path = field(default_factory=lambda: Path(".fleet/broker"))
    cache_dir: Path = field(default_factory=default_cache_dir)
    kafka_version: str = DEFAULT_KAFKA_VERSION
    heap_mb: int = 384
    java: str = "java"
    mvn: str = "mvn"
    #: Extra properties for every node (override the replication defaults too).
    overrides: dict[str, str] = field(default_factory=dict)

    @property
    def replication_factor(self) -> int:
        return min(3, self.nodes)

    @property
    def min_insync_replicas(self) -> int:
        return self.replication_factor - 1 if self.replication_factor >= 3 else 1

    def client_ports(self) -> list[int]:
        return list(self.ports or [self.port + 2 * i for i in range(self.nodes)])

    def quorum_ports(self) -> list[int]:
        return list(
            self.controller_ports or [self.controller_port + 2 * i for i in range(self.nodes)]
        )

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.client_ports())

    def validate(self) -> None:
        if self.nodes < 1:
            raise BrokerError(
                f"a cluster needs at least 1 node, not {self.nodes}",
                code=LocalCode.SETTINGS_INVALID,
            )
        clients, quorum = self.client_ports(), self.quorum_ports()
        if len(clients) != self.nodes or len(quorum) != self.nodes:
            raise BrokerError(
                f"{self.nodes} nodes need {self.nodes} client and {self.nodes} controller ports "
                f"(got {len(clients)} and {len(quorum)})",
                code=LocalCode.SETTINGS_INVALID,
            )
        every = clients + quorum
        if len(set(every)) != len(every) or not all(0 < p < 65536 for p in every):
            raise BrokerError(
                f"the cluster's ports must be distinct and valid: clients {clients}, "
                f"controllers {quorum} (choose --port and --controller-port further apart)",
                code=LocalCode.SETTINGS_INVALID,
            )

    def replication_properties(self) -> dict[str, str]:
        rf, isr = str(self.replication_factor), str(self.min_insync_replicas)
        return {
            "default.replication.factor": rf,
            "min.insync.replicas": isr,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            "unclean.leader.election.enable": "false",
        }


@dataclass(frozen=True)
class ClusterStatus:
    nodes: list[BrokerStatus]
    bootstrap: str
    kafka_version: str
    data_dir: Path
    cluster_id: str

    @property
    def running(self) -> bool:
        """Every node's process runs."""
        return all(n.running for n in self.nodes)

    @property
    def running_nodes(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes, start=1) if n.running]


class LocalCluster(Launched):
    """N local KRaft nodes (one :class:`LocalBroker` each, node ids 1..N) sharing one cluster id.

    ``start()`` formats every node with the same cluster id (once), starts them all, and waits until
    the cluster reports N brokers; ``stop_node``/``start_node`` crash or stop one node and bring it
    back, for fault tests; ``stop()`` stops them all. Its layout is saved in ``data_dir/cluster.json``
    so that ``LocalCluster.load(data_dir)`` (the CLI's ``stop``/``status``) finds it again.
    """

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.config.validate()
        self.data_dir = self.config.data_dir.resolve()
        saved = self.saved_layout(self.data_dir)
        if saved is not None and saved.get("nodes") != self.config.nodes:
            raise BrokerError(
                f"{self.data_dir} holds a cluster of {saved.get('nodes')} nodes, not "
                f"{self.config.nodes}; use --nodes {saved.get('nodes')} or another --data-dir",
                code=LocalCode.SETTINGS_INVALID,
            )
        if saved is None and (self.data_dir / "kraft-logs").exists():
            raise BrokerError(
                f"{self.data_dir} holds a single-node broker; use another --data-dir for a cluster",
                code=LocalCode.SETTINGS_INVALID,
            )
        self.cluster_id = str(saved["cluster_id"]) if saved else new_cluster_id()
        clients, quorum = self.config.client_ports(), self.config.quorum_ports()
        voters = ",".join(f"{i}@127.0.0.1:{p}" for i, p in enumerate(quorum, start=1))
        overrides = self.config.replication_properties() | self.config.overrides
        self.nodes = [
            LocalBroker(
                BrokerConfig(
                    port=clients[i - 1],
                    controller_port=quorum[i - 1],
                    data_dir=self.data_dir / f"node-{i}",
                    cache_dir=self.config.cache_dir,
                    kafka_version=self.config.kafka_version,
                    heap_mb=self.config.heap_mb,
                    java=self.config.java,
                    mvn=self.config.mvn,
                    overrides=dict(overrides),
                    node_id=i,
                    quorum_voters=voters,
                    cluster_id=self.cluster_id,
                )
            )
            for i in range(1, self.config.nodes + 1)
        ]

    @staticmethod
    def saved_layout(data_dir: Path) -> dict[str, object] | None:
        """The layout a cluster saved in ``data_dir``, or None when none is there."""
        try:
            data = json.loads((data_dir / CLUSTER_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @classmethod
    def load(cls, data_dir: Path) -> LocalCluster | None:
        """The cluster saved in ``data_dir`` (its ports and size), or None when none is there."""
        saved = cls.saved_layout(data_dir.resolve())
        if saved is None:
            return None
        try:
            ports = [int(p) for p in saved["ports"]]  # type: ignore[attr-defined]
            quorum = [int(p) for p in saved["controller_ports"]]  # type: ignore[attr-defined]
            config = ClusterConfig(
                nodes=int(saved["nodes"]),  # type: ignore[call-overload]
                ports=ports,
                controller_ports=quorum,
                data_dir=data_dir,
                kafka_version=str(saved.get("kafka_version", DEFAULT_KAFKA_VERSION)),
            )
        except (KeyError, TypeError, ValueError):
            raise BrokerError(
                f"{data_dir / CLUSTER_FILE} is not a cluster layout this version wrote; "
                "stop its nodes by hand and remove the directory",
                code=LocalCode.SETTINGS_INVALID,
            ) from None
        return cls(config)

    @property
    def bootstrap(self) -> str:
        """Every node's client address, comma-separated."""
        return self.config.bootstrap

    def node(self, node_id: int) -> LocalBroker:
        if not 1 <= node_id <= len(self.nodes):
            raise BrokerError(
                f"no node {node_id}: this cluster's nodes are 1..{len(self.nodes)}",
                code=LocalCode.SETTINGS_INVALID,
            )
        return self.nodes[node_id - 1]

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, timeout: float = 120.0) -> ClusterStatus:
        """Provision and start every node that does not run, and wait until the cluster reports
        them all as brokers. Idempotent."""
        waiting = [n for n in self.nodes if not n.status().running]
        if not waiting:
            return self.status()
        first = self.nodes[0]
        first.check_java()
        libs = first.ensure_jars()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._save_layout()
        # Formatting is one JVM per node: run them side by side.
        with ThreadPoolExecutor(max_workers=len(waiting)) as pool:
            for future in [pool.submit(n.prepare, libs) for n in waiting]:
                future.result()
        try:
            for n in waiting:
                n.spawn(libs)
            self.wait_for_brokers(len(self.nodes), timeout=timeout)
        except BaseException:
            for n in waiting:
                n.stop()
            raise
        return self.status()

    def stop(self, *, timeout: float = 30.0) -> bool:
        """Stop every node (SIGTERM, then SIGKILL). True if any ran. Idempotent."""
        stopped = False
        for n in reversed(self.nodes):
            stopped = n.stop(timeout=timeout) or stopped
        return stopped

    def stop_node(self, node_id: int, *, kill: bool = True, timeout: float = 30.0) -> bool:
        """Crash node ``node_id`` (SIGKILL, the default) or stop it cleanly (``kill=False``)."""
        node = self.node(node_id)
        return node.kill() if kill else node.stop(timeout=timeout)

    def start_node(self, node_id: int, *, timeout: float = 120.0) -> ClusterStatus:
        """Start node ``node_id`` again and wait until the cluster counts it among its brokers."""
        self.node(node_id).start(timeout=timeout)
        self.wait_for_brokers(len(self.status().running_nodes), timeout=timeout)
        return self.status()

    def wait_for_brokers(self, count: int, *, timeout: float = 120.0) -> int:
        """Wait until the cluster reports exactly ``count`` live brokers (a killed one stays
        listed until KRaft fences it); a node process that exits meanwhile is BROKER_DIED."""

        def exited() -> None:
            for i, n in enumerate(self.nodes, start=1):
                code = n.died()
                if code is not None:
                    raise BrokerError(
                        f"node {i} exited with status {code}; last lines of {n.log_file}:\n"
                        f"{n.log_tail()}",
                        code=LocalCode.BROKER_DIED,
                    )

        def address() -> str | None:
            live = [n for n in self.nodes if n.status().running]
            if any(port_open(n.config.port) for n in live):
                return ",".join(n.bootstrap for n in live)
            return None

        seen: int | None = None

        def enough(info: ClusterInfo) -> bool:
            nonlocal seen
            seen = info.brokers
            return seen == count

        last_error = wait_for_metadata(timeout, exited, address, enough)
        if last_error is None:
            return count
        logs = "\n".join(f"  node {i}: {n.log_file}" for i, n in enumerate(self.nodes, start=1))
        raise BrokerError(
            f"the cluster did not report {count} brokers within {timeout:.0f}s (last seen: {seen}"
            f"{'; ' + last_error if last_error else ''}); logs:\n{logs}",
            code=LocalCode.BROKER_START_TIMEOUT,
        )

    def status(self) -> ClusterStatus:
        return ClusterStatus(
            nodes=[n.status() for n in self.nodes],
            bootstrap=self.bootstrap,
            kafka_version=self.config.kafka_version,
            data_dir=self.data_dir,
            cluster_id=self.cluster_id,
        )

    def _save_layout(self) -> None:
        layout = {
            "nodes": self.config.nodes,
            "ports": self.config.client_ports(),
            "controller_ports": self.config.quorum_ports(),
            "kafka_version": self.config.kafka_version,
            "cluster_id": self.cluster_id,
        }
        (self.data_dir / CLUSTER_FILE).write_text(json.dumps(layout, indent=2) + "\n")
