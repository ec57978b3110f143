"""Why a secured connection failed, as a code: an ACL's refusal, a refused password, an untrusted
certificate. The TLS cases run a real TLS handshake against a local server (no Kafka needed to
fail a handshake); the broker's own refusals are tested in tests/integration/test_kafka_secure_errors.py."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnknownTopicOrPartitionError,
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from controlplane.kafka.client import translate
from controlplane.kafka.diagnose import classify, diagnose
from controlplane.kafka.producer import Producer
from controlplane.kafka.secure import make_broker_cert, make_ca
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode


def write_pem(
    directory: Path,
    name: str,
    key: ec.EllipticCurvePrivateKey,
    cert: x509.Certificate,
    *,
    password: bytes | None = None,
) -> tuple[Path, Path]:
    """``<name>.pem`` and ``<name>.key`` (PKCS#8, encrypted with ``password`` if given)."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.NoEncryption()
        if password is None
        else serialization.BestAvailableEncryption(password)
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    return cert_path, key_path


def server_cert(directory: Path, *, password: bytes | None = None) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signed for localhost / 127.0.0.1 (the secured broker's kind):
    the CA's file, the certificate's and its key's."""
    ca_key, ca = make_ca("a test server's CA")
    key, cert = make_broker_cert(ca_key, ca)
    ca_pem, _ = write_pem(directory, "server-ca", ca_key, ca)
    return ca_pem, *write_pem(directory, "server", key, cert, password=password)


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[int, Path]]:
    """A TLS server on 127.0.0.1 with a certificate its own CA signed: (port, that CA's file).
    It completes handshakes and closes; it speaks no Kafka."""
    ca_pem, cert_pem, key_pem = server_cert(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_pem, key_pem)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield port, ca_pem


@pytest.fixture
def other_ca(tmp_path: Path) -> Path:
    """A CA that signed nothing the server holds."""
    key, cert = make_ca("a stranger's CA")
    return write_pem(tmp_path, "other-ca", key, cert)[0]


def tls_settings(port: int, cafile: Path, **values: object) -> KafkaSettings:
    return KafkaSettings.model_validate(
        {
            "bootstrap_servers": f"127.0.0.1:{port}",
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "worker",
            "sasl_password": "a-password",
            "ssl_cafile": str(cafile),
            "request_timeout_ms": 2000,
        }
        | values
    )


async def test_an_untrusted_broker_certificate_is_kafka_tls_untrusted(
    tls_server: tuple[int, Path], other_ca: Path
) -> None:
    port, _ = tls_server
    found = await diagnose(tls_settings(port, other_ca))
    assert found is not None and found.code is LocalCode.KAFKA_TLS_UNTRUSTED, found
    assert "certificate is not trusted" in found.message and "ssl_cafile" in found.message


async def test_a_trusted_handshake_is_no_tls_diagnosis(tls_server: tuple[int, Path]) -> None:
    """The server is trusted and then closes: plain unreachability, nothing to add."""
    port, ca = tls_server
    assert await diagnose(tls_settings(port, ca)) is None


async def test_a_client_start_against_an_untrusted_certificate_says_so(
    tls_server: tuple[int, Path], other_ca: Path
) -> None:
    """Before: aiokafka's bootstrap logged the handshake's error and raised "Unable to
    bootstrap": BROKER_UNAVAILABLE, the cause nowhere but in a log line."""
    port, _ = tls_server
    producer = Producer(tls_settings(port, other_ca))
    with pytest.raises(BusError) as failed:
        async with producer:
            pass
    assert failed.value.code is LocalCode.KAFKA_TLS_UNTRUSTED, failed.value
    assert "a-password" not in failed.value.message


async def test_nothing_listening_stays_broker_unavailable(other_ca: Path) -> None:
    producer = Producer(tls_settings(1, other_ca))
    with pytest.raises(BusError) as failed:
        await producer.start()
    await producer.stop()
    assert failed.value.code is LocalCode.BROKER_UNAVAILABLE, failed.value


@pytest.mark.parametrize(
    ("error", "resource"),
    [
        (TopicAuthorizationFailedError("fleet.commands"), "topic fleet.commands"),
        (GroupAuthorizationFailedError("fleet.controller"), "consumer group fleet.controller"),
        (TransactionalIdAuthorizationFailed("fleet.controller"), "transactional id"),
        (ClusterAuthorizationFailedError(), "on a cluster operation;"),
        (TopicAuthorizationFailedError({"sec.commands", "sec.acks"}), "sec.acks, sec.commands;"),
    ],
)
def test_an_acl_refusal_is_kafka_access_denied(error: Exception, resource: str) -> None:
    """Before: KAFKA_ERROR with aiokafka's class name, no word of ACLs."""
    with pytest.raises(BusError) as denied, translate("publishing to fleet.commands"):
        raise error
    assert denied.value.code is LocalCode.KAFKA_ACCESS_DENIED
    message = denied.value.message
    assert message.startswith("publishing to fleet.commands: access denied to this client on ")
    assert resource in message and "ACLs" in message


def test_a_refused_password_names_the_user_never_the_password() -> None:
    refused = classify(
        SaslAuthenticationFailed("Authentication failed: invalid credentials"),
        "connecting",
        principal="worker",
    )
    assert refused is not None and refused.code is LocalCode.KAFKA_AUTH_FAILED
    assert refused.message == (
        "connecting: the broker refused user 'worker': Authentication failed: invalid "
        "credentials; check sasl_username and sasl_password (or sasl_password_file)"
    )


@pytest.mark.parametrize(
    "error",
    [KafkaConnectionError("Unable to bootstrap"), UnknownTopicOrPartitionError(), OSError(111)],
)
def test_other_failures_are_not_classified(error: Exception) -> None:
    assert classify(error, "connecting") is None
