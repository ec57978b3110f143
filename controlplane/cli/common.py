"""What every `controlplane` command shares: the app, common options, exit codes, running a coroutine.

Entry point only: parses arguments, runs coroutines, maps our errors to exit codes and one
readable line on stderr. No business logic here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from enum import IntEnum
from typing import Annotated, Any, TypeVar

import typer

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, ControlPlaneError, ErrorCode

T = TypeVar("T")


class Exit(IntEnum):
    """Process exit codes, stable for CI."""

    OK = 0
    FAILED = 1
    TIMED_OUT = 2
    INVALID = 3
    UNREACHABLE = 4  # Kafka unreachable; a publish that fails so was certainly not published
    INTERNAL = 5
    UNKNOWN = 6  # a publish not confirmed in time: it may be in the log (check status)


app = typer.Typer(
    name="controlplane",
    help="Kafka-driven control plane for model-serving fleets.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
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


def fail(error: ControlPlaneError) -> typer.Exit:
    """Print one readable error line and pick the exit code for its class."""
    typer.echo(f"error: {error.code}: {error.message}", err=True)
    if isinstance(error, BusError) and error.code is ErrorCode.BROKER_UNAVAILABLE:
        return typer.Exit(Exit.UNREACHABLE)
    if error.code is ErrorCode.PUBLISH_OUTCOME_UNKNOWN:
        return typer.Exit(Exit.UNKNOWN)
    if error.code in (
        ErrorCode.SCHEMA_INVALID,
        ErrorCode.PATH_NOT_ALLOWED,
        ErrorCode.NO_MATCHING_WORKERS,
        ErrorCode.TTL_TOO_LONG,
        ErrorCode.ROLLOUT_EXISTS,
        ErrorCode.SETTINGS_INVALID,
    ):
        return typer.Exit(Exit.INVALID)
    return typer.Exit(Exit.FAILED)


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
        typer.echo(f"error: {ErrorCode.INTERNAL}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(Exit.INTERNAL) from None


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
