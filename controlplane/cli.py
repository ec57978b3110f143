"""The `controlplane` command line: broker, topics, schemas (this module); rollouts and services in cli_*.

Entry point only: parses arguments, runs coroutines, maps our errors to exit codes and one
readable line on stderr. No business logic here.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from enum import IntEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from controlplane.broker import (
    DEFAULT_CONTROLLER_PORT,
    DEFAULT_PORT,
    BrokerConfig,
    ClusterConfig,
    ClusterStatus,
    LocalBroker,
    LocalCluster,
)
from controlplane.errors import BusError, ControlPlaneError, ErrorCode
from controlplane.settings import DEFAULT_BOOTSTRAP, KafkaSettings, load_settings

T = TypeVar("T")


class Exit(IntEnum):
    """Process exit codes, stable for CI."""

    OK = 0
    FAILED = 1
    TIMED_OUT = 2
    INVALID = 3
    UNREACHABLE = 4  # Kafka unreachable; a publish that fails so was certainly not published
    INTERNAL = 5
    UNKNOWN = 6  # a publish not confirmed in time: it may be in the log (check status)


app = typer.Typer(
    name="controlplane",
    help="Kafka-driven control plane for model-serving fleets.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
broker_app = typer.Typer(help="A local Apache Kafka 4.x broker (KRaft) for development and tests.")
topics_app = typer.Typer(help="The commands, acks and workers topics.")
schema_app = typer.Typer(help="The JSON Schemas of the wire protocol.")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
app.add_typer(schema_app, name="schema")

BootstrapOpt = Annotated[
    str,
    typer.Option(
        "--bootstrap", "-b", envvar="FLEET_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers."
    ),
]
PrefixOpt = Annotated[
    str, typer.Option("--topic-prefix", envvar="FLEET_TOPIC_PREFIX", help="Topic name prefix.")
]


def fail(error: ControlPlaneError) -> typer.Exit:
    """Print one readable error line and pick the exit code for its class."""
    typer.echo(f"error: {error.code}: {error.message}", err=True)
    if isinstance(error, BusError) and error.code is ErrorCode.BROKER_UNAVAILABLE:
        return typer.Exit(Exit.UNREACHABLE)
    if error.code is ErrorCode.PUBLISH_OUTCOME_UNKNOWN:
        return typer.Exit(Exit.UNKNOWN)
    if error.code in (
        ErrorCode.SCHEMA_INVALID,
        ErrorCode.PATH_NOT_ALLOWED,
        ErrorCode.NO_MATCHING_WORKERS,
        ErrorCode.TTL_TOO_LONG,
        ErrorCode.ROLLOUT_EXISTS,
        ErrorCode.SETTINGS_INVALID,
    ):
        return typer.Exit(Exit.INVALID)
    return typer.Exit(Exit.FAILED)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; our errors become one line and an exit code, and so does
    anything unexpected (exit 5): never a traceback."""
    try:
        return asyncio.run(coro)
    except ControlPlaneError as exc:
        raise fail(exc) from None
    except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a bug, or a library's stray CancelledError
        typer.echo(f"error: {ErrorCode.INTERNAL}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(Exit.INTERNAL) from None


def kafka_settings(
    bootstrap: str, prefix: str, *, delivery_timeout_s: float | None = None
) -> KafkaSettings:
    """The CLI's Kafka settings; ``delivery_timeout_s`` (at least 1 s) bounds each publish."""
    if delivery_timeout_s is None:
        return KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix)
    return KafkaSettings(
        bootstrap_servers=bootstrap,
        topic_prefix=prefix,
        delivery_timeout_ms=round(delivery_timeout_s * 1000),
    )


# --------------------------------------------------------------------------- broker


def _broker(
    port: int, controller_port: int, data_dir: Path, java: str = "java", heap_mb: int = 512
) -> LocalBroker:
    return LocalBroker(
        BrokerConfig(
            port=port,
            controller_port=controller_port,
            data_dir=data_dir,
            java=java,
            heap_mb=heap_mb,
        )
    )


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
) -> None:
    """Resolve Kafka's jars (cached), format KRaft storage, start, wait until it serves."""
    try:
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
    try:
        cluster = LocalCluster.load(data_dir)
    except ControlPlaneError as exc:
        raise fail(exc) from None
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
    try:
        cluster = LocalCluster.load(data_dir)
    except ControlPlaneError as exc:
        raise fail(exc) from None
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
    from controlplane.bus import Admin

    try:
        settings = load_settings(
            KafkaSettings,
            bootstrap_servers=bootstrap,
            topic_prefix=prefix,
            replication_factor=replication_factor,
            min_insync_replicas=min_insync_replicas,
        )
    except ControlPlaneError as exc:
        raise fail(exc) from None

    async def go() -> None:
        async with Admin(settings) as admin:
            report = await admin.ensure_topics(settings.topics)
        for name in report.created:
            typer.echo(f"created  {name}")
        for name in report.existing:
            typer.echo(f"ok       {name}")
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
    from controlplane import schema_export as export
    from controlplane.protocol import json_schemas

    if stdout:
        typer.echo(json.dumps(json_schemas(), indent=2, sort_keys=True))
        return
    target = directory or Path(__file__).parent / "schemas"
    if check:
        stale = export.check_schemas(target)
        if stale:
            typer.echo(f"stale: {', '.join(stale)}; run `controlplane schema export`", err=True)
            raise typer.Exit(Exit.FAILED)
        typer.echo("schemas are up to date")
        return
    for path in export.write_schemas(target):
        typer.echo(f"wrote {path}")


# Sub-command modules register themselves on ``app`` (they import the names above).
from controlplane import cli_rollout as _cli_rollout  # noqa: E402, F401
from controlplane import cli_services as _cli_services  # noqa: E402, F401


def main() -> None:
    try:
        app()
    except ControlPlaneError as exc:  # a last net: one line, never a traceback
        typer.echo(f"error: {exc.code}: {exc.message}", err=True)
        sys.exit(Exit.FAILED)
    except Exception as exc:  # a bug: still one line (exit 5)
        typer.echo(f"error: {ErrorCode.INTERNAL}: {type(exc).__name__}: {exc}", err=True)
        sys.exit(Exit.INTERNAL)
