"""A local Apache Kafka 4.x broker (KRaft, one combined broker+controller) for development, demos and
tests, and a local cluster of N such nodes (:class:`LocalCluster`) for replication and failover tests.

Resolves Apache Kafka's own jars from Maven Central with Maven into a cache (the second start
downloads nothing), formats storage, starts ``kafka.Kafka`` bound to 127.0.0.1, waits until it
answers a metadata request, stops it with SIGTERM then SIGKILL. Every failure is a coded
:class:`BrokerError` with a message a person can act on; never a traceback.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import TracebackType

from controlplane.wire.errors import BrokerError, ErrorCode

DEFAULT_KAFKA_VERSION = "4.1.1"
DEFAULT_PORT = 19092
DEFAULT_CONTROLLER_PORT = 19093
MIN_JAVA = 17


def default_cache_dir() -> Path:
    base = os.environ.get("FLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fleet-controlplane"
    )
    return Path(base)


@dataclass
class BrokerConfig:
    port: int = DEFAULT_PORT
    controller_port: int = DEFAULT_CONTROLLER_PORT
    data_dir: Path = field(default_factory=lambda: Path(".fleet/broker"))
    cache_dir: Path = field(default_factory=default_cache_dir)
    kafka_version: str = DEFAULT_KAFKA_VERSION
    heap_mb: int = 512
    java: str = "java"
    mvn: str = "mvn"
    #: Extra broker properties (override the defaults below).
    overrides: dict[str, str] = field(default_factory=dict)
    #: KRaft node id (1 for a lone broker; 1..N in a :class:`LocalCluster`).
    node_id: int = 1
    #: A static controller quorum (``controller.quorum.voters``, "1@host:port,2@..."); empty: this
    #: node alone is the quorum (formatted ``--standalone``).
    quorum_voters: str = ""
    #: The cluster id to format storage with; None: a random one (a lone broker).
    cluster_id: str | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def jars_dir(self) -> Path:
        return self.cache_dir / f"kafka-{self.kafka_version}" / "libs"


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str
    kafka_version: str
    data_dir: Path
    log_file: Path


_LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="STDOUT" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Root level="WARN"><AppenderRef ref="STDOUT"/></Root>
    <Logger name="kafka.server.KafkaRaftServer" level="INFO"/>
    <Logger name="kafka.server.BrokerServer" level="INFO"/>
    <Logger name="org.apache.kafka.common.utils.AppInfoParser" level="INFO"/>
  </Loggers>
</Configuration>
"""


