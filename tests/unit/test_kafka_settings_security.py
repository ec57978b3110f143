"""Kafka security settings: refused before any connection when they make no sense together
(PLAIN in the clear, SASL without credentials, OAUTHBEARER without a token provider), each a coded
line for the user; what is accepted reaches aiokafka (key password, password file, token provider)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
from aiokafka.abc import AbstractTokenProvider
from typer.testing import CliRunner

from controlplane.kafka.client import client_options
from controlplane.kafka.settings import KafkaSettings, load_settings
from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode
from tests.unit.test_kafka_diagnose import server_cert
from workers.cli import EXIT_SETTINGS
from workers.cli import app as worker_app


class Provider(AbstractTokenProvider):  # type: ignore[misc]  # aiokafka is untyped
    """Named by the tests as ``tests.unit.test_kafka_settings_security:Provider``."""

    async def token(self) -> str:
        return "a-token"


PROVIDER = Provider()
NOT_A_PROVIDER = object()
HERE = __name__


def refusal(**values: Any) -> str:
    with pytest.raises(ControlPlaneError) as refused:
        load_settings(KafkaSettings, **values)
    assert refused.value.code is WireCode.SCHEMA_INVALID
    return refused.value.message


SCRAM = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}
            | {"sasl_username": "u", "sasl_password": "p"},
            "PLAIN over SASL_PLAINTEXT sends the password in the clear",
        ),
        (SCRAM, "sasl_mechanism SCRAM-SHA-512 needs sasl_username"),
        (SCRAM | {"sasl_username": "ci"}, "needs sasl_password or sasl_password_file"),
        (
            SCRAM | {"sasl_username": "ci", "sasl_password": "p", "sasl_password_file": "/x"},
            "give sasl_password or sasl_password_file, not both",
        ),
        ({"security_protocol": "SASL_SSL"}, "security_protocol SASL_SSL needs a sasl_mechanism"),
        (
            {"sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u", "sasl_password": "p"},
            "security_protocol is PLAINTEXT",
        ),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
            "sasl_mechanism OAUTHBEARER needs sasl_oauth_token_provider",
        ),
        (
            {"sasl_oauth_token_provider": "no_colon"},
            "sasl_oauth_token_provider: Value error, 'no_colon' is not 'module:attr'",
        ),
        (
            {"sasl_oauth_token_provider": "no_such_module_xyz:P"},
            "cannot import 'no_such_module_xyz'",
        ),
        ({"sasl_oauth_token_provider": f"{HERE}:Nope"}, "has no attribute 'Nope'"),
        (
            {"sasl_oauth_token_provider": f"{HERE}:NOT_A_PROVIDER"},
            "is a object, not an aiokafka.abc.AbstractTokenProvider",
        ),
    ],
)
def test_security_settings_that_cannot_work_are_refused(
    values: dict[str, Any], expected: str
) -> None:
    message = refusal(**values)
    assert message.startswith("invalid settings: ") and expected in message, message


def test_plain_without_tls_only_when_allowed() -> None:
    settings = KafkaSettings(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="u",
        sasl_password="p",
        allow_plain_without_tls=True,
    )
    opts = client_options(settings)
    assert (opts["sasl_plain_username"], opts["sasl_plain_password"]) == ("u", "p")


@pytest.mark.parametrize("spec", [f"{HERE}:PROVIDER", f"{HERE}:Provider"])
def test_oauthbearer_reaches_aiokafka_with_its_provider(spec: str) -> None:
    settings = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="OAUTHBEARER",
        sasl_oauth_token_provider=spec,
    )
    provider = client_options(settings)["sasl_oauth_token_provider"]
    assert isinstance(provider, Provider)
    # One provider for every client of these settings (it may cache its token).
    assert client_options(settings)["sasl_oauth_token_provider"] is provider
    assert "sasl_plain_password" not in client_options(settings)


def test_the_password_file_is_read_when_a_client_is_made(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("first\n")
    settings = KafkaSettings(**SCRAM, sasl_username="ci", sasl_password_file=secret)
    assert client_options(settings)["sasl_plain_password"] == "first"
    secret.write_text("rotated")
    assert client_options(settings)["sasl_plain_password"] == "rotated"
    secret.unlink()
    with pytest.raises(ControlPlaneError) as unreadable:
        client_options(settings)
    assert unreadable.value.code is LocalCode.SETTINGS_INVALID
    assert "sasl_password_file" in unreadable.value.message and "ci" not in unreadable.value.message


def test_an_encrypted_client_key_is_opened_with_its_password(tmp_path: Path) -> None:
    _, cert, key = server_cert(tmp_path, password=b"key-secret")
    tls = {"security_protocol": "SSL", "ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    context = client_options(KafkaSettings(**tls, ssl_key_password="key-secret"))["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    with pytest.raises(ControlPlaneError) as wrong:
        client_options(KafkaSettings(**tls, ssl_key_password="not-it"))
    assert wrong.value.code is LocalCode.SETTINGS_INVALID
    assert str(key) in wrong.value.message and "not-it" not in wrong.value.message


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "OAUTHBEARER"},
            "needs sasl_oauth_token_provider",
        ),
        (
            {"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "PLAIN"}
            | {"SASL_USERNAME": "worker", "SASL_PASSWORD": "pw"},
            "in the clear",
        ),
        (
            {"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "SCRAM-SHA-512"}
            | {"SASL_USERNAME": "worker"},
            "needs sasl_password or sasl_password_file",
        ),
    ],
)
def test_a_worker_with_such_settings_exits_with_one_coded_line(
    env: dict[str, str], expected: str
) -> None:
    """Before: OAUTHBEARER without a provider got as far as aiokafka's bootstrap, which raised a
    ValueError its callers do not catch (a traceback)."""
    result = CliRunner().invoke(
        worker_app,
        ["run", "--runner", "fake", "--bootstrap", "127.0.0.1:1"],
        env={f"FLEET_WORKER_KAFKA__{k}": v for k, v in env.items()}
        | {"FLEET_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "1000"},
    )
    assert result.exit_code == EXIT_SETTINGS, result.output
    assert result.output.startswith("error: SETTINGS_INVALID: invalid settings: kafka: ")
    assert expected in result.output and result.output.count("\n") == 1, result.output
    assert "Traceback" not in result.output and "pw" not in result.output
