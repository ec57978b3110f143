"""`controlplane broker`, `topics` and `schema`: the local Kafka, the topics, the JSON Schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.common import BootstrapOpt, Exit, PrefixOpt, app, fail, kafka_settings, run
from controlplane.kafka.broker import (
    DEFAULT_CONTROLLER_PORT,
    DEFAULT_PORT,
    BrokerConfig,
    ClusterConfig,
    ClusterStatus,
    LocalBroker,
    LocalCluster,
)
from controlplane.kafka.secure import MECHANISM
from controlplane.kafka.settings import DEFAULT_BOOTSTRAP
from controlplane.wire.errors import BrokerError, ControlPlaneError, LocalCode

broker_app = typer.Typer(help="A local Apache Kafka 4.x broker (KRaft) for development and tests.")
topics_app = typer.Typer(help="The commands, acks and workers topics.")
schema_app = typer.Typer(help="The JSON Schemas of the wire protocol.")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
app.add_typer(schema_app, name="schema")


# --------------------------------------------------------------------------- broker


def _broker(
    port: int,
    controller_port: int,
    data_dir: Path,
    java: str = "java",
    heap_mb: int = 512,
    *,
    secure: bool = False,
) -> LocalBroker:
    return LocalBroker(
        BrokerConfig(
            port=port,
            controller_port=controller_port,
            data_dir=data_dir,
            java=java,
            heap_mb=heap_mb,
            secure=secure,
        )
    )


#: Who uses each Kafka user of a secured broker, and the env prefix of its settings.
_USERS = (
    ("worker", "worker agents", "FLEET_WORKER_"),
    ("coordinator", "coordinators", "FLEET_COORDINATOR_"),
    ("ci", "who publishes rollouts: the controlplane CLI (or a Kafka client of its own)", "FLEET_"),
)
#: The CLI's flags read these (``--bootstrap``, ``--topic-prefix``); the rest, FLEET_KAFKA__*.
_CLI_FLAG_ENV = {"BOOTSTRAP_SERVERS": "FLEET_KAFKA_BOOTSTRAP", "TOPIC_PREFIX": "FLEET_TOPIC_PREFIX"}


def secure_env_lines(broker: LocalBroker, prefix: str) -> list[str]:
    """For each user but admin, the environment its process connects with (a password file
    each, mode 0600, never the password itself)."""
    files = broker.secure_files
    lines: list[str] = []
    for principal, who, env in _USERS:
        values = {
            "BOOTSTRAP_SERVERS": broker.bootstrap,
            "TOPIC_PREFIX": prefix,
            "SECURITY_PROTOCOL": "SASL_SSL",
            "SASL_MECHANISM": MECHANISM,
            "SASL_USERNAME": principal,
            "SASL_PASSWORD_FILE": str(files.password_file(principal)),
            "SSL_CAFILE": str(files.ca),
        }
        lines.append(f"# {principal}: {who}")
        for key, value in values.items():
            name = f"{env}KAFKA__{key}"
            if principal == "ci":
                name = _CLI_FLAG_ENV.get(key, name)
            lines.append(f"{name}={value}")
    lines.append(
        f"# admin: a super user (topics, ACLs); Kafka's own tools: --command-config "
        f"{files.admin_properties}"
    )
    return lines


def _start_secured(broker: LocalBroker, prefix: str, timeout: float) -> None:
    """Start a secured broker; as admin, make the topics of ``prefix`` and grant the ACLs."""
    from controlplane.kafka.bus import Admin

    status = broker.start(timeout=timeout)
    admin_settings = broker.settings("admin", topic_prefix=prefix)

    async def ensure() -> None:
        async with Admin(admin_settings) as admin:
            await admin.ensure_topics(admin_settings.topics)
            await admin.ensure_topics(admin_settings.topics.snapshots_only())

    run(ensure())
    try:
        runs = broker.grant_acls(prefix)
    except ControlPlaneError as exc:
        raise fail(exc) from None
    typer.echo(
        f"Apache Kafka {status.kafka_version} running at {status.bootstrap}, secured: SASL_SSL "
        f"with {MECHANISM}, ACLs on the topics {prefix}.* ({runs} grants); pid {status.pid}, "
        f"data {status.data_dir}, log {status.log_file}"
    )
    for line in secure_env_lines(broker, prefix):
        typer.echo(line)


def _cluster(
    nodes: int,
    port: int,
    controller_port: int,
    data_dir: Path,
    java: str = "java",
    heap_mb: int = 512,
) -> LocalCluster:
    """A cluster of ``nodes``; one already laid out in ``data_dir`` keeps its ports."""
    config = ClusterConfig(
        nodes=nodes,
        port=port,
        controller_port=controller_port,
        data_dir=data_dir,
        java=java,
        heap_mb=heap_mb,
    )
    saved = LocalCluster.load(data_dir)
    if saved is not None and saved.config.nodes == nodes:
        config.ports = saved.config.client_ports()
        config.controller_ports = saved.config.quorum_ports()
    return LocalCluster(config)


def _saved_cluster(data_dir: Path) -> LocalCluster | None:
    """The cluster laid out in ``data_dir``, None for a single broker (or nothing there)."""
    try:
        return LocalCluster.load(data_dir)
    except ControlPlaneError as exc:
        raise fail(exc) from None


def _cluster_line(status: ClusterStatus) -> str:
    up = status.running_nodes
    pids = ", ".join(str(n.pid) for n in status.nodes if n.pid is not None)
    return (
        f"Apache Kafka {status.kafka_version} cluster, {len(up)} of {len(status.nodes)} nodes "
        f"at {status.bootstrap} (pids {pids})"
    )


PortOpt = Annotated[int, typer.Option("--port", help="Client port on 127.0.0.1.")]
CPortOpt = Annotated[int, typer.Option("--controller-port", help="KRaft controller port.")]
DataOpt = Annotated[Path, typer.Option("--data-dir", help="Broker data and log directory.")]


@broker_app.command("start")
def broker_start(
    port: PortOpt = DEFAULT_PORT,
    controller_port: CPortOpt = DEFAULT_CONTROLLER_PORT,
    data_dir: DataOpt = Path(".fleet/broker"),
    java: Annotated[str, typer.Option(help="Java executable (17+).")] = "java",
    heap_mb: Annotated[int, typer.Option(help="Broker JVM heap in MB.")] = 512,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for readiness.")] = 90.0,
    nodes: Annotated[
        int,
        typer.Option(
            "--nodes",
            help="Combined broker+controller nodes (N > 1: a local cluster; node i listens on "
            "--port + 2(i-1) and --controller-port + 2(i-1), data in DATA_DIR/node-i).",
        ),
    ] = 1,
    secure: Annotated[
        bool,
        typer.Option(
            "--secure",
            help="SASL_SSL (SCRAM-SHA-512) with a CA of its own and ACLs (users admin, "
            "coordinator, ci, worker; secrets in DATA_DIR/secure, mode 0600); makes the topics "
            "of --topic-prefix and their ACLs, and prints each user's environment. A data dir "
            "is formatted secured or not, once.",
        ),
    ] = False,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Resolve Kafka's jars (cached), format KRaft storage, start, wait until it serves."""
    try:
        if secure:
            if nodes != 1 or LocalCluster.load(data_dir) is not None:
                raise BrokerError(
                    "--secure starts one broker, not a cluster (--nodes 1, a data dir of one)",
                    code=LocalCode.SETTINGS_INVALID,
                )
            broker = _broker(port, controller_port, data_dir, java, heap_mb, secure=True)
            _start_secured(broker, prefix, timeout)
            return
        if nodes != 1 or LocalCluster.load(data_dir) is not None:
            cluster = _cluster(nodes, port, controller_port, data_dir, java, heap_mb)
            cstatus = cluster.start(timeout=max(timeout, 120.0))
            typer.echo(f"running: {_cluster_line(cstatus)}; data {cstatus.data_dir}")
            typer.echo(cstatus.bootstrap)
            return
        status = _broker(port, controller_port, data_dir, java, heap_mb).start(timeout=timeout)
    except ControlPlaneError as exc:
        raise fail(exc) from None
    typer.echo(
        f"Apache Kafka {status.kafka_version} running at {status.bootstrap} "
        f"(pid {status.pid}, data {status.data_dir}, log {status.log_file})"
    )