class LocalBroker:
    """One local broker process. ``start()`` is idempotent for a broker this config already runs."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.data_dir = self.config.data_dir.resolve()
        self._proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ paths

    @property
    def bootstrap(self) -> str:
        return self.config.bootstrap

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    # ------------------------------------------------------------------ prerequisites

    def check_java(self) -> int:
        """Return Java's major version, or raise JAVA_NOT_FOUND / JAVA_TOO_OLD."""
        java = shutil.which(self.config.java)
        if java is None:
            raise BrokerError(
                f"Java not found ({self.config.java!r} is not on PATH). Install a JDK {MIN_JAVA}+, "
                "e.g. `apt-get install openjdk-17-jre-headless`.",
                code=ErrorCode.JAVA_NOT_FOUND,
            )
        try:
            out = subprocess.run(
                [java, "-version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BrokerError(
                f"could not run {java} -version: {exc}", code=ErrorCode.JAVA_NOT_FOUND
            ) from None
        text = out.stderr + out.stdout
        match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
        if match is None:
            raise BrokerError(
                f"could not read Java's version from {java!r}: {text.strip()[:200]!r}",
                code=ErrorCode.JAVA_NOT_FOUND,
            )
        major = int(match.group(1))
        if major == 1 and match.group(2):  # "1.8.0" style
            major = int(match.group(2))
        if major < MIN_JAVA:
            raise BrokerError(
                f"Apache Kafka {self.config.kafka_version} needs Java {MIN_JAVA}+, "
                f"but {java} is Java {major}. Install a newer JDK or point --java at one.",
                code=ErrorCode.JAVA_TOO_OLD,
            )
        return major

    def ensure_jars(self) -> Path:
        """Resolve Kafka's jars into the cache with Maven, once; return the libs directory."""
        libs = self.config.jars_dir
        stamp = libs.parent / "RESOLVED"
        pom = resources.files("controlplane") / "kafka" / "pom.xml"
        # The stamp names the pom it came from: editing the pom re-resolves once.
        fingerprint = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
        if _read(stamp) == fingerprint and any(libs.glob("kafka_2.13-*.jar")):
            return libs
        mvn = shutil.which(self.config.mvn)
        if mvn is None:
            raise BrokerError(
                f"Maven not found ({self.config.mvn!r} is not on PATH); it resolves Apache Kafka's "
                "jars from Maven Central. Install it, e.g. `apt-get install maven`.",
                code=ErrorCode.MAVEN_NOT_FOUND,
            )
        staging = libs.parent / "libs.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
        with resources.as_file(pom) as pom_path:
            cmd = [
                mvn,
                "-B",
                "-q",
                "-f",
                str(pom_path),
                f"-Dkafka.version={self.config.kafka_version}",
                "dependency:copy-dependencies",
                f"-DoutputDirectory={staging}",
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise BrokerError(
                    f"Maven failed to run: {exc}", code=ErrorCode.JARS_UNRESOLVABLE
                ) from None
        if proc.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            tail = _tail((proc.stdout + proc.stderr).splitlines(), 15)
            raise BrokerError(
                f"could not resolve org.apache.kafka:kafka_2.13:{self.config.kafka_version} from "
                f"Maven Central (mvn exit {proc.returncode}):\n{tail}",
                code=ErrorCode.JARS_UNRESOLVABLE,
            )
        shutil.rmtree(libs, ignore_errors=True)
        staging.rename(libs)
        stamp.write_text(fingerprint)
        return libs

    def check_ports(self) -> None:
        for port in (self.config.port, self.config.controller_port):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    raise BrokerError(
                        f"port {port} on 127.0.0.1 is in use; stop what holds it "
                        f"(`ss -ltnp 'sport = :{port}'`) or choose other ports",
                        code=ErrorCode.PORT_IN_USE,
                    ) from None

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, timeout: float = 90.0) -> BrokerStatus:
        """Provision and start the broker, and wait until it serves metadata."""
        current = self.status()
        if current.running:
            return current
        self.check_java()
        libs = self.ensure_jars()
        self.prepare(libs)
        self.spawn(libs)
        self._wait_ready(timeout)
        return self.status()

    def prepare(self, libs: Path) -> None:
        """Check the ports, write the configs and format storage (once): all but starting."""
        self.check_ports()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_configs()
        self._format(f"{libs}/*")

    def spawn(self, libs: Path) -> None:
        """Start the prepared node's process without waiting for it."""
        classpath = f"{libs}/*"
        log = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child process
        try:
            self._proc = subprocess.Popen(
                [
                    self.config.java,
                    f"-Xms{min(256, self.config.heap_mb)}m",
                    f"-Xmx{self.config.heap_mb}m",
                    "-XX:+UseG1GC",
                    "-XX:MaxGCPauseMillis=20",
                    "-XX:+ExitOnOutOfMemoryError",
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.xml'}",
                    "-cp",
                    classpath,
                    "kafka.Kafka",
                    str(self.properties_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        self.pid_file.write_text(str(self._proc.pid))

    def kill(self) -> bool:
        """SIGKILL at once (a crash, for fault tests). Returns True if a broker was running."""
        pid = self._read_pid()
        if pid is None or not _alive(pid, self._proc):
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid, self._proc):
            time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        self._proc = None
        return True

    def died(self) -> int | None:
        """The exit status of a process this object started and that has exited, else None."""
        if self._proc is not None and self._proc.poll() is not None:
            return self._proc.returncode
        return None

    def stop(self, *, timeout: float = 30.0) -> bool:
        """SIGTERM, wait, then SIGKILL. Returns True if a broker was running. Idempotent."""
        pid = self._read_pid()
        if pid is None or not _alive(pid, self._proc):  # (polling our own child reaps it)
            if self._proc is not None and self._proc.poll() is not None:
                self._proc = None
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid, self._proc):
            time.sleep(0.1)
        if _alive(pid, self._proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while _alive(pid, self._proc):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        self._proc = None
        return True

    def status(self) -> BrokerStatus:
        pid = self._read_pid()
        running = pid is not None and _alive(pid, self._proc)
        return BrokerStatus(
            running=running,
            pid=pid if running else None,
            bootstrap=self.bootstrap,
            kafka_version=self.config.kafka_version,
            data_dir=self.data_dir,
            log_file=self.log_file,
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return _tail(self.log_file.read_text(errors="replace").splitlines(), lines)
        except OSError:
            return "(no broker log)"

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals

    def _properties(self) -> dict[str, str]:
        c = self.config
        props = {
            "process.roles": "broker,controller",
            "node.id": str(c.node_id),
            "listeners": f"PLAINTEXT://127.0.0.1:{c.port},CONTROLLER://127.0.0.1:{c.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{c.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir / "kraft-logs"),
            # Sized for a 2-core machine and a single node.
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "log.cleaner.threads": "1",
            "num.partitions": "1",
            "offsets.topic.num.partitions": "4",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "2",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "log.retention.check.interval.ms": "60000",
            "log.cleaner.backoff.ms": "5000",
        }
        if c.quorum_voters:
            props["controller.quorum.voters"] = c.quorum_voters
        else:
            props["controller.quorum.bootstrap.servers"] = f"127.0.0.1:{c.controller_port}"
        props.update(c.overrides)
        return props

    def _write_configs(self) -> None:
        text = "".join(f"{k}={v}\n" for k, v in self._properties().items())
        self.properties_file.write_text(text)
        (self.data_dir / "log4j2.xml").write_text(_LOG4J2)

    def _format(self, classpath: str) -> None:
        log_dir = Path(self._properties()["log.dirs"])
        if (log_dir / "meta.properties").exists():
            return
        cluster_id = self.config.cluster_id or new_cluster_id()
        # A static quorum (controller.quorum.voters) formats without --standalone.
        standalone = [] if self.config.quorum_voters else ["--standalone"]
        proc = subprocess.run(
            [
                self.config.java,
                "-Xmx256m",
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.xml'}",
                "-cp",
                classpath,
                "kafka.tools.StorageTool",
                "format",
                *standalone,
                # One argument: a random id can start with '-' (about 1 in 64), which the
                # two-argument form ("-t ID") would parse as an option.
                f"--cluster-id={cluster_id}",
                "-c",
                str(self.properties_file),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise BrokerError(
                "formatting KRaft storage failed:\n"
                + _tail((proc.stdout + proc.stderr).splitlines(), 15),
                code=ErrorCode.BROKER_DIED,
            )

    def _wait_ready(self, timeout: float) -> None:
        from controlplane.kafka.bus import probe_sync  # the one place that speaks Kafka

        deadline = time.monotonic() + timeout
        last_error = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"the broker exited with status {code} while starting; last lines of "
                    f"{self.log_file}:\n{self.log_tail()}",
                    code=ErrorCode.BROKER_DIED,
                )
            if _port_open(self.config.port):
                try:
                    probe_sync(self.bootstrap, timeout=5.0)
                    return
                except Exception as exc:  # not ready yet: keep polling until the deadline
                    last_error = str(exc)
            time.sleep(0.25)
        self.stop()
        raise BrokerError(
            f"the broker did not answer a metadata request within {timeout:.0f}s ({last_error}); "
            f"last lines of {self.log_file}:\n{self.log_tail()}",
            code=ErrorCode.BROKER_START_TIMEOUT,
        )

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None


# --------------------------------------------------------------------------- a local cluster

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
                code=ErrorCode.SETTINGS_INVALID,
            )
        clients, quorum = self.client_ports(), self.quorum_ports()
        if len(clients) != self.nodes or len(quorum) != self.nodes:
            raise BrokerError(
                f"{self.nodes} nodes need {self.nodes} client and {self.nodes} controller ports "
                f"(got {len(clients)} and {len(quorum)})",
                code=ErrorCode.SETTINGS_INVALID,
            )
        every = clients + quorum
        if len(set(every)) != len(every) or not all(0 < p < 65536 for p in every):
            raise BrokerError(
                f"the cluster's ports must be distinct and valid: clients {clients}, "
                f"controllers {quorum} (choose --port and --controller-port further apart)",
                code=ErrorCode.SETTINGS_INVALID,
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


class LocalCluster:
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
                code=ErrorCode.SETTINGS_INVALID,
            )
        if saved is None and (self.data_dir / "kraft-logs").exists():
            raise BrokerError(
                f"{self.data_dir} holds a single-node broker; use another --data-dir for a cluster",
                code=ErrorCode.SETTINGS_INVALID,
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
                code=ErrorCode.SETTINGS_INVALID,
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
                code=ErrorCode.SETTINGS_INVALID,
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
        from controlplane.kafka.bus import probe_sync  # the one place that speaks Kafka

        deadline = time.monotonic() + timeout
        seen: int | None = None
        last_error = ""
        while time.monotonic() < deadline:
            for i, n in enumerate(self.nodes, start=1):
                code = n.died()
                if code is not None:
                    raise BrokerError(
                        f"node {i} exited with status {code}; last lines of {n.log_file}:\n"
                        f"{n.log_tail()}",
                        code=ErrorCode.BROKER_DIED,
                    )
            live = [n for n in self.nodes if n.status().running]
            if any(_port_open(n.config.port) for n in live):
                addresses = ",".join(n.bootstrap for n in live)
                try:
                    seen = probe_sync(addresses, timeout=5.0).brokers
                    if seen == count:
                        return seen
                except Exception as exc:  # not ready yet: keep polling until the deadline
                    last_error = str(exc)
            time.sleep(0.25)
        logs = "\n".join(f"  node {i}: {n.log_file}" for i, n in enumerate(self.nodes, start=1))
        raise BrokerError(
            f"the cluster did not report {count} brokers within {timeout:.0f}s (last seen: {seen}"
            f"{'; ' + last_error if last_error else ''}); logs:\n{logs}",
            code=ErrorCode.BROKER_START_TIMEOUT,
        )

    def status(self) -> ClusterStatus:
        return ClusterStatus(
            nodes=[n.status() for n in self.nodes],
            bootstrap=self.bootstrap,
            kafka_version=self.config.kafka_version,
            data_dir=self.data_dir,
            cluster_id=self.cluster_id,
        )

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _save_layout(self) -> None:
        layout = {
            "nodes": self.config.nodes,
            "ports": self.config.client_ports(),
            "controller_ports": self.config.quorum_ports(),
            "kafka_version": self.config.kafka_version,
            "cluster_id": self.cluster_id,
        }
        (self.data_dir / CLUSTER_FILE).write_text(json.dumps(layout, indent=2) + "\n")


def new_cluster_id() -> str:
    """A random KRaft cluster id (22 characters of base64url, as kafka-storage random-uuid)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _alive(pid: int, proc: subprocess.Popen[bytes] | None = None) -> bool:
    if proc is not None and proc.pid == pid:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of another process still answers kill(0); check /proc where we can.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _tail(lines: list[str], n: int) -> str:
    return "\n".join("    " + line for line in lines[-n:])


if __name__ == "__main__":  # pragma: no cover - convenience: python -m controlplane.kafka.broker
    status = LocalBroker().start()
    print(status, file=sys.stderr)
