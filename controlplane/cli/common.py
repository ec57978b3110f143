"""What every `controlplane` command shares: the app, common options, exit codes, running a coroutine.

Entry point only: parses arguments, runs coroutines, maps our errors to exit codes and one
readable line on stderr. No business logic here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.kafka.settings import KafkaSettings, load_settings
from controlplane.wire.errors import ControlPlaneError
from controlplane.wire.exits import APP_SETTINGS, CliExit, cli_exit, error_line, internal_line
from controlplane.wire.signing import Verifier, read_trust_store

T = TypeVar("T")

#: The exit codes (controlplane.wire.exits), under the name the commands know them by.
Exit = CliExit

app = typer.Typer(
    name="controlplane", help="Kafka-driven control plane for model-serving fleets.", **APP_SETTINGS
)

BootstrapOpt = Annotated[
    str,
    typer.Option(
        "--bootstrap", "-b", envvar="FLEET_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers."
    ),
]
PrefixOpt = Annotated[
    str, typer.Option("--topic-prefix", envvar="FLEET_TOPIC_PREFIX", help="Topic name prefix.")
]
ApiOpt = Annotated[
    str | None,
    typer.Option(
        "--api",
        envvar="FLEET_API_URL",
        help="A coordinator's URL (e.g. http://coordinator:8080): ask it instead of reading the log.",
    ),
]
TrustStoreOpt = Annotated[
    Path | None,
    typer.Option(
        "--trust-store",
        envvar="FLEET_TRUST_STORE",
        help="Read the log as the workers do: fold only the commands this trust store verifies "
        "(JSON, as `controlplane keys generate` prints); the others are shown unverified.",
    ),
]


def verifier_from(path: Path | None) -> Verifier | None:
    """The verifier of the trust store that ``--trust-store`` names (None without one); a
    store that cannot be read or is invalid ends the command (SETTINGS_INVALID, exit 3)."""
    if path is None:
        return None
    try:
        return Verifier(read_trust_store(path))
    except ControlPlaneError as exc:
        raise fail(exc) from None


def fail(error: ControlPlaneError) -> typer.Exit:
    """Print one readable error line; the exit code for its code (``CLI_EXITS``)."""
    typer.echo(error_line(error), err=True)
    return typer.Exit(cli_exit(error))


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
        typer.echo(internal_line(exc), err=True)
        raise typer.Exit(CliExit.INTERNAL) from None


class _ClientEnv(BaseSettings):
    """The CLI's Kafka client settings beyond its flags: TLS, SASL credentials, timeouts, from
    ``FLEET_KAFKA__*`` (e.g. ``FLEET_KAFKA__SECURITY_PROTOCOL=SASL_SSL``: the lines `broker
    start --secure` prints for ci)."""

    model_config = SettingsConfigDict(
        env_prefix="FLEET_", env_nested_delimiter="__", extra="ignore"
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)


def kafka_settings(
    bootstrap: str,
    prefix: str,
    *,
    delivery_timeout_s: float | None = None,
    **overrides: Any,
) -> KafkaSettings:
    """The CLI's Kafka settings: ``FLEET_KAFKA__*`` from the environment, then the flags
    (``--bootstrap`` and ``--topic-prefix`` always win); ``delivery_timeout_s`` (at least 1 s)
    bounds each publish. Invalid settings end the command with one coded line."""
    values: dict[str, Any] = {"bootstrap_servers": bootstrap, "topic_prefix": prefix}
    if delivery_timeout_s is not None:
        values["delivery_timeout_ms"] = round(delivery_timeout_s * 1000)
    try:
        env = load_settings(_ClientEnv).kafka
        return load_settings(
            KafkaSettings, **{**env.model_dump(exclude_unset=True), **values, **overrides}
        )
    except ControlPlaneError as exc:
        raise fail(exc) from None
