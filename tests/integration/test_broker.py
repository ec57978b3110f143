"""The local broker: it starts for real, and each provisioning failure is a coded, readable error."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from controlplane.kafka.broker import (
    BrokerConfig,
    ClusterConfig,
    LocalBroker,
    LocalCluster,
    default_cache_dir,
)
from controlplane.kafka.bus import probe_sync
from controlplane.wire.errors import BrokerError, LocalCode


def _distinct_ports(n: int) -> list[int]:
    """``n`` free ports, all different: held open together while chosen (a port freed by one
    ``free_port()`` call can be handed out again by the next)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _config(tmp_path: Path, **kw: object) -> BrokerConfig:
    port, controller_port = _distinct_ports(2)
    return BrokerConfig(
        port=port,
        controller_port=controller_port,
        data_dir=tmp_path / "data",
        **kw,  # type: ignore[arg-type]
    )


def _fake_exe(tmp_path: Path, name: str, script: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_no_java(tmp_path: Path) -> None:
    broker = LocalBroker(_config(tmp_path, java="no-such-java-binary"))
    with pytest.raises(BrokerError) as info:
        broker.start()
    assert info.value.code is LocalCode.JAVA_NOT_FOUND
    assert "Java not found" in info.value.message


def test_java_too_old(tmp_path: Path) -> None:
    java = _fake_exe(tmp_path, "java", "echo 'openjdk version \"11.0.22\" 2024-01-16' >&2\n")
    broker = LocalBroker(_config(tmp_path, java=java))
    with pytest.raises(BrokerError) as info:
        broker.start()
    assert info.value.code is LocalCode.JAVA_TOO_OLD
    assert "Java 11" in info.value.message


def test_java_8_style_version_is_too_old(tmp_path: Path) -> None:
    java = _fake_exe(tmp_path, "java", "echo 'java version \"1.8.0_392\"' >&2\n")
    with pytest.raises(BrokerError) as info:
        LocalBroker(_config(tmp_path, java=java)).check_java()
    assert info.value.code is LocalCode.JAVA_TOO_OLD


def test_real_java_is_accepted(tmp_path: Path) -> None:
    assert LocalBroker(_config(tmp_path)).check_java() >= 17


def test_no_maven_with_empty_cache(tmp_path: Path) -> None:
    broker = LocalBroker(_config(tmp_path, mvn="no-such-mvn", cache_dir=tmp_path / "cache"))
    with pytest.raises(BrokerError) as info:
        broker.start()
    assert info.value.code is LocalCode.MAVEN_NOT_FOUND


@pytest.mark.slow
def test_jars_unresolvable(tmp_path: Path) -> None:
    broker = LocalBroker(
        _config(tmp_path, kafka_version="0.0.0-does-not-exist", cache_dir=tmp_path / "cache")
    )
    with pytest.raises(BrokerError) as info:
        broker.ensure_jars()
    assert info.value.code is LocalCode.JARS_UNRESOLVABLE
    assert "0.0.0-does-not-exist" in info.value.message
    assert not (tmp_path / "cache" / "kafka-0.0.0-does-not-exist" / "libs").exists()


def test_port_in_use(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", config.port))
        sock.listen()
        with pytest.raises(BrokerError) as info:
            LocalBroker(config).start()
    assert info.value.code is LocalCode.PORT_IN_USE
    assert str(config.port) in info.value.message


@pytest.mark.kafka
def test_broker_that_dies_during_start_shows_its_log(tmp_path: Path) -> None:
    # A setting that formats fine but makes the broker exit at start-up.
    broker = LocalBroker(_config(tmp_path, overrides={"num.io.threads": "0"}))
    with pytest.raises(BrokerError) as info:
        broker.start(timeout=90)
    assert info.value.code in (LocalCode.BROKER_DIED,)
    assert "last lines" in info.value.message or "formatting" in info.value.message
    assert not broker.status().running


@pytest.mark.kafka
def test_start_serve_stop_restart(tmp_path: Path) -> None:
    """A broker starts, answers metadata, stops, and restarts on the same data (no re-format)."""
    broker = LocalBroker(_config(tmp_path))
    try:
        status = broker.start(timeout=120)
        assert status.running and status.pid
        assert broker.start().pid == status.pid  # idempotent
        info = probe_sync(broker.bootstrap)
        assert info.brokers == 1
        meta = (tmp_path / "data" / "kraft-logs" / "meta.properties").read_text()
        assert broker.stop() is True
        assert not broker.status().running
        assert broker.stop() is False  # idempotent
        broker.start(timeout=120)
        assert probe_sync(broker.bootstrap).cluster_id == info.cluster_id
        assert (tmp_path / "data" / "kraft-logs" / "meta.properties").read_text() == meta
    finally:
        broker.stop()


def test_jar_cache_is_reused(tmp_path: Path) -> None:
    """Once resolved, the jars come from the cache: Maven is not even looked up."""
    config = BrokerConfig(cache_dir=default_cache_dir(), mvn="no-such-mvn")
    if not (config.jars_dir.parent / "RESOLVED").exists():
        LocalBroker(BrokerConfig()).ensure_jars()
    libs = LocalBroker(config).ensure_jars()
    names = os.listdir(libs)
    assert any(n.startswith("kafka_2.13-4.") for n in names), names
    assert any(n.startswith("log4j-slf4j2-impl") for n in names), names


def test_cli_style_module_runs_without_traceback_on_error(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "controlplane",
            "broker",
            "start",
            "--java",
            "no-such-java",
            "--data-dir",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert "JAVA_NOT_FOUND" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.kafka
def test_a_cluster_id_that_starts_with_a_dash_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """About 1 in 64 random ids start with '-' (base64url of a first byte 0xF8-0xFB); kafka-storage
    must not read such an id as an option."""
    import uuid

    forced = uuid.UUID(bytes=bytes([0xF8]) + uuid.uuid4().bytes[1:])
    monkeypatch.setattr("controlplane.kafka.broker.uuid.uuid4", lambda: forced)
    broker = LocalBroker(_config(tmp_path))
    try:
        broker.start(timeout=120)
        cluster_id = probe_sync(broker.bootstrap).cluster_id
        assert cluster_id is not None and cluster_id.startswith("-"), cluster_id
    finally:
        broker.stop()


# --------------------------------------------------------------------------- a local cluster


def _cluster_config(tmp_path: Path, nodes: int, **kw: object) -> ClusterConfig:
    ports = _distinct_ports(2 * nodes)
    return ClusterConfig(
        nodes=nodes,
        ports=ports[:nodes],
        controller_ports=ports[nodes:],
        data_dir=tmp_path / "cluster",
        heap_mb=256,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("nodes", "rf", "min_isr"), [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 3, 2)])
def test_cluster_replication_defaults_follow_n(nodes: int, rf: int, min_isr: int) -> None:
    config = ClusterConfig(nodes=nodes)
    props = config.replication_properties()
    assert props["default.replication.factor"] == str(rf)
    assert props["offsets.topic.replication.factor"] == str(rf)
    assert props["transaction.state.log.replication.factor"] == str(rf)
    assert props["min.insync.replicas"] == str(min_isr)
    assert props["transaction.state.log.min.isr"] == str(min_isr)


def test_cluster_nodes_share_one_static_quorum(tmp_path: Path) -> None:
    """Default ports step by 2 from --port/--controller-port; every node names all voters, has its
    own node id, data dir and listeners, and the same cluster id."""
    cluster = LocalCluster(ClusterConfig(nodes=3, data_dir=tmp_path / "c"))
    assert cluster.bootstrap == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    voters = "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"
    for i, node in enumerate(cluster.nodes, start=1):
        props = node._properties()
        assert props["node.id"] == str(i)
        assert props["controller.quorum.voters"] == voters
        assert "controller.quorum.bootstrap.servers" not in props
        assert props["listeners"] == (
            f"PLAINTEXT://127.0.0.1:{19090 + 2 * i},CONTROLLER://127.0.0.1:{19091 + 2 * i}"
        )
        assert props["log.dirs"] == str(tmp_path / "c" / f"node-{i}" / "kraft-logs")
        assert props["default.replication.factor"] == "3"
        assert node.config.cluster_id == cluster.cluster_id
    # A lone broker keeps its standalone quorum.
    alone = LocalBroker(_config(tmp_path))._properties()
    assert alone["node.id"] == "1" and "controller.quorum.voters" not in alone
    assert alone["controller.quorum.bootstrap.servers"].startswith("127.0.0.1:")


@pytest.mark.parametrize(
    "kw",
    [
        {"nodes": 0},
        {"nodes": 2, "port": 20000, "controller_port": 20002},  # node 2's client port
        {"nodes": 2, "ports": [20000], "controller_ports": [20001, 20003]},
    ],
)
def test_cluster_bad_layout_is_a_coded_error(tmp_path: Path, kw: dict[str, object]) -> None:
    with pytest.raises(BrokerError) as info:
        LocalCluster(ClusterConfig(data_dir=tmp_path / "c", **kw))  # type: ignore[arg-type]
    assert info.value.code is LocalCode.SETTINGS_INVALID


def test_cluster_refuses_a_single_broker_dir_and_unknown_nodes(tmp_path: Path) -> None:
    (tmp_path / "c" / "kraft-logs").mkdir(parents=True)
    with pytest.raises(BrokerError) as info:
        LocalCluster(ClusterConfig(nodes=3, data_dir=tmp_path / "c"))
    assert info.value.code is LocalCode.SETTINGS_INVALID
    assert "single-node" in info.value.message
    cluster = LocalCluster(ClusterConfig(nodes=2, data_dir=tmp_path / "d"))
    with pytest.raises(BrokerError) as info:
        cluster.stop_node(3)
    assert info.value.code is LocalCode.SETTINGS_INVALID


@pytest.mark.kafka
@pytest.mark.slow
def test_cli_starts_reports_and_stops_a_cluster(tmp_path: Path) -> None:
    """`broker start --nodes 2` prints the bootstrap list; status and stop find the cluster by its
    data dir; a node that dies makes status say so (exit 1)."""
    import subprocess

    data_dir = str(tmp_path / "c")
    port, cport = _distinct_ports(2)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controlplane", "broker", *args, "--data-dir", data_dir],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    # Ports step by 2: pick a client/controller pair whose next pair is most likely free too.
    out = cli("start", "--nodes", "2", "--port", str(port), "--controller-port", str(cport))
    cluster = LocalCluster.load(Path(data_dir))
    assert cluster is not None
    try:
        if out.returncode != 0 and "PORT_IN_USE" in out.stderr:
            pytest.skip(f"a derived port was taken: {out.stderr}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == cluster.bootstrap
        assert probe_sync(cluster.bootstrap, timeout=20).brokers == 2
        out = cli("status")
        assert out.returncode == 0 and "running:" in out.stdout and "2 of 2 nodes" in out.stdout
        assert cluster.stop_node(2, kill=True)
        out = cli("status")
        assert out.returncode == 1 and "degraded:" in out.stdout and "1 of 2 nodes" in out.stdout
        out = cli("stop")
        assert out.returncode == 0 and out.stdout.strip() == "stopped (1 of 2 nodes)"
        assert not any(n.status().running for n in cluster.nodes)
        out = cli("status")
        assert out.returncode == 1 and out.stdout.strip() == "not running"
        assert cli("stop").stdout.strip() == "not running"
    finally:
        cluster.stop()


@pytest.mark.kafka
@pytest.mark.slow
def test_a_cluster_node_that_dies_during_start_shows_its_log(tmp_path: Path) -> None:
    # Storage formats (its JVM has its own heap), but no Kafka node lives in 8 MB of heap.
    config = _cluster_config(tmp_path, 2)
    config.heap_mb = 8
    cluster = LocalCluster(config)
    try:
        with pytest.raises(BrokerError) as info:
            cluster.start(timeout=120)
        assert info.value.code is LocalCode.BROKER_DIED
        assert "exited with status" in info.value.message and "broker.log" in info.value.message
        assert cluster.status().running_nodes == []
    finally:
        cluster.stop()
