"""The secured broker's files (controlplane/kafka/secure.py): a CA and a broker certificate it
signed for localhost and 127.0.0.1, the users' passwords, each file readable by its owner only,
the settings of each user, and the ACL grants (no JVM, no broker)."""

from __future__ import annotations

import ipaddress
import json
import os
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from controlplane.kafka.secure import (
    PRINCIPALS,
    SecureFiles,
    acl_grants,
    ensure_secure_files,
    scram_arguments,
)
from controlplane.wire.errors import BrokerError, LocalCode


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SecureFiles:
    return ensure_secure_files(tmp_path_factory.mktemp("broker") / "secure")


def _certs(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def test_broker_certificate_is_signed_by_the_ca(files: SecureFiles) -> None:
    [ca] = _certs(files.ca)
    leaf, chained_ca = _certs(files.keystore)
    assert chained_ca == ca
    leaf.verify_directly_issued_by(ca)  # raises unless ca's key signed it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # And an OpenSSL context trusting only ca.pem accepts the keystore as a TLS server's.
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files.keystore)
    client = ssl.create_default_context(cafile=str(files.ca))
    assert client.get_ca_certs()[0]["subject"] == ((("commonName", "fleet local Kafka CA"),),)


def test_broker_certificate_names_localhost_and_the_loopback_address(files: SecureFiles) -> None:
    leaf = _certs(files.keystore)[0]
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.IPv4Address("127.0.0.1")]
    assert leaf.subject.rfc4514_string() == "CN=broker"  # the super user User:CN=broker
    usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_key_is_unencrypted_pkcs8_matching_the_certificate(files: SecureFiles) -> None:
    pem = files.keystore.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, as Kafka's PEM keystore
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key() == _certs(files.keystore)[0].public_key()


def test_every_file_is_readable_by_its_owner_only(files: SecureFiles) -> None:
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700
    made = sorted(files.directory.iterdir())
    assert made == sorted(files.files())
    for path in made:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_passwords_are_random_per_user_and_made_once(files: SecureFiles) -> None:
    passwords = files.passwords()
    assert set(passwords) == set(PRINCIPALS)
    assert len(set(passwords.values())) == len(PRINCIPALS)
    assert all(len(p) >= 32 for p in passwords.values())
    for principal, password in passwords.items():
        assert files.password_file(principal).read_text() == password + "\n"
    assert ensure_secure_files(files.directory).passwords() == passwords  # not made again
    assert "password=" + passwords["ci"] + "]" in " ".join(scram_arguments(files))


def test_settings_per_user(files: SecureFiles) -> None:
    ci = files.settings("ci", "127.0.0.1:9093", topic_prefix="p")
    assert (ci.security_protocol, ci.sasl_mechanism, ci.sasl_username) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        "ci",
    )
    assert ci.sasl_password is not None
    assert ci.sasl_password.get_secret_value() == files.passwords()["ci"]
    assert ci.ssl_cafile == str(files.ca) and ci.topic_prefix == "p"
    with pytest.raises(BrokerError) as info:
        files.settings("root", "127.0.0.1:9093")
    assert info.value.code is LocalCode.SETTINGS_INVALID


def test_a_damaged_users_file_is_settings_invalid(tmp_path: Path) -> None:
    made = ensure_secure_files(tmp_path / "secure")
    made.users.write_text(json.dumps({"admin": "x"}))
    with pytest.raises(BrokerError) as info:
        made.passwords()
    assert info.value.code is LocalCode.SETTINGS_INVALID


