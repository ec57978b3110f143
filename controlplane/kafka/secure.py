"""What a secured local broker (``controlplane broker start --secure``) is made of: a CA, the
broker's certificate, the SCRAM users and their passwords, and the ACLs each user holds.

Everything lives in ``<data_dir>/secure/``, each file mode 0600, made once by
:func:`ensure_secure_files`:

- ``ca.pem``: the CA's certificate (what clients trust, ``ssl_cafile``). The CA's key is not
  kept: it signs the broker's certificate and is dropped, so nothing else can be issued.
- ``broker.pem``: the broker's key (unencrypted PKCS#8) then its certificate, Kafka's PEM
  keystore. Subject ``CN=broker`` (the principal ``User:CN=broker`` of the broker's own
  connections to its controller, a super user), SAN ``DNS:localhost`` and ``IP:127.0.0.1``
  and any host names asked for (clients check the host name), for server and client
  authentication.
- ``users.json``: a random password for each of :data:`PRINCIPALS`, and
  ``<user>.password``: the same, one file each (``sasl_password_file``).
- ``admin.properties``: the admin's client configuration for Kafka's own tools (AclCommand).

The broker (``node.py``) then listens with SASL_SSL (SCRAM-SHA-512) for clients and itself,
and with SSL requiring a client certificate on its controller listener; authorizes with
StandardAuthorizer, ``allow.everyone.if.no.acl.found=false``, super users admin and
``CN=broker``. The SCRAM users are written into the metadata when storage is formatted
(``--add-scram``); the passwords then appear in that one ``kafka.tools.StorageTool``
command line, visible to ``ps`` on this host for the second it runs.

The ACLs (:func:`acl_grants`), for a topic prefix ``P``:

- ``ci`` (publish, ``--wait``, ``status``): READ and WRITE ``P.commands``, READ ``P.acks``,
  READ and WRITE ``P.workers`` (the ``--wait`` follower writes probes there);
- ``worker``: READ ``P.commands`` and the groups PREFIXED ``P.worker.``; WRITE ``P.acks`` and
  ``P.workers``;
- ``coordinator``: READ every topic PREFIXED ``P.``; WRITE ``P.commands``, ``P.controller``,
  ``P.snapshots`` and ``P.workers``; CREATE ``P.snapshots``; READ the group ``P.controller``;
  the transactional id ``P.controller``;
- all three: IDEMPOTENT_WRITE on the cluster. ``admin`` (a super user) creates the topics.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BrokerError, LocalCode

#: The SCRAM users: ``admin`` is a super user (the broker's own inter-broker login, topics and
#: ACLs); the others get only their ACLs.
PRINCIPALS = ("admin", "coordinator", "ci", "worker")
MECHANISM = "SCRAM-SHA-512"
SECURE_DIR = "secure"
BROKER_CN = "broker"
#: Kafka's ACL tool (kafka-acls.sh), in the kafka-tools jar (controlplane/kafka/pom.xml).
ACL_COMMAND = "org.apache.kafka.tools.AclCommand"
#: Between the AclCommand argument lists of :data:`ACL_BATCH_SOURCE` (no topic, group or
#: principal name holds a ';').
ACL_BATCH_SEPARATOR = ";"
#: AclCommand once per argument list, in one JVM (Java's source launcher compiles it): about
#: a third of the time of a JVM per grant. AclCommand returns from ``main`` when it succeeds
#: and exits the JVM with status 1 when it fails.
ACL_BATCH_SOURCE = """\
public class AclBatch {
    public static void main(String[] args) throws Exception {
        java.util.List<String> one = new java.util.ArrayList<>();
        for (String arg : args) {
            if (!arg.equals(";")) {
                one.add(arg);
                continue;
            }
            org.apache.kafka.tools.AclCommand.main(one.toArray(new String[0]));
            one.clear();
        }
    }
}
"""
#: Certificates are valid this long (a local broker's lifetime, not a production CA's).
VALID_DAYS = 825

Key = ec.EllipticCurvePrivateKey


def make_ca(name: str = "fleet local Kafka CA") -> tuple[Key, x509.Certificate]:
    """A self-signed CA (P-256) that may sign end-entity certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_broker_cert(
    ca_key: Key, ca_cert: x509.Certificate, hosts: Sequence[str] = ()
) -> tuple[Key, x509.Certificate]:
    """The broker's key and certificate, signed by the CA: ``CN=broker``, SAN localhost,
    127.0.0.1 and ``hosts`` (DNS names, e.g. a compose service's), for TLS servers and clients
    (the broker is its controller's client)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
                    *map(x509.DNSName, hosts),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a file only its owner can read, created so (no moment at 0644)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    tmp.replace(path)


@dataclass(frozen=True)
class SecureFiles:
    """The files of one secured broker (``<data_dir>/secure``)."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def keystore(self) -> Path:
        return self.directory / "broker.pem"

    @property
    def users(self) -> Path:
        return self.directory / "users.json"

    @property
    def admin_properties(self) -> Path:
        return self.directory / "admin.properties"

    def password_file(self, principal: str) -> Path:
        return self.directory / f"{principal}.password"

    def files(self) -> Iterator[Path]:
        yield from (self.ca, self.keystore, self.users, self.admin_properties)
        yield from (self.password_file(p) for p in PRINCIPALS)

    def exists(self) -> bool:
        return all(path.exists() for path in self.files())

    def passwords(self) -> dict[str, str]:
        """Each principal's password; unreadable or incomplete files are SETTINGS_INVALID."""
        try:
            data = json.loads(self.users.read_text())
        except (OSError, ValueError) as exc:
            raise BrokerError(
                f"the broker's users file {self.users} is unreadable ({exc}); remove the data "
                "directory to make a new secured broker",
                code=LocalCode.SETTINGS_INVALID,
            ) from None
        if not isinstance(data, dict) or any(not isinstance(data.get(p), str) for p in PRINCIPALS):
            raise BrokerError(
                f"the broker's users file {self.users} lacks a password for one of "
                f"{', '.join(PRINCIPALS)}",
                code=LocalCode.SETTINGS_INVALID,
            )
        return {p: data[p] for p in PRINCIPALS}

    def settings(self, principal: str, bootstrap: str, **values: object) -> KafkaSettings:
        """How ``principal`` connects: SASL_SSL, SCRAM-SHA-512, trusting this broker's CA."""
        if principal not in PRINCIPALS:
            raise BrokerError(
                f"no Kafka user {principal!r}; the users are {', '.join(PRINCIPALS)}",
                code=LocalCode.SETTINGS_INVALID,
            )
        return KafkaSettings.model_validate(
            {
                "bootstrap_servers": bootstrap,
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": MECHANISM,
                "sasl_username": principal,
                "sasl_password": self.passwords()[principal],
                "ssl_cafile": str(self.ca),
                **values,
            }
        )

    def all_settings(self, bootstrap: str, **values: object) -> dict[str, KafkaSettings]:
        return {p: self.settings(p, bootstrap, **values) for p in PRINCIPALS}


