"""What a worker is told when the secured broker (``kafka_secure``: SASL_SSL, SCRAM-SHA-512) will
not have it: a wrong password is KAFKA_AUTH_FAILED, a CA that did not sign the broker's
certificate KAFKA_TLS_UNTRUSTED; one coded line and an exit code, never a traceback, never the
password. Before: aiokafka's bootstrap logged the cause and raised "Unable to bootstrap", which
read as BROKER_UNAVAILABLE (is Kafka down?)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from pydantic import SecretStr
from typer.testing import CliRunner

from controlplane.kafka.bus import Producer
from controlplane.kafka.secure import make_ca
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode
from workers.cli import app as worker_app

pytestmark = [pytest.mark.kafka]


def worker_env(settings: KafkaSettings, **changed: str) -> dict[str, str]:
    """The FLEET_WORKER_KAFKA__* environment of ``settings``, with ``changed`` fields."""
    password = settings.sasl_password.get_secret_value() if settings.sasl_password else ""
    values = {
        "bootstrap_servers": settings.bootstrap_servers,
        "topic_prefix": settings.topic_prefix,
        "security_protocol": settings.security_protocol,
        "sasl_mechanism": settings.sasl_mechanism or "",
        "sasl_username": settings.sasl_username or "",
        "sasl_password": password,
        "ssl_cafile": settings.ssl_cafile or "",
        "request_timeout_ms": "5000",
        **changed,
    }
    return {f"FLEET_WORKER_KAFKA__{k.upper()}": v for k, v in values.items()}


def run_worker(tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    result = CliRunner().invoke(
        worker_app,
        ["run", "--id", "sec-refused", "--runner", "fake", "--state-dir", str(tmp_path)],
        env=env,
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def start_refused(settings: KafkaSettings) -> BusError:
    """How a client's start with ``settings`` fails (the worker's CLI runs its own loop, so
    these tests are synchronous)."""

    async def start() -> None:
        async with Producer(settings):
            pass

    with pytest.raises(BusError) as refused:
        asyncio.run(start())
    return refused.value


def error_line(output: str, code: LocalCode) -> str:
    """The one line the worker ends with: ``error: CODE: ...``."""
    assert "Traceback" not in output, output
    [line] = [x for x in output.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: {code.value}: "), output
    return line


def test_wrong_password_is_kafka_auth_failed(
    kafka_secure: dict[str, KafkaSettings], tmp_path: Path
) -> None:
    worker = kafka_secure["worker"]
    code, output = run_worker(tmp_path, worker_env(worker, sasl_password="not-the-password"))
    line = error_line(output, LocalCode.KAFKA_AUTH_FAILED)
    assert code != 0 and "user 'worker'" in line and "sasl_password" in line, output
    assert "not-the-password" not in output
    # The same through a client's start (what every process starts with), as an unknown user.
    wrong = worker.model_copy(update={"sasl_username": "nobody", "sasl_password": SecretStr("x")})
    assert start_refused(wrong).code is LocalCode.KAFKA_AUTH_FAILED


def test_untrusted_ca_is_kafka_tls_untrusted(
    kafka_secure: dict[str, KafkaSettings], tmp_path: Path
) -> None:
    """A CA of our own, which did not sign the broker's certificate."""
    _, ca = make_ca("a stranger's CA")
    stranger = tmp_path / "stranger-ca.pem"
    stranger.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    env = worker_env(kafka_secure["worker"], ssl_cafile=str(stranger))
    code, output = run_worker(tmp_path, env)
    line = error_line(output, LocalCode.KAFKA_TLS_UNTRUSTED)
    assert code != 0 and "ssl_cafile" in line and "not trusted" in line, output
    settings = kafka_secure["ci"].model_copy(update={"ssl_cafile": str(stranger)})
    assert start_refused(settings).code is LocalCode.KAFKA_TLS_UNTRUSTED


def test_a_worker_run_as_a_user_without_its_acls_is_kafka_access_denied(
    kafka_secure: dict[str, KafkaSettings], tmp_path: Path
) -> None:
    """The `ci` user may not read a worker's consumer group: the worker's start is refused by
    an ACL, and says so with the resource, not with a traceback."""
    code, output = run_worker(tmp_path, worker_env(kafka_secure["ci"]))
    line = error_line(output, LocalCode.KAFKA_ACCESS_DENIED)
    assert code != 0 and "ACLs" in line, output
