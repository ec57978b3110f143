"""The `controlplane` entry point: every command module registers itself on ``app``."""

from __future__ import annotations

import sys

import typer

from controlplane.cli import admin, rollout, services  # noqa: F401  (they register commands)
from controlplane.cli.common import Exit, app
from controlplane.wire.errors import ControlPlaneError, ErrorCode


def main() -> None:
    try:
        app()
    except ControlPlaneError as exc:  # a last net: one line, never a traceback
        typer.echo(f"error: {exc.code}: {exc.message}", err=True)
        sys.exit(Exit.FAILED)
    except Exception as exc:  # a bug: still one line (exit 5)
        typer.echo(f"error: {ErrorCode.INTERNAL}: {type(exc).__name__}: {exc}", err=True)
        sys.exit(Exit.INTERNAL)
