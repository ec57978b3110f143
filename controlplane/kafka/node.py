"""One local Apache Kafka 4.x node (KRaft, a combined broker+controller): :class:`LocalBroker`.

Resolves Apache Kafka's own jars from Maven Central with Maven into a cache (the second start
downloads nothing), formats storage, starts ``kafka.Kafka`` bound to 127.0.0.1, waits until it
answers a metadata request, stops it with SIGTERM then SIGKILL. Every failure is a coded
:class:`BrokerError` with a message a person can act on; never a traceback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from controlplane.kafka.launch import (
    Launched,
    alive,
    default_cache_dir,
    indented_tail,
    new_cluster_id,
    port_open,
    probe_as,
    read_stripped,
    wait_for_metadata,
)
from controlplane.kafka.secure import (
    ACL_BATCH_SEPARATOR,
    ACL_BATCH_SOURCE,
    ACL_COMMAND,
    SECURE_DIR,
    SecureFiles,
    acl_grants,
    ensure_secure_files,
    scram_arguments,
    server_properties,
)
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BrokerError, LocalCode

DEFAULT_KAFKA_VERSION = "4.1.1"
DEFAULT_PORT = 19092
DEFAULT_CONTROLLER_PORT = 19093
MIN_JAVA = 17
#: ``socket.listen.backlog.size``: connections the kernel queues before the broker accepts them.
#: Kafka's default, 50, overflows when a fleet of agents (3 connections each) connects at once
#: (docs/scaling.md, "Broker and topic settings"); Linux caps it at ``net.core.somaxconn``.
LISTEN_BACKLOG = 4096
#: Descriptors kept for the broker's own files (log segments, indexes, checkpoints) when
#: ``max.connections`` is derived from the open-files limit (:func:`max_connections`).
FILES_RESERVE = 1000


def max_connections(nofile_hard: int) -> int | None:
    """``max.connections`` for a broker whose open-files limit is ``nofile_hard`` (the JVM raises
    its soft limit to the hard one): past it the broker refuses connections, where without it
    connections take every descriptor, the broker cannot open its own files, fails its log
    directory and shuts down (measured: docs/scaling.md). None: no limit to keep under."""
    if nofile_hard <= 0 or nofile_hard == resource.RLIM_INFINITY:
        return None
    return nofile_hard - max(min(FILES_RESERVE, nofile_hard // 2), nofile_hard // 4)


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
    #: SASL_SSL (SCRAM-SHA-512) for clients and the broker itself, SSL with client certificates
    #: for the controller, ACLs enforced (:mod:`~controlplane.kafka.secure`). A data directory
    #: is formatted secured or not, once: starting it the other way is SETTINGS_INVALID.
    secure: bool = False

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


class LocalBroker(Launched):
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

    @property
    def secure_files(self) -> SecureFiles:
        """The CA, keystore and passwords of a secured broker (made by its first start)."""
        return SecureFiles(self.data_dir / SECURE_DIR)

    @property
    def _secure_marker(self) -> Path:
        """Written once storage is formatted secured (with the SCRAM users)."""
        return self.secure_files.directory / "FORMATTED"

    def settings(self, principal: str = "admin", **values: object) -> KafkaSettings:
        """How ``principal`` reaches this broker (a plaintext broker: anyone, as no one)."""
        if not self.config.secure:
            return KafkaSettings.model_validate({"bootstrap_servers": self.bootstrap, **values})
        return self.secure_files.settings(principal, self.bootstrap, **values)

    # ------------------------------------------------------------------ prerequisites

    def check_java(self) -> int:
        """Return Java's major version, or raise JAVA_NOT_FOUND / JAVA_TOO_OLD."""
        java = shutil.which(self.config.java)
        if java is None:
            raise BrokerError(
                f"Java not found ({self.config.java!r} is not on PATH). Install a JDK {MIN_JAVA}+, "
                "e.g. `apt-get install openjdk-17-jre-headless`.",
                code=LocalCode.JAVA_NOT_FOUND,
            )
        try:
            out = subprocess.run(
                [java, "-version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BrokerError(
                f"could not run {java} -version: {exc}", code=LocalCode.JAVA_NOT_FOUND
            ) from None
        text = out.stderr + out.stdout
        match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
        if match is None:
            raise BrokerError(
                f"could not read Java's version from {java!r}: {text.strip()[:200]!r}",
                code=LocalCode.JAVA_NOT_FOUND,
            )
        major = int(match.group(1))
        if major == 1 and match.group(2):  # "1.8.0" style
            major = int(match.group(2))
        if major < MIN_JAVA:
            raise BrokerError(
                f"Apache Kafka {self.config.kafka_version} needs Java {MIN_JAVA}+, "
                f"but {java} is Java {major}. Install a newer JDK or point --java at one.",
                code=LocalCode.JAVA_TOO_OLD,
            )
        return major

    def ensure_jars(self) -> Path:
        """Resolve Kafka's jars into the cache with Maven, once; return the libs directory."""
        libs = self.config.jars_dir
        stamp = libs.parent / "RESOLVED"
        pom = resources.files("controlplane") / "kafka" / "pom.xml"
        # The stamp names the pom it came from: editing the pom re-resolves once.
        fingerprint = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
        if read_stripped(stamp) == fingerprint and any(libs.glob("kafka_2.13-*.jar")):
            return libs
        libs.parent.mkdir(parents=True, exist_ok=True)
        # Several test sessions may start brokers at once: one resolves, the others wait.
        with open(libs.parent / "resolve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if read_stripped(stamp) == fingerprint and any(libs.glob("kafka_2.13-*.jar")):
                return libs
            self._resolve(pom, libs, fingerprint)
        return libs

    def _resolve(self, pom: Traversable, libs: Path, fingerprint: str) -> None:
        stamp = libs.parent / "RESOLVED"
        mvn = shutil.which(self.config.mvn)
        if mvn is None:
            raise BrokerError(
                f"Maven not found ({self.config.mvn!r} is not on PATH); it resolves Apache Kafka's "
                "jars from Maven Central. Install it, e.g. `apt-get install maven`.",
                code=LocalCode.MAVEN_NOT_FOUND,
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
                    f"Maven failed to run: {exc}", code=LocalCode.JARS_UNRESOLVABLE
                ) from None
        if proc.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            tail = indented_tail((proc.stdout + proc.stderr).splitlines(), 15)
            raise BrokerError(
                f"could not resolve org.apache.kafka:kafka_2.13:{self.config.kafka_version} from "
                f"Maven Central (mvn exit {proc.returncode}):\n{tail}",
                code=LocalCode.JARS_UNRESOLVABLE,
            )
        # Swapped, not removed then renamed: a JVM starting meanwhile still finds jars.
        old = libs.parent / "libs.old"
        shutil.rmtree(old, ignore_errors=True)
        if libs.exists():
            libs.rename(old)
        staging.rename(libs)
        shutil.rmtree(old, ignore_errors=True)
        stamp.write_text(fingerprint)

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
                        code=LocalCode.PORT_IN_USE,
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
        self._check_formatted_as_configured()
        if self.config.secure:
            # Its records, and the users' salted SCRAM hashes in the metadata: the owner's only.
            self.data_dir.chmod(0o700)
            ensure_secure_files(self.secure_files.directory)
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
        return self._end(signal.SIGKILL, timeout=0.0)

    def died(self) -> int | None:
        """The exit status of a process this object started and that has exited, else None."""
        if self._proc is not None and self._proc.poll() is not None:
            return self._proc.returncode
        return None

    def stop(self, *, timeout: float = 30.0) -> bool:
        """SIGTERM, wait, then SIGKILL. Returns True if a broker was running. Idempotent."""
        return self._end(signal.SIGTERM, timeout=timeout)

    def _end(self, sig: signal.Signals, *, timeout: float) -> bool:
        """Send ``sig``; after ``timeout`` SIGKILL; wait until the process is gone."""
        pid = self._read_pid()
        if pid is None or not alive(pid, self._proc):  # (polling our own child reaps it)
            if sig is signal.SIGTERM and self._proc is not None and self._proc.poll() is not None:
                self._proc = None  # stop() forgets a process that exited; kill() leaves it
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(pid, self._proc):
            time.sleep(0.1)
        if sig is not signal.SIGKILL and alive(pid, self._proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while alive(pid, self._proc):
            time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        self._proc = None
        return True

    def status(self) -> BrokerStatus:
        pid = self._read_pid()
        running = pid is not None and alive(pid, self._proc)
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
            return indented_tail(self.log_file.read_text(errors="replace").splitlines(), lines)
        except OSError:
            return "(no broker log)"

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
            "socket.listen.backlog.size": str(LISTEN_BACKLOG),
        }
        # The broker inherits this process's limit (nothing raises the hard one).
        connections = max_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        if connections is not None:
            props["max.connections"] = str(connections)
        if c.quorum_voters:
            props["controller.quorum.voters"] = c.quorum_voters
        else:
            props["controller.quorum.bootstrap.servers"] = f"127.0.0.1:{c.controller_port}"
        if c.secure:
            props |= {
                "listeners": f"SASL_SSL://127.0.0.1:{c.port},CONTROLLER://127.0.0.1:{c.controller_port}",
                "advertised.listeners": f"SASL_SSL://127.0.0.1:{c.port}",
                "inter.broker.listener.name": "SASL_SSL",
                "listener.security.protocol.map": "CONTROLLER:SSL,SASL_SSL:SASL_SSL",
                **server_properties(self.secure_files),
            }
        props.update(c.overrides)
        return props

    def _write_configs(self) -> None:
        text = "".join(f"{k}={v}\n" for k, v in self._properties().items())
        if self.config.secure:  # it holds the admin's password
            self.properties_file.unlink(missing_ok=True)
            self.properties_file.touch(mode=0o600)
        self.properties_file.write_text(text)
        (self.data_dir / "log4j2.xml").write_text(_LOG4J2)

    def _formatted(self) -> bool:
        log_dirs = self.config.overrides.get("log.dirs", str(self.data_dir / "kraft-logs"))
        return (Path(log_dirs) / "meta.properties").exists()

    def _check_formatted_as_configured(self) -> None:
        """A data directory formatted secured (or not) is started the same way, or not at all:
        its SCRAM users and ACLs live in its metadata, written once."""
        if not self._formatted():
            return
        was_secure = self._secure_marker.exists()
        if was_secure == self.config.secure:
            return
        raise BrokerError(
            f"the broker's data directory {self.data_dir} was formatted "
            + (
                "secured (SASL_SSL and ACLs): start it with --secure"
                if was_secure
                else "without --secure: start it without --secure, or remove the directory "
                "(its topics and records go) to make a secured broker there"
            ),
            code=LocalCode.SETTINGS_INVALID,
        )

    def _format(self, classpath: str) -> None:
        if self._formatted():
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
                # The SCRAM users, in the bootstrap metadata (KIP-900); their passwords are on
                # this command line for the second it runs.
                *(scram_arguments(self.secure_files) if self.config.secure else []),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise BrokerError(
                "formatting KRaft storage failed:\n"
                + indented_tail((proc.stdout + proc.stderr).splitlines(), 15),
                code=LocalCode.BROKER_DIED,
            )
        if self.config.secure:
            self._secure_marker.write_text("SCRAM-SHA-512 users added at format\n")

    def _wait_ready(self, timeout: float) -> None:
        def exited() -> None:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"the broker exited with status {code} while starting; last lines of "
                    f"{self.log_file}:\n{self.log_tail()}",
                    code=LocalCode.BROKER_DIED,
                )

        def address() -> str | None:
            return self.bootstrap if port_open(self.config.port) else None

        probe = None if not self.config.secure else functools.partial(probe_as, self.settings())
        last_error = wait_for_metadata(timeout, exited, address, lambda _: True, probe=probe)
        if last_error is None:
            return
        self.stop()
        raise BrokerError(
            f"the broker did not answer a metadata request within {timeout:.0f}s ({last_error}); "
            f"last lines of {self.log_file}:\n{self.log_tail()}",
            code=LocalCode.BROKER_START_TIMEOUT,
        )

    def grant_acls(self, prefix: str, *, timeout: float = 120.0) -> int:
        """Grant ci, worker and coordinator their ACLs on the topics of ``prefix`` (a secured
        broker, running), with Kafka's AclCommand as admin; adding an ACL twice is a no-op.

        Every grant in one JVM (:data:`~controlplane.kafka.secure.ACL_BATCH_SOURCE`, run by
        Java's source launcher: a JDK's compiler); where that fails (a JRE, or a grant
        refused), one AclCommand JVM per grant, which names the grant that fails (about 2 s of
        CPU each). Returns how many JVMs it took."""
        if not self.config.secure:
            raise BrokerError(
                "ACLs are for a secured broker (--secure); this one lets every client do anything",
                code=LocalCode.SETTINGS_INVALID,
            )
        java = [
            self.config.java,
            "-Xmx128m",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.xml'}",
            "-cp",
            f"{self.config.jars_dir}/*",
        ]
        common = [
            "--bootstrap-server",
            self.bootstrap,
            "--command-config",
            str(self.secure_files.admin_properties),
            "--add",
        ]
        grants = acl_grants(prefix)

        def run(args: list[str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*java, *args], capture_output=True, text=True, timeout=timeout, check=False
            )

        source = self.secure_files.directory / "AclBatch.java"
        source.write_text(ACL_BATCH_SOURCE)
        batch = [arg for g in grants for arg in [*common, *g.arguments(), ACL_BATCH_SEPARATOR]]
        if run([str(source), *batch]).returncode == 0:
            return 1
        # Two at a time: each JVM is mostly one core's work starting up.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            runs = list(pool.map(lambda g: run([ACL_COMMAND, *common, *g.arguments()]), grants))
        for grant, proc in zip(grants, runs, strict=True):
            if proc.returncode != 0:
                raise BrokerError(
                    f"granting {' '.join(grant.arguments())} failed (AclCommand exit "
                    f"{proc.returncode}):\n"
                    + indented_tail((proc.stdout + proc.stderr).splitlines(), 15),
                    code=LocalCode.KAFKA_ERROR,
                )
        return 1 + len(grants)

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
