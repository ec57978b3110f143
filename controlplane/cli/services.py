"""CLI commands that run services: the coordinator, a worker agent (delegated), and the demo.

Entry points only: settings, signals, asyncio.run. ``controlplane`` never imports ``workers``:
`controlplane worker` hands over to `python -m workers run` in the same process image.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli.common import BootstrapOpt, PrefixOpt, app, fail, run
from controlplane.kafka.settings import DEFAULT_BOOTSTRAP, load_settings
from controlplane.wire.errors import ControlPlaneError

if TYPE_CHECKING:
    from controlplane.coordinator.service import Coordinator


@app.command("coordinator")
def coordinator(
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
    host: Annotated[str | None, typer.Option(help="HTTP bind address.")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port.")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING.")] = "INFO",
) -> None:
    """Run the coordinator: rebuild status from the topics, follow them, serve the API and dashboard.

    Settings also come from FLEET_COORDINATOR_* (e.g. FLEET_COORDINATOR_API_TOKEN).
    """
    from controlplane.api.app import create_app
    from controlplane.api.server import serve
    from controlplane.coordinator.service import Coordinator, CoordinatorSettings

    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        settings = load_settings(CoordinatorSettings)
    except ControlPlaneError as exc:
        raise fail(exc) from None
    kafka = settings.kafka
    if (
        bootstrap != DEFAULT_BOOTSTRAP
        or "FLEET_COORDINATOR_KAFKA__BOOTSTRAP_SERVERS" not in os.environ
    ):
        kafka = kafka.model_copy(update={"bootstrap_servers": bootstrap})
    if prefix != "fleet" or "FLEET_COORDINATOR_KAFKA__TOPIC_PREFIX" not in os.environ:
        kafka = kafka.model_copy(update={"topic_prefix": prefix})
    update: dict[str, object] = {"kafka": kafka}
    if host is not None:
        update["host"] = host
    if port is not None:
        update["port"] = port
    settings = settings.model_copy(update=update)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        coord = Coordinator(settings)
        app = create_app(coord)  # before start: its metrics must see the replayed log too
        async with coord:
            server = asyncio.create_task(serve(coord, settings.host, settings.port, app=app))
            waiter = asyncio.create_task(stop.wait())
            frozen = asyncio.create_task(_freeze_when_caught_up(coord))
            await asyncio.wait({server, waiter}, return_when=asyncio.FIRST_COMPLETED)
            failed = server.done() and not server.cancelled() and server.exception()
            for task in (server, waiter, frozen):
                task.cancel()
            await asyncio.gather(server, waiter, frozen, return_exceptions=True)
            if failed:
                raise failed

    run(main())


async def _freeze_when_caught_up(coord: Coordinator) -> None:
    """Once the log is replayed, move what the replay built (a long-lived fold of the whole
    history) out of the cyclic collector's reach: each full collection would otherwise scan it
    all again, stalling the loop for up to a second at 10,000 workers (docs/scaling.md).
    Reference counting still frees it; only cycles among it would stay (the fold makes none).
    For the coordinator process only: a test session's heap is not ours to freeze."""
    await coord.follower.caught_up.wait()
    gc.collect()
    gc.freeze()


@app.command(
    "worker",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def worker(ctx: typer.Context) -> None:
    """Run a worker agent (same as `fleet-worker run`; --help shows its options)."""
    argv = [sys.executable, "-m", "workers", "run", *ctx.args]
    os.execv(sys.executable, argv)


@app.command("demo")
def demo(
    workdir: Annotated[
        Path, typer.Option(help="Where the demo keeps its broker, checkpoints and logs.")
    ] = Path(".fleet/demo"),
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep everything running until Ctrl-C.")
    ] = False,
    workers: Annotated[int, typer.Option(help="How many workers.", min=1, max=16)] = 3,
    vllm: Annotated[
        bool, typer.Option("--vllm/--no-vllm", help="Add a vLLM worker when vLLM is installed.")
    ] = False,
) -> None:
    """The local demo: a Kafka broker, a coordinator, workers with real models, three rollouts."""
    from controlplane.cli.demo import Demo

    code = Demo(workdir.resolve(), n_workers=workers, keep=keep, vllm=vllm).run()
    raise typer.Exit(code)
