"""The dashboard's own script, run by Node against a live coordinator (uvicorn on a free port).

tests/component/dashboard_harness.js gives the page's script just enough of a DOM (elements by
id) and real ``fetch``; it prints what each update wrote into the page and which URLs it read.
Skipped where Node (18 or later, for ``fetch``) is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from controlplane.api.server import ApiServer
from controlplane.coordinator.service import Coordinator
from controlplane.wire.protocol import Command
from tests.component.conftest import command, feed, succeeded
from tests.component.test_api_scale import many_workers

NODE = shutil.which("node")
HARNESS = Path(__file__).with_name("dashboard_harness.js")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


async def dashboard(coordinator: Coordinator, app: FastAPI, *clicks: str) -> list[dict[str, Any]]:
    """What the page shows after its first update and after each click."""
    assert NODE is not None
    page = importlib.resources.files("controlplane.api").joinpath("static", "dashboard.html")
    async with ApiServer(coordinator, "127.0.0.1", 0, app=app) as server:
        node = await asyncio.create_subprocess_exec(
            NODE,
            str(HARNESS),
            server.url,
            str(page),
            *clicks,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(node.communicate(), 60)
    assert node.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def rows(shown: dict[str, Any], table: str) -> list[str]:
    """The first cell of each row of a table body."""
    return re.findall(r'<tr[^>]*>\s*<td class="mono">([^<]+)<', shown[table]["html"])


async def test_the_dashboard_shows_a_small_fleet_as_before(
    coordinator: Coordinator, app: FastAPI, fleet_of_two: dict[str, Command]
) -> None:
    [shown] = await dashboard(coordinator, app)
    header = {k: shown[k]["text"] for k in ("n-workers", "n-alive", "n-sync", "n-rollouts")}
    assert header == {"n-workers": "2", "n-alive": "2", "n-sync": "0", "n-rollouts": "2"}
    assert shown["n-active"]["text"] == "1" and "live" in shown["ready"]["html"]
    assert rows(shown, "workers") == ["w1", "w2"]
    assert "busy" in text(shown["workers"]["html"]) and "model=tiny" in shown["workers"]["html"]
    assert rows(shown, "rollouts") == ["r-new", "r-old"]
    assert "1 rejected" in text(shown["rollouts"]["html"])
    # The newest rollout is selected: its workers, with the rejection's code.
    assert shown["detail-id"]["text"] == "r-new" and not shown["detail-section"]["hidden"]
    assert "CHECKSUM_MISMATCH" in shown["detail-workers"]["html"]
    assert "ids: 2" in text(shown["detail-kv"]["html"])
    assert shown["workers-pager"]["html"] == "" and shown["detail-pager"]["html"] == ""
    assert sorted(shown["fetched"]) == [
        "/api/v1/rollouts/r-new/workers?limit=50",
        "/api/v1/rollouts?limit=25",
        "/api/v1/summary",
        "/api/v1/workers?limit=50",
        "/healthz",
    ]


async def test_the_dashboard_pages_through_a_large_fleet(
    coordinator: Coordinator, app: FastAPI
) -> None:
    ids = many_workers(coordinator, 120)
    cmd = command("r-big", workers=ids, issued=9.5)
    feed(coordinator, cmd, *(a for w in ids[:60] for a in succeeded(cmd, w, sent=12.0)))
    first, workers_next, detail_next, back = await dashboard(
        coordinator, app, "workers:next", "detail:next", "workers:prev"
    )
    assert first["n-workers"]["text"] == "120" and rows(first, "workers") == ids[:50]
    assert "1–50" in text(first["workers-pager"]["html"])
    assert "120 in all" in first["workers-hint"]["text"]
    assert rows(first, "detail-workers") == ids[:50]
    assert rows(workers_next, "workers") == ids[50:100]
    assert "51–100" in text(workers_next["workers-pager"]["html"])
    assert rows(detail_next, "detail-workers") == ids[50:100]
    assert rows(detail_next, "workers") == ids[50:100]  # the other table stays where it was
    assert rows(back, "workers") == ids[:50]
    assert any("cursor=" in url for url in workers_next["fetched"])
