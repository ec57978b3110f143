"""The `fleet-worker` command line: run an agent beside a model server; write checkpoints.

Entry point only: settings from environment and flags, signals, asyncio.run. No logic here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.errors import ControlPlaneError
from controlplane.settings import load_settings

app = typer.Typer(
    name="fleet-worker",
    help="Worker agent of the fleet control plane.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

try:  # the checkpoint tool needs torch; the agent itself does not
    from workers.checkpoints import checkpoint_app

    app.add_typer(checkpoint_app, name="checkpoint", help="Write safetensors checkpoints.")
except ImportError:  # pragma: no cover - only without torch
    pass


def _json_object(text: str | None, flag: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{flag} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"{flag} must be a JSON object")
    return value


def _labels(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"label {item!r} must look like key=value")
        out[key] = value
    return out


@app.command("run")
def run(
    worker_id: Annotated[
        str | None, typer.Option("--id", help="Worker id (default: hostname).")
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option("--label", "-l", help="key=value, repeatable.")
    ] = None,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers.")
    ] = None,
    topic_prefix: Annotated[str | None, typer.Option(help="Topic name prefix.")] = None,
    runner: Annotated[str | None, typer.Option(help="torch | xla | vllm | fake")] = None,
    runner_options: Annotated[
        str | None, typer.Option(help="Runner options as a JSON object.")
    ] = None,
    allow_root: Annotated[
        list[Path] | None, typer.Option("--allow-root", help="Allowed weights root, repeatable.")
    ] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Local state directory.")] = None,
    heartbeat_s: Annotated[float | None, typer.Option(help="Heartbeat interval.")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING.")] = "INFO",
) -> None:
    """Run a worker agent until SIGTERM/SIGINT (then drain: finish or time out, ack, stop)."""
    from workers.agent import Agent
    from workers.runner import create_runner
    from workers.settings import WorkerSettings

    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    flags: dict[str, Any] = {
        "worker_id": worker_id,
        "labels": _labels(label),
        "runner": runner,
        "runner_options": _json_object(runner_options, "--runner-options"),
        "allowed_roots": allow_root,
        "state_dir": state_dir,
        "heartbeat_interval_s": heartbeat_s,
    }
    try:
        settings = load_settings(
            WorkerSettings, **{k: v for k, v in flags.items() if v is not None}
        )
    except ControlPlaneError as exc:
        typer.echo(f"error: {exc.code}: {exc.message}", err=True)
        raise typer.Exit(3) from None
    kafka_flags = {"bootstrap_servers": bootstrap, "topic_prefix": topic_prefix}
    kafka_flags = {k: v for k, v in kafka_flags.items() if v is not None}
    if kafka_flags:
        settings = settings.model_copy(
            update={"kafka": settings.kafka.model_copy(update=kafka_flags)}
        )
    try:
        agent = Agent(settings, create_runner(settings.runner, settings.runner_options))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(3) from None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.request_stop)
        await agent.run()

    try:
        asyncio.run(main())
    except ControlPlaneError as exc:
        typer.echo(f"error: {exc.code}: {exc.message}", err=True)
        raise typer.Exit(4) from None


def main() -> None:
    app()
