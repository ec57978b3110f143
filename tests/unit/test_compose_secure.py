"""compose.secure.yaml, merged onto compose.yaml as ``docker compose -f compose.yaml -f
compose.secure.yaml`` does, agrees with the secured local broker (controlplane/kafka/secure.py,
node.py) and with the code: each service's Kafka user, no PLAINTEXT listener, password files
and never passwords, the API token still required, the init steps in order.

No Docker: the files are parsed with PyYAML; the kafka service's KAFKA_* environment is turned
into properties by the rules of the apache/kafka image (:func:`image_properties`); the secrets
command is run for real in a temporary directory.
"""

from __future__ import annotations

import re
import shlex
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from typer.testing import CliRunner

from controlplane.cli.admin import ACL_SCRIPT, JAAS_FILE
from controlplane.cli.common import app as controlplane_app
from controlplane.coordinator.service import CoordinatorSettings
from controlplane.kafka.secure import (
    MECHANISM,
    PRINCIPALS,
    SecureFiles,
    acl_grants,
    ensure_secure_files,
    jaas,
    server_properties,
)
from controlplane.kafka.settings import KafkaSettings
from tests.unit.test_compose import (
    COMPOSE,
    DOCKERFILE,
    ROOT,
    UP_ENV,
    ComposeRefused,
    command,
    environment,
    listeners,
    settings_from,
)
from workers.agent.settings import WorkerSettings

SECURE = ROOT / "compose.secure.yaml"

#: Each Kafka client service and the Kafka user it connects as.
USERS = {
    "topics": "admin",
    "coordinator": "coordinator",
    "worker-1": "worker",
    "worker-2": "worker",
    "ci": "ci",
}
#: Sequences docker compose replaces in an override rather than merging.
REPLACED = {"command", "entrypoint", "test", "profiles"}


# --------------------------------------------------------------------------- compose's merge


def _merge_list(key: str, base: list[Any], over: list[Any]) -> list[Any]:
    if key == "volumes":  # merged by the container path
        merged = {str(v).split(":")[1]: v for v in base}
        merged |= {str(v).split(":")[1]: v for v in over}
        return list(merged.values())
    return [*base, *(v for v in over if v not in base)]


def merge(base: Any, over: Any, key: str = "") -> Any:
    """An override merged onto ``base`` by compose's rules for what these files use: mappings
    merge key by key, ``volumes`` by container path, ``command``, ``entrypoint`` and a
    healthcheck's ``test`` are replaced, other lists are appended to."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in REPLACED:
        return _merge_list(key, base, over)
    return over


@pytest.fixture(scope="module")
def override() -> dict[str, Any]:
    data = yaml.safe_load(SECURE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def merged(override: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = merge(yaml.safe_load(COMPOSE.read_text()), override)
    return result


@pytest.fixture(scope="module")
def services(merged: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = merged["services"]
    return found


# --------------------------------------------------------------------------- the image's rules


def convert_key(name: str) -> str:
    """The apache/kafka image's env-to-property name (docker/resources/utility: ConvertKey):
    ``_`` -> ``.``, ``__`` -> ``_``, ``___`` -> ``-``, lower case."""
    single = re.sub(r"[^_]_[^_]", lambda m: m.group(0).replace("_", "."), name)
    return single.replace("___", "-").replace("__", "_").lower()


#: KAFKA_* variables the image does not turn into properties (kafka-propertiesSpec.json).
IMAGE_EXCLUDES = {
    "KAFKA_VERSION",
    "KAFKA_HEAP_OPT",
    "KAFKA_LOG4J_OPTS",
    "KAFKA_OPTS",
    "KAFKA_JMX_OPTS",
    "KAFKA_JVM_PERFORMANCE_OPTS",
    "KAFKA_GC_LOG_OPTS",
    "KAFKA_LOG4J_ROOT_LOGLEVEL",
    "KAFKA_LOG4J_LOGGERS",
    "KAFKA_TOOLS_LOG4J_LOGLEVEL",
}


def image_properties(env: Mapping[str, str]) -> dict[str, str]:
    """server.properties as the image renders it from the environment: every KAFKA_* but the
    excluded, and (its ListToMap) none whose value holds a '='."""
    return {
        convert_key(k.removeprefix("KAFKA_")): v
        for k, v in env.items()
        if k.startswith("KAFKA_") and k not in IMAGE_EXCLUDES and "=" not in v
    }


def script(service: Mapping[str, Any]) -> str:
    """The shell script of a service run as ``[shell, -...c, SCRIPT]``, with compose's ``$$``."""
    argv = command(service)
    assert service["entrypoint"][-1].endswith("c") and len(argv) == 1, argv
    return argv[0].replace("$$", "$")