#: What ``broker secure-files`` adds to ensure_secure_files' directory for the apache/kafka image.
JAAS_FILE = "kafka_server_jaas.conf"
ACL_SCRIPT = "grant-acls.sh"


@broker_app.command("secure-files")
def broker_secure_files(
    directory: Annotated[Path, typer.Argument(help="Where the files go (made mode 0700).")],
    hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            help="A host name clients reach the broker by, added to its certificate's SAN "
            "(localhost and 127.0.0.1 are always there); repeatable.",
        ),
    ] = None,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Make a secured broker's CA, certificate and users' passwords in DIRECTORY (once, as
    `broker start --secure` does), plus the broker's JAAS file and a kafka-acls.sh script of
    the users' ACLs on the topics of --topic-prefix: for a broker this command does not run
    (compose.secure.yaml). Prints where each file is."""
    from controlplane.kafka.secure import (
        PRINCIPALS,
        acl_grants,
        ensure_secure_files,
        jaas,
        write_private,
    )

    try:
        files = ensure_secure_files(directory, hosts or ())
        passwords = files.passwords()
    except (ControlPlaneError, OSError) as exc:
        if isinstance(exc, OSError):
            exc = BrokerError(
                f"cannot write the broker's files in {directory}: {exc.strerror or exc}",
                code=LocalCode.SETTINGS_INVALID,
            )
        raise fail(exc) from None
    jaas_file = directory / JAAS_FILE
    write_private(
        jaas_file, f"KafkaServer {{\n  {jaas('admin', passwords['admin'])}\n}};\n".encode()
    )
    script = directory / ACL_SCRIPT
    lines = [
        "#!/bin/sh",
        "# Usage: grant-acls.sh BOOTSTRAP [KAFKA_ACLS]: the ACLs of ci, worker and coordinator",
        f"# on the topics {prefix}.* (controlplane/kafka/secure.py acl_grants), as admin.",
        "set -eu",
        'acls="${2:-kafka-acls.sh}"',
        *(
            f'"$acls" --bootstrap-server "$1" --command-config {files.admin_properties} --add '
            + " ".join(f"'{arg}'" for arg in grant.arguments())
            for grant in acl_grants(prefix)
        ),
    ]
    write_private(script, ("\n".join(lines) + "\n").encode())
    typer.echo(f"CA (ssl_cafile): {files.ca}")
    typer.echo(f"broker key and certificate (PEM keystore): {files.keystore}")
    typer.echo(f"broker JAAS (admin's login; KAFKA_OPTS): {jaas_file}")
    for principal in PRINCIPALS:
        typer.echo(f"{principal} password (sasl_password_file): {files.password_file(principal)}")
    typer.echo(f"every user's password (JSON, for the broker's format): {files.users}")
    typer.echo(f"admin's Kafka tools config (--command-config): {files.admin_properties}")
    typer.echo(f"ACLs (sh {script} BOOTSTRAP): {script}")


@broker_app.command("install")
def broker_install(
    java: Annotated[str, typer.Option(help="Java executable (17+).")] = "java",
) -> None:
    """Check Java and resolve Apache Kafka's jars into the cache (once; later runs download nothing)."""
    broker = LocalBroker(BrokerConfig(java=java))
    try:
        major = broker.check_java()
        libs = broker.ensure_jars()
    except ControlPlaneError as exc:
        raise fail(exc) from None
    size = sum(p.stat().st_size for p in libs.glob("*.jar"))
    typer.echo(
        f"Apache Kafka {broker.config.kafka_version} jars in {libs} "
        f"({len(list(libs.glob('*.jar')))} jars, {size / 1e6:.1f} MB); Java {major}"
    )


