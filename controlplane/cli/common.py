"""What every `controlplane` command shares: the app, common options, exit codes, running a coroutine.

Entry point only: parses arguments, runs coroutines, maps our errors to exit codes and one
readable line on stderr. No business logic here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from typer import _click as click  # the click typer is built on (its own copy)
from typer.core import TyperArgument, TyperGroup, TyperOption

from controlplane.cli.render import Output
from controlplane.kafka.settings import KafkaSettings, load_settings
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.exits import (
    APP_SETTINGS,
    CliExit,
    cli_exit,
    error_line,
    exit_codes_help,
    internal_line,
)
from controlplane.wire.signing import Verifier, read_trust_store

T = TypeVar("T")

#: The exit codes (controlplane.wire.exits), under the name the commands know them by.
Exit = CliExit

#: The package's version (``controlplane --version``).
PACKAGE = "fleet-controlplane"


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """A usage error (a typo'd command or option, a missing one, a bad value, no selector)
    ends as one line and :attr:`CliExit.USAGE`: never click's 2, which is "timed out" here."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError as exc:  # the help was shown: still not run
        exc.exit_code = CliExit.USAGE
        raise
    except click.exceptions.UsageError as exc:
        raise fail(usage_error(exc)) from None


def usage_error(exc: click.exceptions.UsageError) -> ControlPlaneError:
    """USAGE (exit 64): ``<what>; hint: <the command's --help>``, one line like every error."""
    path = exc.ctx.command_path if exc.ctx is not None else "controlplane"
    message = " ".join(exc.format_message().split()).rstrip(".")
    return ControlPlaneError(f"{message}; hint: see `{path} --help`", code=LocalCode.USAGE)


def _readable_metavar(param: TyperOption, command: click.Command) -> str:
    """What a value is called in ``--help``: ``TEXT``, ``FLOAT``, ``PATH``, ``wait|abort|keep``;
    never typer's ``<list[str]>`` or ``<float range>``."""
    shown = param.display_type(click.Context(command)).strip("<>")
    if shown.startswith("list[") and shown.endswith("]"):
        shown = shown[5:-1]
    shown = shown.removesuffix(" range")
    if "|" in shown:
        return shown
    return {"str": "TEXT", "int": "INTEGER"}.get(shown, shown.upper())


def _tidy(command: click.Command) -> None:
    """Readable ``--help`` for ``command`` and every command under it: flags show no type (was
    ``<bool>``), values a name (``PATH``, ``FLOAT``; an argument its own name, ``PATH``, not
    ``{path}``), and every command lists the exit codes."""
    if command.epilog is None:
        command.epilog = exit_codes_help()
    helper = command.get_help_option(click.Context(command))  # made once, then kept
    for param in [*command.params, *([helper] if helper is not None else [])]:
        if param.metavar is not None:
            pass
        elif isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""
        elif isinstance(param, TyperArgument):
            shown = (param.name or "value").upper()
            param.metavar = shown
            # typer's usage line wraps a required argument in braces ({path}): the plain name.
            usage = shown if param.required else f"[{shown}]"
            setattr(param, "_usage_display_name", lambda usage=usage: usage)  # noqa: B010
            # and its name says what it is: no type column (was <str>).
            setattr(param, "display_type_rich", lambda ctx: None)  # noqa: B010
        elif isinstance(param, TyperOption):
            param.metavar = _readable_metavar(param, command)
    for sub in getattr(command, "commands", {}).values():
        _tidy(sub)


class CommandLine(TyperGroup):
    """The `controlplane` group: usage errors exit :attr:`CliExit.USAGE` with one line, and
    ``--help`` reads well (see :func:`_tidy`)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        _tidy(self)

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        with _usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    name="controlplane",
    help="Kafka-driven control plane for model-serving fleets.",
    cls=CommandLine,
    **APP_SETTINGS,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"controlplane {importlib.metadata.version(PACKAGE)}")
        raise typer.Exit(CliExit.OK)


@app.callback()
def _top(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print this package's version and exit.",
        ),
    ] = False,
) -> None:
    """Kafka-driven control plane for model-serving fleets."""


BootstrapOpt = Annotated[
    str,
    typer.Option(
        "--bootstrap",
        "-b",
        envvar="FLEET_KAFKA_BOOTSTRAP",
        metavar="HOST:PORT",
        help="Kafka bootstrap servers.",
    ),
]
OutputOpt = Annotated[
    Output,
    typer.Option(
        "--output",
        "-o",
        help="table (identical rows collapsed, with counts), wide (every row), json or yaml.",
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


#: What goes on when Ctrl-C stops this command (:func:`goes_on`; the latest said counts).
_going_on: list[str] = []


def goes_on(what: str) -> None:
    """From now on, Ctrl-C ends this command with ``interrupted; WHAT`` (e.g. ``the rollout
    goes on: controlplane status R``) and :attr:`CliExit.INTERRUPTED`."""
    _going_on.append(what)


def interrupted_line() -> str:
    """The one line Ctrl-C ends a command with."""
    return "interrupted" + (f"; {_going_on[-1]}" if _going_on else "")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; our errors become one line and an exit code, and so does
    anything unexpected (exit 5): never a traceback. Ctrl-C: :func:`interrupted_line` and
    :attr:`CliExit.INTERRUPTED` (130)."""
    try:
        return asyncio.run(coro)
    except ControlPlaneError as exc:
        raise fail(described(exc)) from None
    except KeyboardInterrupt:
        typer.echo(interrupted_line(), err=True)
        raise typer.Exit(CliExit.INTERRUPTED) from None
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except BaseException as exc:  # a bug, or a library's stray CancelledError
        typer.echo(internal_line(exc), err=True)
        raise typer.Exit(CliExit.INTERNAL) from None


#: Where this command looks for Kafka (the last settings :func:`kafka_settings` made): named in
#: the line that says it is unreachable.
_bootstrap: list[str] = []

#: What to do when Kafka cannot be reached, on the line that says so.
UNREACHABLE_HINT = (
    "hint: is Kafka running there? point --bootstrap (or FLEET_KAFKA_BOOTSTRAP) at its "
    "host:port; `controlplane broker start` runs one locally"
)


def described(error: ControlPlaneError) -> ControlPlaneError:
    """The error in the CLI's words: Kafka unreachable as the client found it (its exception
    the cause) names the address tried and says what to do, without the client's repr of the
    address (``[('127.0.0.1', 9092, <AddressFamily.AF_INET: 2>)]``); anything else as it is."""
    if error.code is not LocalCode.BROKER_UNAVAILABLE or error.__cause__ is None:
        return error
    doing, sep, _ = error.message.partition(": Kafka unreachable")
    where = f" at {_bootstrap[-1]}" if _bootstrap else ""
    what = f" ({doing})" if sep else ""
    return ControlPlaneError(f"Kafka unreachable{where}{what}; {UNREACHABLE_HINT}", code=error.code)


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
        settings = load_settings(
            KafkaSettings, **{**env.model_dump(exclude_unset=True), **values, **overrides}
        )
    except ControlPlaneError as exc:
        raise fail(exc) from None
    _bootstrap.append(settings.bootstrap_servers)
    return settings
