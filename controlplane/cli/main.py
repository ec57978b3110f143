"""The `controlplane` entry point: every command module registers itself on ``app``."""

from __future__ import annotations

import sys

import typer

from controlplane.cli import admin, keys, progressive, rollout, services  # noqa: F401  (they register commands)
from controlplane.cli.common import app
from controlplane.wire.errors import ControlPlaneError
from controlplane.wire.exits import CliExit, error_line, internal_line


def main() -> None:
    try:
        app()
    except ControlPlaneError as exc:  # a last net: one line, never a traceback
        typer.echo(error_line(exc), err=True)
        sys.exit(CliExit.FAILED)
    except Exception as exc:  # a bug: still one line (exit 5)
        typer.echo(internal_line(exc), err=True)
        sys.exit(CliExit.INTERNAL)