@broker_app.command("stop")
def broker_stop(
    port: PortOpt = DEFAULT_PORT,
    controller_port: CPortOpt = DEFAULT_CONTROLLER_PORT,
    data_dir: DataOpt = Path(".fleet/broker"),
) -> None:
    """Stop the broker (or every node of a cluster): SIGTERM, wait, then SIGKILL."""
    cluster = _saved_cluster(data_dir)
    if cluster is not None:
        count = len(cluster.status().running_nodes)
        cluster.stop()
        typer.echo(f"stopped ({count} of {len(cluster.nodes)} nodes)" if count else "not running")
        return
    stopped = _broker(port, controller_port, data_dir).stop()
    typer.echo("stopped" if stopped else "not running")


@broker_app.command("status")
def broker_status(
    port: PortOpt = DEFAULT_PORT,
    controller_port: CPortOpt = DEFAULT_CONTROLLER_PORT,
    data_dir: DataOpt = Path(".fleet/broker"),
) -> None:
    """Say whether the broker (or every node of a cluster) runs; exit 1 when it does not."""
    cluster = _saved_cluster(data_dir)
    if cluster is not None:
        cstatus = cluster.status()
        if not cstatus.running_nodes:
            typer.echo("not running")
            raise typer.Exit(Exit.FAILED)
        typer.echo(f"{'running' if cstatus.running else 'degraded'}: {_cluster_line(cstatus)}")
        if not cstatus.running:
            raise typer.Exit(Exit.FAILED)
        return
    status = _broker(port, controller_port, data_dir).status()
    if status.running:
        typer.echo(
            f"running: Apache Kafka {status.kafka_version} at {status.bootstrap} (pid {status.pid})"
        )
    else:
        typer.echo("not running")
        raise typer.Exit(Exit.FAILED)


