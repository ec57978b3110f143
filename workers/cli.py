"""The `fleet-worker` command line: run an agent beside a model server; write checkpoints.

Entry point only: settings from environment and flags, signals, asyncio.run. No logic here.

`fleet-worker run` ends with one line, ``error: CODE: message``, and an exit code per cause
(:data:`controlplane.wire.exits.WORKER_EXITS`, documented in README.md), never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.exits import APP_SETTINGS, WORKER_EXITS, WorkerExit, error_line, worker_exit

if TYPE_CHECKING:
    from workers.agent.loop import Agent

app = typer.Typer(
    name="fleet-worker", help="Worker agent of the fleet control plane.", **APP_SETTINGS
)

#: Exit codes of `fleet-worker run` (controlplane.wire.exits), under their older names.
EXIT_ERROR = WorkerExit.ERROR
EXIT_SETTINGS = WorkerExit.SETTINGS
EXIT_KAFKA = WorkerExit.KAFKA
EXIT_STATE_DIR_LOCKED = WorkerExit.STATE_DIR_LOCKED
EXIT_JOURNAL = WorkerExit.JOURNAL
EXIT_RUNNER = WorkerExit.RUNNER
EXIT_CODES = WORKER_EXITS


def _fail(exc: ControlPlaneError) -> typer.Exit:
    """Print the error as one coded line; the exit that goes with its code."""
    typer.echo(error_line(exc), err=True)
    return typer.Exit(worker_exit(exc))


try:  # the checkpoint tool needs torch; the agent itself does not
    from workers.demo.checkpoints import checkpoint_app

    app.add_typer(checkpoint_app, name="checkpoint", help="Write safetensors checkpoints.")
except ImportError:  # pragma: no cover - only without torch
    pass


def _invalid(message: str) -> ControlPlaneError:
    return ControlPlaneError(message, code=LocalCode.SETTINGS_INVALID)


def _json_object(text: str | None, flag: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _invalid(f"{flag} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise _invalid(f"{flag} must be a JSON object")
    return value


def _labels(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise _invalid(f"--label {item!r} must look like key=value")
        if key in out:
            raise _invalid(f"--label {key!r} is given twice")
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
    lease_s: Annotated[
        float | None,
        typer.Option(
            help="How long a heartbeat vouches for this worker (default: 10 heartbeat periods)."
        ),
    ] = None,
    trust_store: Annotated[
        Path | None,
        typer.Option(
            "--trust-store",
            help="Apply only commands signed by a key of this trust store (JSON; see"
            " `controlplane keys`); FLEET_WORKER_TRUST_STORE in the environment.",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING.")] = "INFO",
) -> None:
    """Run a worker agent until SIGTERM/SIGINT (then drain: finish or time out, ack, stop);
    SIGHUP reads the trust store again.

    Exit codes: 0 stopped, 3 invalid settings, 4 Kafka, 5 state directory in use by another
    agent, 6 journal not writable, 7 runner failed to load, 1 any other error.
    """
    from workers.agent.loop import Agent
    from workers.agent.settings import load_worker_settings
    from workers.runners.base import create_runner

    # Everything is checked here, before anything connects to Kafka.
    try:
        level = logging.getLevelNamesMapping().get(log_level.upper())
        if level is None:
            raise _invalid(f"--log-level {log_level!r}: use DEBUG, INFO, WARNING or ERROR")
        logging.basicConfig(
            level=level,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
        logging.getLogger("aiokafka").setLevel(logging.WARNING)
        kafka_flags = {"bootstrap_servers": bootstrap, "topic_prefix": topic_prefix}
        flags: dict[str, Any] = {
            "worker_id": worker_id,
            "labels": _labels(label),
            "runner": runner,
            "runner_options": _json_object(runner_options, "--runner-options"),
            "allowed_roots": allow_root,
            "state_dir": state_dir,
            "heartbeat_interval_s": heartbeat_s,
            "lease_s": lease_s,
            "trust_store": trust_store,
            # Merged into the environment's FLEET_WORKER_KAFKA__* (validated with them).
            "kafka": {k: v for k, v in kafka_flags.items() if v is not None} or None,
        }
        settings = load_worker_settings(**{k: v for k, v in flags.items() if v is not None})
        try:
            agent = Agent(settings, create_runner(settings.runner, settings.runner_options))
        except ValueError as exc:  # the runner's options
            raise _invalid(str(exc)) from None
    except ControlPlaneError as exc:
        raise _fail(exc) from None
    _warn_about_a_legacy_state_dir(settings.state_dir, settings.worker_id)

    async def main() -> None:
        install_signal_handlers(asyncio.get_running_loop(), agent)
        await agent.run()

    try:
        asyncio.run(main())
    except ControlPlaneError as exc:
        raise _fail(exc) from None


def install_signal_handlers(loop: asyncio.AbstractEventLoop, agent: Agent) -> None:
    """SIGTERM and SIGINT stop the agent (draining); SIGHUP reads its trust store again."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_stop)
    loop.add_signal_handler(signal.SIGHUP, agent.reload_trust_store)


def _warn_about_a_legacy_state_dir(state_dir: Path, worker_id: str) -> None:
    """Ids with "/" had their journal in a directory with "_" instead (shared with the id
    spelled that way); it is not taken over, as it may be the other worker's."""
    from workers.agent.settings import worker_dir_name

    legacy = state_dir / worker_id.replace("/", "_")
    current = state_dir / worker_dir_name(worker_id)
    if "/" in worker_id and legacy.is_dir() and not current.exists():
        logging.getLogger("workers.cli").warning(
            "this worker's journal is now %s; %s is where earlier versions kept it (and that of"
            " a worker named %r): if it is this worker's, stop it and rename the directory",
            current,
            legacy,
            legacy.name,
        )


def main() -> None:
    app()