def _write_certificates(files: SecureFiles, hosts: Sequence[str]) -> None:
    """A new CA and the broker's keystore, its SAN naming ``hosts`` too."""
    ca_key, ca_cert = make_ca()
    key, cert = make_broker_cert(ca_key, ca_cert, hosts)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_private(files.ca, _pem(ca_cert))
    write_private(files.keystore, key_pem + _pem(cert) + _pem(ca_cert))


def _names_lacking(files: SecureFiles, hosts: Sequence[str]) -> bool:
    """Whether the broker's certificate lacks one of ``hosts`` in its SAN; a keystore that holds
    no such certificate is SETTINGS_INVALID."""
    try:
        cert = x509.load_pem_x509_certificates(files.keystore.read_bytes())[0]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, IndexError, x509.ExtensionNotFound):
        raise BrokerError(
            f"{files.keystore} holds no broker certificate with host names: remove "
            f"{files.directory} to make new files (new passwords too)",
            code=LocalCode.SETTINGS_INVALID,
        ) from None
    return not set(hosts) <= set(san.get_values_for_type(x509.DNSName))


def ensure_secure_files(directory: Path, hosts: Sequence[str] = ()) -> SecureFiles:
    """Make the CA, the broker's keystore and the users' passwords in ``directory`` (mode 0700,
    every file 0600), unless all are there already.

    ``hosts``: host names clients reach the broker by, added to its certificate's SAN. When the
    files are there but the certificate lacks one of them, the CA and the certificate are made
    again (the CA's key is never kept, so a new CA signs; clients must trust the new
    ``ca.pem``); the users' passwords stay."""
    files = SecureFiles(directory)
    if files.exists():
        if hosts and _names_lacking(files, hosts):
            _write_certificates(files, hosts)
        return files
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    _write_certificates(files, hosts)
    # Hex: no character that Kafka's --add-scram syntax or a JAAS string would read.
    passwords = {p: secrets.token_hex(24) for p in PRINCIPALS}
    write_private(files.users, json.dumps(passwords, indent=2).encode() + b"\n")
    for principal, password in passwords.items():
        write_private(files.password_file(principal), password.encode() + b"\n")
    write_private(files.admin_properties, client_properties(files, "admin").encode())
    return files