def kafka_file_input(service: Mapping[str, Any]) -> dict[str, str]:
    """What the kafka service writes to the image's file input, /mnt/shared/config."""
    found = re.findall(r"echo '([^']*)' > /mnt/shared/config/server.properties", script(service))
    return dict(line.split("=", 1) for line in found)


# --------------------------------------------------------------------------- tests


def test_the_override_names_only_services_of_compose_yaml_or_its_own(
    override: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(base) <= set(services)
    assert set(override["services"]) - set(base) == {"kafka-secrets", "kafka-acls", "ci"}
    assert services["kafka"]["image"] == base["kafka"]["image"] == "apache/kafka:4.1.1"
    assert services["kafka-acls"]["image"] == base["kafka"]["image"]
    # The tools service is run on demand, not by `up`; its command is our CLI's.
    ci = services["ci"]
    assert ci["profiles"] == ["tools"] and ci["entrypoint"] == ["controlplane"]
    result = CliRunner().invoke(controlplane_app, [*command(ci), "--help"])
    assert result.exit_code == 0, result.output


def test_no_listener_a_client_reaches_is_plaintext(services: dict[str, dict[str, Any]]) -> None:
    env = environment(services["kafka"])
    protocols = dict(
        item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    bound = listeners(env["KAFKA_LISTENERS"])
    advertised = listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    assert set(bound) == set(protocols) and controller not in advertised
    for name in bound:
        expected = "SSL" if name == controller else "SASL_SSL"
        assert protocols[name] == expected, name
    # Every published port is a SASL_SSL listener; so is every advertised one.
    published = {int(str(p).rsplit(":", 1)[-1]) for p in services["kafka"]["ports"]}
    by_port = {port: name for name, (_, port) in bound.items()}
    assert published and all(protocols[by_port[p]] == "SASL_SSL" for p in published)
    assert all(protocols[name] == "SASL_SSL" for name in advertised)
    assert protocols[env["KAFKA_INTER_BROKER_LISTENER_NAME"]] == "SASL_SSL"
    # The image's start demands JKS password files for an advertised SSL:// or SASL_SSL://
    # listener (a PEM keystore with an unencrypted key has none): the names avoid both.
    assert "SSL://" not in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "SASL_" not in env["KAFKA_ADVERTISED_LISTENERS"]


def test_the_broker_has_the_security_of_broker_start_secure(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """node.py's secure server properties, with the paths of the kafka-secrets volume: each is
    rendered by the image from KAFKA_*, or (a value holding '=') comes through the JAAS file or
    the image's file input."""
    kafka = services["kafka"]
    env = environment(kafka)
    files = ensure_secure_files(tmp_path / "secure")
    expected = {
        k: v.replace(str(files.directory), "/secure") for k, v in server_properties(files).items()
    }
    jaas_key = f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config"
    expected.pop(jaas_key)
    rendered = image_properties(env) | kafka_file_input(kafka)
    assert {k: rendered.get(k) for k in expected} == expected
    # The broker's own SCRAM login (admin) is a JAAS file `broker secure-files` writes.
    assert env["KAFKA_OPTS"] == f"-Djava.security.auth.login.config=/secure/{JAAS_FILE}"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in kafka["volumes"]}
    assert mounts["/secure"] == "kafka-secrets"
    assert mounts["/var/lib/kafka/data"] == "kafka-data-secure", "not the plaintext broker's"
    # Healthy means it answers admin over SASL_SSL.
    probe = kafka["healthcheck"]["test"]
    assert probe[probe.index("--command-config") + 1] == "/secure/admin.properties"


def test_storage_is_formatted_with_every_scram_user_before_the_image_starts(
    services: dict[str, dict[str, Any]],
) -> None:
    text = script(services["kafka"])
    format_at = text.index("kafka-storage.sh format")
    assert text.index("/etc/kafka/docker/configure") < format_at
    assert text.rstrip().endswith("exec /etc/kafka/docker/run")
    scram = re.search(r'scram\(\) \{ echo "([^"]+)"; \}', text)
    assert scram is not None
    assert scram.group(1) == f"{MECHANISM}=[name=$1,password=$(cat /secure/$1.password)]"
    users = re.findall(r'--add-scram "\$\(scram (\w+)\)"', text)
    assert sorted(users) == sorted(PRINCIPALS)
    assert "if [ ! -e /var/lib/kafka/data/meta.properties ]; then" in text


def test_each_client_connects_as_its_own_user_with_a_password_file(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = command_secrets(services)
    for name, user in USERS.items():
        service = services[name]
        kafka = kafka_settings_of(name, environment(service), monkeypatch)
        assert kafka.security_protocol == "SASL_SSL", name
        assert kafka.sasl_mechanism == MECHANISM, name
        assert kafka.sasl_username == user, name
        assert kafka.sasl_password is None and kafka.sasl_password_file is not None, name
        assert kafka.sasl_password_file.name == f"{user}.password", name
        assert kafka.ssl_cafile is not None
        # Both files are in a volume holding only this user's (the secrets service fills it).
        mounts = {str(v).split(":")[1]: str(v) for v in service["volumes"]}
        directory = str(kafka.sasl_password_file.parent)
        assert Path(kafka.ssl_cafile).parent == kafka.sasl_password_file.parent, name
        assert mounts[directory].endswith(":ro"), name
        volume = mounts[directory].split(":")[0]
        assert secrets[volume] == user, (name, volume)
    for name, service in services.items():
        for key in environment(service):
            assert not key.endswith(("SASL_PASSWORD", "API_TOKEN_FILE")), (name, key)


def test_the_cli_in_the_coordinator_container_connects_as_the_coordinator(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``docker compose exec coordinator controlplane ...``: the CLI's own variables in that
    container reach the same broker, on the same topics, with the same user and files as the
    coordinator (compose.yaml sets its bootstrap; this override its security)."""
    env = environment(services["coordinator"])
    cli = kafka_settings_of("cli", env, monkeypatch)
    own = kafka_settings_of("coordinator", env, monkeypatch)
    fields = ("bootstrap_servers", "topic_prefix", "security_protocol", "sasl_mechanism",
              "sasl_username", "sasl_password_file", "ssl_cafile")  # fmt: skip
    assert {f: getattr(cli, f) for f in fields} == {f: getattr(own, f) for f in fields}
    assert cli.security_protocol == "SASL_SSL" and cli.sasl_username == USERS["coordinator"]


def kafka_settings_of(
    name: str, env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch
) -> KafkaSettings:
    """The Kafka settings service ``name`` gets from ``env``, read by its own settings class:
    the coordinator's, a worker's, or the CLI's (``FLEET_KAFKA__*``, controlplane/cli/common.py,
    and ``FLEET_KAFKA_BOOTSTRAP`` / a ``--bootstrap`` in its command)."""
    if name == "coordinator":
        found: KafkaSettings = settings_from(monkeypatch, env, CoordinatorSettings).kafka
        return found
    if name.startswith("worker-"):
        found = settings_from(monkeypatch, env, WorkerSettings).kafka
        return found
    values = {
        k.removeprefix("FLEET_KAFKA__").lower(): v
        for k, v in env.items()
        if k.startswith("FLEET_KAFKA__")
    }
    if "FLEET_KAFKA_BOOTSTRAP" in env:
        values["bootstrap_servers"] = env["FLEET_KAFKA_BOOTSTRAP"]
    if "FLEET_TOPIC_PREFIX" in env:
        values["topic_prefix"] = env["FLEET_TOPIC_PREFIX"]
    return KafkaSettings.model_validate(values)


def command_secrets(services: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each per-user volume the kafka-secrets service fills, and the user whose it is."""
    init = services["kafka-secrets"]
    text = script(init)
    (users,) = re.findall(r"for user in ([\w ]+); do", text)
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in init["volumes"]}
    assert (
        "install -o 10001 -g 10001 -m 0600 /secure/ca.pem /secure/$user.password /users/$user/"
        in text
    )
    return {mounts[f"/users/{u}"]: u for u in users.split()}


def test_the_secrets_service_runs_our_command_and_hands_out_files_by_owner(
    services: dict[str, dict[str, Any]],
) -> None:
    init = services["kafka-secrets"]
    text = script(init)
    (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("controlplane ")]
    argv = shlex.split(line)
    result = CliRunner().invoke(controlplane_app, [*argv[1:], "--help"])
    assert result.exit_code == 0, result.output
    assert argv[1:4] == ["broker", "secure-files", "/secure"]
    assert argv[argv.index("--host") + 1] == "kafka"  # the host name clients use
    assert sorted(command_secrets(services).values()) == sorted(PRINCIPALS)
    # The kafka image's user owns the broker's files; the fleet image's user each user's copy.
    (kafka_uid,) = re.findall(r"chown -R (\d+):\d+ /secure", text)
    assert services["kafka"]["user"].split(":")[0] == kafka_uid
    assert services["kafka-acls"]["user"].split(":")[0] == kafka_uid
    assert re.search(r"useradd .*--uid 10001 fleet", DOCKERFILE.read_text())
    assert init["user"].split(":")[0] == "0"


def test_init_steps_run_in_order(services: dict[str, dict[str, Any]]) -> None:
    def waits(name: str, on: str) -> str:
        condition: str = services[name]["depends_on"][on]["condition"]
        return condition

    assert waits("kafka", "kafka-secrets") == "service_completed_successfully"
    assert waits("kafka-acls", "kafka") == "service_healthy"
    for name in ("coordinator", "worker-1", "worker-2", "ci"):
        assert waits(name, "kafka-acls") == "service_completed_successfully", name
    acls = services["kafka-acls"]
    assert command(acls) == [f"/secure/{ACL_SCRIPT}", "kafka:19092", "/opt/kafka/bin/kafka-acls.sh"]
    assert any(str(v).startswith("kafka-secrets:/secure") for v in acls["volumes"])


def test_the_api_token_is_still_required(services: dict[str, dict[str, Any]]) -> None:
    with pytest.raises(ComposeRefused, match="FLEET_COORDINATOR_API_TOKEN"):
        environment(services["coordinator"], {})
    assert environment(services["coordinator"], UP_ENV)["FLEET_COORDINATOR_API_TOKEN"]


def test_no_secret_is_written_in_the_files() -> None:
    """Passwords are made at the first `up` (48 hex digits): none is in either file."""
    for path in (COMPOSE, SECURE):
        text = path.read_text()
        assert not re.search(r"[0-9a-f]{32}", text), path
        assert not re.search(r"(?i)password\s*[:=]\s*\w", text.replace("password_file", "")), path


# --------------------------------------------------------------------------- broker secure-files


def test_secure_files_makes_a_broker_certificate_for_the_service_name(tmp_path: Path) -> None:
    directory = tmp_path / "secure"
    runner = CliRunner()
    args = ["broker", "secure-files", str(directory), "--host", "kafka", "--topic-prefix", "px"]
    first = runner.invoke(controlplane_app, args)
    assert first.exit_code == 0, first.output
    files = SecureFiles(directory)
    for path in (*files.files(), directory / JAAS_FILE, directory / ACL_SCRIPT):
        assert f": {path}" in first.output, path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    chain = x509.load_pem_x509_certificates(files.keystore.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert = chain[0]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"kafka", "localhost"} <= set(san.get_values_for_type(x509.DNSName))
    cert.verify_directly_issued_by(ca)
    assert chain[-1] == ca  # the keystore's chain ends in the CA clients trust
    passwords = files.passwords()
    assert (directory / JAAS_FILE).read_text() == (
        f"KafkaServer {{\n  {jaas('admin', passwords['admin'])}\n}};\n"
    )
    lines = [ln for ln in (directory / ACL_SCRIPT).read_text().splitlines() if "--add" in ln]
    grants = acl_grants("px")
    assert len(lines) == len(grants)
    for line, grant in zip(lines, grants, strict=True):
        argv = shlex.split(line)
        assert argv[argv.index("--add") + 1 :] == grant.arguments()
        assert argv[argv.index("--command-config") + 1] == str(files.admin_properties)
    # Again: nothing changes (the volume outlives `down`; the broker's users are formatted).
    again = runner.invoke(controlplane_app, args)
    assert again.exit_code == 0, again.output
    assert files.passwords() == passwords
    assert x509.load_pem_x509_certificates(files.keystore.read_bytes())[0] == cert


def test_secure_files_in_a_directory_it_cannot_write_is_one_coded_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(controlplane_app, ["broker", "secure-files", str(blocker / "x")])
    assert result.exit_code != 0
    assert "SETTINGS_INVALID" in result.output and "Traceback" not in result.output
