"""``controlplane status <id> --api URL`` asks a coordinator instead of reading the log (issue 18):
it prints what ``status <id>`` prints from the log (every worker, over the API's pages) and
exits with the same code; ``workers --api URL`` lists what ``workers`` lists; a rollout the coordinator lacks is exit 3; a coordinator that cannot
answer is COORDINATOR_UNAVAILABLE, exit 4, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from controlplane.api.app import create_app
from controlplane.api.models import API
from controlplane.api.server import ApiServer
from controlplane.cli.remote import API_PREFIX, WORKERS_PAGE
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.exits import CliExit
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Selector,
    UpdateConfigSpec,
)
from tests.factories import free_port, succeeded_acks
from tests.fleet import make_command, publish, wait_for
from tests.integration.test_cli_one_rollout import beat, cli, send_acks

pytestmark = pytest.mark.kafka

#: More than one page of the API's worker list, so that --json must follow ``workers_next``.
FLEET = [f"w-{i:04d}" for i in range(WORKERS_PAGE + 205)]


@asynccontextmanager
async def serving(kafka: KafkaSettings) -> AsyncIterator[tuple[Coordinator, str]]:
    coordinator = Coordinator(CoordinatorSettings(kafka=kafka))
    app = create_app(coordinator)
    async with coordinator:
        await coordinator.wait_ready(60)
        async with ApiServer(coordinator, "127.0.0.1", 0, app=app) as server:
            yield coordinator, server.url


def failed_ack(worker_id: str, rollout_id: str, command_id: str) -> Ack:
    done = succeeded_acks(worker_id, rollout_id, command_id)[-1]
    error = AckError(code="CONFIG_INVALID", message="no such key")
    return done.model_copy(update={"state": AckState.FAILED, "error": error})


async def rollout(kafka: KafkaSettings, rollout_id: str, workers: list[str], *, fail: int) -> None:
    """Pinned to ``workers``: the first ``fail`` fail, the others succeed."""
    command = make_command(
        UpdateConfigSpec(overrides={"t": 1}),
        rollout_id=rollout_id,
        selector=Selector(worker_ids=workers),
    )
    await publish(kafka, command)
    acks: list[Ack] = []
    for i, worker_id in enumerate(workers):
        if i < fail:
            acks.append(failed_ack(worker_id, rollout_id, command.command_id))
        else:
            acks += succeeded_acks(worker_id, rollout_id, command.command_id)
    await send_acks(kafka, acks)


def ended(coordinator: Coordinator, rollout_id: str) -> bool:
    return (
        rollout_id in coordinator.fleet
        and coordinator.fleet.status(rollout_id, coordinator.now()).terminal
    )


def without_as_of(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "as_of"}


def test_the_cli_knows_the_apis_prefix() -> None:
    assert API_PREFIX == API


async def test_status_from_the_api_is_the_logs(kafka: KafkaSettings) -> None:
    """A rollout of 1,205 workers (two API pages) and a failed one: ``--api`` prints the same
    status JSON as the log's reader (every worker) and exits with the same code."""
    await beat(kafka, FLEET)
    await rollout(kafka, "r-big", FLEET, fail=0)
    await rollout(kafka, "r-bad", FLEET[:3], fail=1)
    async with serving(kafka) as (coordinator, url):
        await wait_for(lambda: all(ended(coordinator, r) for r in ("r-big", "r-bad")), 60)
        for rollout_id, code in (("r-big", CliExit.OK), ("r-bad", CliExit.FAILED)):
            by_api = await asyncio.to_thread(
                cli, kafka, "status", rollout_id, "--json", "--api", url
            )
            by_log = await asyncio.to_thread(cli, kafka, "status", rollout_id, "--json")
            assert by_api.returncode == by_log.returncode == code, by_api.stderr + by_log.stderr
            shown, read = json.loads(by_api.stdout), json.loads(by_log.stdout)
            assert without_as_of(shown) == without_as_of(read)
            assert len(shown["workers"]) == shown["expected"]
        assert len(json.loads(by_api.stdout)["workers"]) == 3

        table = await asyncio.to_thread(cli, kafka, "status", "r-bad", "--api", url)
        assert table.returncode == CliExit.FAILED and "CONFIG_INVALID" in table.stdout

        watched = await asyncio.to_thread(cli, kafka, "status", "r-big", "--watch", "--api", url)
        assert watched.returncode == CliExit.OK, watched.stderr

        missing = await asyncio.to_thread(cli, kafka, "status", "r-none", "--api", url)
        assert missing.returncode == CliExit.INVALID
        assert "no rollout 'r-none'" in missing.stderr and "Traceback" not in missing.stderr

        # Every worker, over two pages, as the log's reader lists them (liveness aside: each
        # judged when it was read).
        views = {}
        for args in (("--api", url), ()):
            listed = await asyncio.to_thread(cli, kafka, "workers", "--json", *args)
            assert listed.returncode == CliExit.OK, listed.stderr
            views[args] = {
                w["worker_id"]: {k: v for k, v in w.items() if k != "alive"}
                for w in json.loads(listed.stdout)
            }
        assert views[("--api", url)] == views[()] and len(views[()]) == len(FLEET)
        table = await asyncio.to_thread(cli, kafka, "workers", "--api", url)
        assert table.returncode == CliExit.OK and FLEET[-1] in table.stdout

        every = await asyncio.to_thread(cli, kafka, "status", "--api", url)
        assert every.returncode != 0 and "--api shows one rollout" in every.stderr


async def test_an_unreachable_coordinator_is_exit_4(kafka: KafkaSettings) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = await asyncio.to_thread(cli, kafka, "status", "r-1", "--api", url)
    assert proc.returncode == CliExit.UNREACHABLE
    assert "COORDINATOR_UNAVAILABLE" in proc.stderr and url in proc.stderr
    assert "Traceback" not in proc.stderr