# --------------------------------------------------------------------------- topics


@topics_app.command("ensure")
def topics_ensure(
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
    replication_factor: Annotated[
        int | None,
        typer.Option(
            "--replication-factor",
            envvar="FLEET_REPLICATION_FACTOR",
            help="Replicas per partition; default: the cluster's default.replication.factor.",
        ),
    ] = None,
    min_insync_replicas: Annotated[
        int | None,
        typer.Option(
            "--min-insync-replicas",
            envvar="FLEET_MIN_INSYNC_REPLICAS",
            help="min.insync.replicas; default: the replication factor - 1 from 3, else 1.",
        ),
    ] = None,
) -> None:
    """Create the topics, or check that existing ones match (exit 1 listing differences)."""
    from controlplane.kafka.bus import Admin

    settings = kafka_settings(
        bootstrap,
        prefix,
        replication_factor=replication_factor,
        min_insync_replicas=min_insync_replicas,
    )

    async def go() -> None:
        async with Admin(settings) as admin:
            report = await admin.ensure_topics(settings.topics)
            # The coordinators' snapshots (not in Topics.ensured(): a fleet works without it).
            snapshots = await admin.ensure_topics(settings.topics.snapshots_only())
        for name in [*report.created, *snapshots.created]:
            typer.echo(f"created  {name}")
        for name in [*report.existing, *snapshots.existing]:
            typer.echo(f"ok       {name}")
        for line in [*report.altered, *snapshots.altered]:
            typer.echo(f"altered  {line}")
        typer.echo(
            f"replication factor {report.replication_factor}, "
            f"min.insync.replicas {report.min_insync_replicas}"
        )

    run(go())


# --------------------------------------------------------------------------- schemas


@schema_app.command("export")
def schema_export(
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Where to write; default: the package's schemas/.")
    ] = None,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 if the files are stale.")] = False,
    stdout: Annotated[
        bool, typer.Option("--stdout", help="Print the schemas as one JSON.")
    ] = False,
) -> None:
    """Write the JSON Schemas of command, ack and heartbeat (for producers in any language)."""
    from controlplane.wire import schema_export as export
    from controlplane.wire.protocol import json_schemas

    if stdout:
        typer.echo(json.dumps(json_schemas(), indent=2, sort_keys=True))
        return
    target = directory or export.SCHEMA_DIR
    if check:
        stale = export.check_schemas(target)
        if stale:
            typer.echo(f"stale: {', '.join(stale)}; run `controlplane schema export`", err=True)
            raise typer.Exit(Exit.FAILED)
        typer.echo("schemas are up to date")
        return
    for path in export.write_schemas(target):
        typer.echo(f"wrote {path}")
