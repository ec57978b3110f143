"""What every `controlplane` command shares: the app, common options, exit codes, running a coroutine.

Entry point only: parses arguments, runs coroutines, maps our errors to exit codes and one
readable line on stderr. No business logic here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Annotated, Any, TypeVar

import typer

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import ControlPlaneError
from controlplane.wire.exits import APP_SETTINGS, CliExit, cli_exit, error_line, internal_line

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
