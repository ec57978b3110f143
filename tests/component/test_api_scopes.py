"""API scopes: with a read token configured every read under /api/v1 needs it (or the write token),
writes still need the write token, health and metrics stay open; the dashboard asks for the token
and a browser's EventSource can send it as a cookie, which no write accepts."""

from __future__ import annotations

import hmac
import re
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from controlplane.api.app import TOKEN_COOKIE, create_app
from controlplane.api.server import ApiServer
from controlplane.cli.remote import TOKEN_ENV, CoordinatorUnavailable, Remote
from controlplane.coordinator.service import Coordinator
from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import Command
from tests.browser.chrome import Page
from tests.component.conftest import AUTH, TOKEN, command, feed, sse_events
from tests.component.test_api import RELOAD
from tests.component.test_dashboard import browser as browser  # the fixture

READ_TOKEN = "read-only-token"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}


@pytest.fixture
def scoped(coordinator: Coordinator) -> Coordinator:
    """The component tests' coordinator (write token TOKEN) with a read token too."""
    coordinator.settings = coordinator.settings.model_copy(
        update={"api_read_token": SecretStr(READ_TOKEN)}
    )
    return coordinator


@pytest.fixture
async def api(scoped: Coordinator) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(scoped, sse_tick_s=0.05))
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        yield c


def api_reads(app: FastAPI) -> list[str]:
    """Every GET under /api/v1 that the OpenAPI document lists, path parameters filled in."""
    paths = [path for path, ops in app.openapi()["paths"].items() if "get" in ops]
    reads = [re.sub(r"\{[^}]+\}", "r-old", p) for p in paths if p.startswith("/api/v1/")]
    assert len(reads) >= 14, reads  # rollouts, workers, targets, progressive rollouts, ...
    return reads