def test_extra_hosts_join_the_san_once_and_the_passwords_survive(tmp_path: Path) -> None:
    """A directory whose certificate lacks a host asked for gets a new CA and certificate that
    names it (`broker secure-files --host kafka`); the passwords stay; asking again changes
    nothing."""
    made = ensure_secure_files(tmp_path / "secure")
    passwords = made.passwords()
    [old_ca] = _certs(made.ca)
    files = ensure_secure_files(made.directory, hosts=("kafka",))
    [ca] = _certs(files.ca)
    leaf, chained_ca = _certs(files.keystore)
    assert ca != old_ca and chained_ca == ca  # the CA's key was not kept: a new CA signed
    leaf.verify_directly_issued_by(ca)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "kafka"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.IPv4Address("127.0.0.1")]
    assert files.passwords() == passwords
    for principal, password in passwords.items():
        assert files.password_file(principal).read_text() == password + "\n"
    for path in files.files():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    before = {path: path.read_bytes() for path in files.files()}
    ensure_secure_files(files.directory, hosts=("kafka",))
    ensure_secure_files(files.directory, hosts=("localhost",))
    assert {path: path.read_bytes() for path in files.files()} == before
    # A new directory names the hosts at once.
    fresh = ensure_secure_files(tmp_path / "fresh", hosts=("kafka", "broker.internal"))
    fresh_san = _certs(fresh.keystore)[0].extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert fresh_san.value.get_values_for_type(x509.DNSName) == [
        "localhost",
        "kafka",
        "broker.internal",
    ]


def test_acl_grants_give_no_one_writes_on_commands_but_ci_and_the_coordinator() -> None:
    writers = set()
    for grant in acl_grants("p"):
        args = grant.arguments()
        if "Write" in grant.operations and ("--topic", "p.commands") in grant.resources:
            writers |= set(grant.principals)
        if grant.prefixed:
            assert args[-2:] == ["--resource-pattern-type", "prefixed"]
    assert writers == {"ci", "coordinator"}


def test_broker_start_secure_prints_environments_the_processes_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`broker start --secure`'s lines, as the environment of a worker and of a coordinator,
    give each its user, password file and CA (no password printed)."""
    from controlplane.cli.admin import secure_env_lines
    from controlplane.coordinator.service import CoordinatorSettings
    from controlplane.kafka.broker import BrokerConfig, LocalBroker
    from workers.agent.settings import WorkerSettings

    broker = LocalBroker(BrokerConfig(port=29092, data_dir=tmp_path, secure=True))
    files = ensure_secure_files(broker.secure_files.directory)
    lines = secure_env_lines(broker, "prod")
    assert not any(password in "\n".join(lines) for password in files.passwords().values())
    for line in lines:
        if not line.startswith("#"):
            name, _, value = line.partition("=")
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLEET_WORKER_WORKER_ID", "w1")
    worker = WorkerSettings().kafka
    coordinator = CoordinatorSettings().kafka
    for principal, kafka in (("worker", worker), ("coordinator", coordinator)):
        assert kafka.bootstrap_servers == "127.0.0.1:29092" and kafka.topic_prefix == "prod"
        assert (kafka.security_protocol, kafka.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
        assert kafka.sasl_username == principal and kafka.ssl_cafile == str(files.ca)
        assert kafka.sasl_secret() == files.passwords()[principal]
    # ci's lines are the CLI's: its flags' variables, and FLEET_KAFKA__* for the rest.
    from controlplane.cli.common import kafka_settings

    cli = kafka_settings(os.environ["FLEET_KAFKA_BOOTSTRAP"], os.environ["FLEET_TOPIC_PREFIX"])
    assert cli.bootstrap_servers == "127.0.0.1:29092" and cli.topic_prefix == "prod"
    assert (cli.security_protocol, cli.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert cli.sasl_username == "ci" and cli.ssl_cafile == str(files.ca)
    assert cli.sasl_secret() == files.passwords()["ci"]


def test_the_clis_kafka_settings_refuse_bad_environment_with_one_coded_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import typer

    from controlplane.cli.common import kafka_settings

    monkeypatch.setenv("FLEET_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("FLEET_KAFKA__SASL_MECHANISM", "SCRAM-SHA-512")  # and no credentials
    with pytest.raises(typer.Exit) as caught:
        kafka_settings("127.0.0.1:1", "p")
    assert caught.value.exit_code != 0
    err = capsys.readouterr().err
    assert "invalid settings" in err and "Traceback" not in err


def test_a_damaged_keystore_asked_for_more_hosts_is_settings_invalid(tmp_path: Path) -> None:
    files = ensure_secure_files(tmp_path / "secure")
    files.keystore.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a certificate\n")
    with pytest.raises(BrokerError) as caught:
        ensure_secure_files(files.directory, ("kafka",))
    assert caught.value.code is LocalCode.SETTINGS_INVALID
    assert str(files.directory) in caught.value.message