def jaas(principal: str, password: str) -> str:
    return (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{principal}" password="{password}";'
    )


def client_properties(files: SecureFiles, principal: str) -> str:
    """A Java client's configuration (Kafka's tools' ``--command-config``) for ``principal``."""
    props = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": MECHANISM,
        "sasl.jaas.config": jaas(principal, files.passwords()[principal]),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(files.ca),
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def server_properties(files: SecureFiles) -> dict[str, str]:
    """The broker properties of security (listeners are the node's)."""
    return {
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": jaas(
            "admin", files.passwords()["admin"]
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(files.keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(files.ca),
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:admin;User:CN={BROKER_CN}",
    }


def scram_arguments(files: SecureFiles) -> list[str]:
    """``kafka.tools.StorageTool format`` arguments adding every user (KIP-900)."""
    out: list[str] = []
    for principal, password in files.passwords().items():
        out += ["--add-scram", f"{MECHANISM}=[name={principal},password={password}]"]
    return out


@dataclass(frozen=True)
class Grant:
    """One AclCommand call: every principal gets every operation on every resource."""

    principals: tuple[str, ...]
    operations: tuple[str, ...]
    #: (AclCommand's resource option, its name), e.g. ("--topic", "fleet.acks"); ("--cluster", "")
    resources: tuple[tuple[str, str], ...]
    prefixed: bool = False

    def arguments(self) -> list[str]:
        out: list[str] = []
        for principal in self.principals:
            out += ["--allow-principal", f"User:{principal}"]
        for operation in self.operations:
            out += ["--operation", operation]
        for option, name in self.resources:
            out += [option] if not name else [option, name]
        if self.prefixed:
            out += ["--resource-pattern-type", "prefixed"]
        return out


def acl_grants(prefix: str) -> list[Grant]:
    """The ACLs of ci, worker and coordinator on the topics of ``prefix`` (see the module)."""
    t = {name: ("--topic", f"{prefix}.{name}") for name in ("commands", "acks", "workers")}
    controller, snapshots = ("--topic", f"{prefix}.controller"), ("--topic", f"{prefix}.snapshots")
    return [
        Grant(("ci",), ("Read", "Write"), (t["commands"], t["workers"])),
        Grant(("ci",), ("Read",), (t["acks"],)),
        Grant(("worker",), ("Read",), (t["commands"],)),
        Grant(("worker",), ("Write",), (t["acks"], t["workers"])),
        Grant(("worker",), ("Read",), (("--group", f"{prefix}.worker."),), prefixed=True),
        Grant(("coordinator",), ("Read",), (("--topic", f"{prefix}."),), prefixed=True),
        Grant(
            ("coordinator",),
            ("Write",),
            (t["commands"], t["workers"], controller, snapshots),
        ),
        Grant(("coordinator",), ("Create",), (snapshots,)),
        Grant(("coordinator",), ("Read",), (("--group", f"{prefix}.controller"),)),
        Grant(("coordinator",), ("Write",), (("--transactional-id", f"{prefix}.controller"),)),
        Grant(("ci", "worker", "coordinator"), ("IdempotentWrite",), (("--cluster", ""),)),
    ]