async def test_every_read_needs_the_read_or_the_write_token(
    scoped: Coordinator, api: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    """Before: every GET answered without a token."""
    for path in api_reads(create_app(scoped)):
        bare = await api.get(path)
        assert bare.status_code == 401, (path, bare.text)
        assert bare.json()["error"]["code"] == "UNAUTHORIZED"
        assert bare.headers["www-authenticate"].startswith("Bearer ")
        wrong = await api.get(path, headers={"Authorization": f"Bearer {READ_TOKEN}x"})
        assert wrong.status_code == 401 and "invalid_token" in wrong.headers["www-authenticate"]
        # The fleet stream never ends by itself: its one-off form (the snapshot, then closed).
        params = {"once": "true"} if path == "/api/v1/events" else None
        for headers in (READ, AUTH):
            answer = await api.get(path, headers=headers, params=params)
            assert answer.status_code not in (401, 403), (path, headers, answer.text)


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/"])
async def test_health_metrics_and_the_page_stay_open(api: httpx.AsyncClient, path: str) -> None:
    assert (await api.get(path)).status_code == 200


async def test_the_read_token_cannot_write(api: httpx.AsyncClient) -> None:
    """Before: the read token was just a wrong token (401), and a write needed nothing else."""
    refused = await api.post("/api/v1/rollouts", json=RELOAD, headers=READ)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "FORBIDDEN"
    assert 'error="insufficient_scope"' in refused.headers["www-authenticate"]
    target = await api.put("/api/v1/targets/t1", json={"selector": {}}, headers=READ)
    assert target.status_code == 403 and target.json()["error"]["code"] == "FORBIDDEN"
    bare = await api.post("/api/v1/rollouts", json=RELOAD)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "UNAUTHORIZED"


async def test_the_write_token_still_writes(api: httpx.AsyncClient) -> None:
    """Past authorization: refused for what it asks (no worker matches), not for its token."""
    r = await api.post("/api/v1/rollouts", json=RELOAD, headers=AUTH)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "NO_MATCHING_WORKERS"


async def test_sse_needs_a_token_and_takes_it_from_the_cookie(
    api: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    """A browser's EventSource cannot send an Authorization header: it sends the cookie."""
    events = "/api/v1/rollouts/r-old/events"
    assert (await api.get(events)).status_code == 401
    streamed = await api.get(events, headers={"Cookie": f"{TOKEN_COOKIE}={quote(READ_TOKEN)}"})
    assert streamed.status_code == 200, streamed.text
    assert [name for name, _ in sse_events(streamed.text)] == ["status", "end"]
    # ... and the cookie never writes, not even holding the write token.
    cookie = {"Cookie": f"{TOKEN_COOKIE}={quote(TOKEN)}"}
    write = await api.post("/api/v1/rollouts", json=RELOAD, headers=cookie)
    assert write.status_code == 401 and write.json()["error"]["code"] == "UNAUTHORIZED"


@pytest.mark.parametrize(
    ("headers", "matched"), [(AUTH, "write"), (READ, "read"), ({"Authorization": "Bearer x"}, "")]
)
async def test_each_token_is_compared_with_both_every_time(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, headers: dict[str, str], matched: str
) -> None:
    """Whichever token is sent (or neither), both are compared in constant time: how long the
    check takes says nothing of which one matched."""
    compared: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr("controlplane.api.app.hmac.compare_digest", spy)
    await api.get("/api/v1/summary", headers=headers)
    await api.post("/api/v1/rollouts", json=RELOAD, headers=headers)
    assert compared == [TOKEN.encode(), READ_TOKEN.encode()] * 2, matched


async def test_without_a_read_token_reads_stay_open(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    assert (await client.get("/api/v1/rollouts")).status_code == 200
    refused = await client.post("/api/v1/rollouts", json=RELOAD, headers=READ)
    assert refused.status_code == 401  # not a token this coordinator has


async def test_unverified_commands_are_listed_to_readers(
    scoped: Coordinator, api: httpx.AsyncClient
) -> None:
    forged = command("r-forged", issued=3.0, version="v666")
    scoped.fleet.observe_unverified(forged, WireCode.KEY_UNKNOWN, "no key 'mallory'", "mallory")
    feed(scoped)
    assert (await api.get("/api/v1/commands/unverified")).status_code == 401
    listed = await api.get("/api/v1/commands/unverified", headers=READ)
    assert listed.status_code == 200, listed.text
    [entry] = listed.json()
    assert entry["rollout_id"] == "r-forged" and entry["command_id"] == forged.command_id
    assert (entry["code"], entry["key_id"], entry["nacks"]) == ("KEY_UNKNOWN", "mallory", 0)


async def test_the_dashboard_asks_for_the_token(
    scoped: Coordinator, fleet_of_two: dict[str, Command], browser: Page
) -> None:
    """Before: a 401 read as "Cannot reach the coordinator"."""
    async with ApiServer(scoped, port=0, app=create_app(scoped, sse_tick_s=0.2)) as server:
        await browser.get(server.url)
        assert "reads need a token" in await browser.text("#banner", timeout=30)
        state = await browser.attribute("#connection", "data-state")
        assert state == "reconnecting"
        await browser.type("input#token", READ_TOKEN)  # sent as a cookie: reads only
        await browser.element('html[data-ready="1"]', timeout=30)  # no reload
        await browser.element('#connection[data-state="live"]', timeout=30)
        await browser.element('[data-rollout-id="r-new"]', timeout=30)


@pytest.mark.parametrize(("token", "works"), [(READ_TOKEN, True), (TOKEN, True), (None, False)])
async def test_the_clis_api_reader_sends_fleet_api_token(
    scoped: Coordinator,
    fleet_of_two: dict[str, Command],
    monkeypatch: pytest.MonkeyPatch,
    token: str | None,
    works: bool,
) -> None:
    """``status --api`` / ``workers --api`` read with the token in FLEET_API_TOKEN."""
    if token is None:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(TOKEN_ENV, token)
    transport = httpx.ASGITransport(app=create_app(scoped))
    async with Remote("http://coordinator", transport=transport) as remote:
        if works:
            assert (await remote.status("r-old")).phase.value == "succeeded"
            views, _ = await remote.workers()
            assert sorted(v.worker_id for v in views) == ["w1", "w2"]
            return
        with pytest.raises(CoordinatorUnavailable) as refused:
            await remote.status("r-old")
    assert "401" in refused.value.message and f"set {TOKEN_ENV}" in refused.value.message


async def test_a_wrong_fleet_api_token_is_said_to_be_wrong(
    scoped: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "not-it")
    transport = httpx.ASGITransport(app=create_app(scoped))
    async with Remote("http://coordinator", transport=transport) as remote:
        with pytest.raises(CoordinatorUnavailable) as refused:
            await remote.workers()
    assert f"{TOKEN_ENV} is not a token it accepts" in refused.value.message
    assert "not-it" not in refused.value.message
