"""The local broker: it starts for real, and each provisioning failure is a coded, readable error."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from controlplane.broker import BrokerConfig, LocalBroker, default_cache_dir
from controlplane.bus import probe_sync
from controlplane.errors import BrokerError, ErrorCode
from tests.conftest import free_port


def _config(tmp_path: Path, **kw: object) -> BrokerConfig:
    return BrokerConfig(
        port=free_port(),
        controller_port=free_port(),
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
    assert info.value.code is ErrorCode.JAVA_NOT_FOUND
    assert "Java not found" in info.value.message


def test_java_too_old(tmp_path: Path) -> None:
    java = _fake_exe(tmp_path, "java", "echo 'openjdk version \"11.0.22\" 2024-01-16' >&2\n")
    broker = LocalBroker(_config(tmp_path, java=java))
    with pytest.raises(BrokerError) as info:
        broker.start()
    assert info.value.code is ErrorCode.JAVA_TOO_OLD
    assert "Java 11" in info.value.message


def test_java_8_style_version_is_too_old(tmp_path: Path) -> None:
    java = _fake_exe(tmp_path, "java", "echo 'java version \"1.8.0_392\"' >&2\n")
    with pytest.raises(BrokerError) as info:
        LocalBroker(_config(tmp_path, java=java)).check_java()
    assert info.value.code is ErrorCode.JAVA_TOO_OLD


def test_real_java_is_accepted(tmp_path: Path) -> None:
    assert LocalBroker(_config(tmp_path)).check_java() >= 17


def test_no_maven_with_empty_cache(tmp_path: Path) -> None:
    broker = LocalBroker(_config(tmp_path, mvn="no-such-mvn", cache_dir=tmp_path / "cache"))
    with pytest.raises(BrokerError) as info:
        broker.start()
    assert info.value.code is ErrorCode.MAVEN_NOT_FOUND


@pytest.mark.slow
def test_jars_unresolvable(tmp_path: Path) -> None:
    broker = LocalBroker(
        _config(tmp_path, kafka_version="0.0.0-does-not-exist", cache_dir=tmp_path / "cache")
    )
    with pytest.raises(BrokerError) as info:
        broker.ensure_jars()
    assert info.value.code is ErrorCode.JARS_UNRESOLVABLE
    assert "0.0.0-does-not-exist" in info.value.message
    assert not (tmp_path / "cache" / "kafka-0.0.0-does-not-exist" / "libs").exists()


def test_port_in_use(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", config.port))
        sock.listen()
        with pytest.raises(BrokerError) as info:
            LocalBroker(config).start()
    assert info.value.code is ErrorCode.PORT_IN_USE
    assert str(config.port) in info.value.message


@pytest.mark.kafka
def test_broker_that_dies_during_start_shows_its_log(tmp_path: Path) -> None:
    # A setting that formats fine but makes the broker exit at start-up.
    broker = LocalBroker(_config(tmp_path, overrides={"num.io.threads": "0"}))
    with pytest.raises(BrokerError) as info:
        broker.start(timeout=90)
    assert info.value.code in (ErrorCode.BROKER_DIED,)
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

    import controlplane.broker as broker_module

    forced = uuid.UUID(bytes=bytes([0xF8]) + uuid.uuid4().bytes[1:])
    monkeypatch.setattr(broker_module.uuid, "uuid4", lambda: forced)
    broker = LocalBroker(_config(tmp_path))
    try:
        broker.start(timeout=120)
        cluster_id = probe_sync(broker.bootstrap).cluster_id
        assert cluster_id is not None and cluster_id.startswith("-"), cluster_id
    finally:
        broker.stop()
