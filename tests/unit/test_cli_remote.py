"""What ``--api`` does with answers that are not a coordinator's (controlplane/cli/remote.py):
each is COORDINATOR_UNAVAILABLE with a readable reason, never a wrong status. The happy path
runs against a real coordinator in tests/integration/test_cli_api.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controlplane.cli.remote import CoordinatorUnavailable, Remote, RolloutNotFound
from controlplane.wire.errors import LocalCode

URL = "http://coordinator.test"


def remote(handler: Callable[[httpx.Request], httpx.Response]) -> Remote:
    return Remote(URL, transport=httpx.MockTransport(handler))


def error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


async def unavailable(handler: Callable[[httpx.Request], httpx.Response]) -> str:
    async with remote(handler) as api:
        with pytest.raises(CoordinatorUnavailable) as caught:
            await api.status("r-1")
    assert caught.value.code is LocalCode.COORDINATOR_UNAVAILABLE
    return str(caught.value)


async def test_not_ready_is_unavailable_with_the_apis_reason() -> None:
    text = await unavailable(lambda r: error(503, "NOT_READY", "catching up with the log"))
    assert "503" in text and "NOT_READY catching up with the log" in text


async def test_an_answer_that_is_not_the_apis() -> None:
    assert "not JSON" in await unavailable(lambda r: httpx.Response(200, text="<html>"))
    # A 404 that is not the API's "no such rollout" (something else at that URL).
    assert "404" in await unavailable(lambda r: httpx.Response(404, text="not found"))
    bad = {"rollout_id": "r-1", "phase": "no-such-phase"}
    assert "cannot read" in await unavailable(lambda r: httpx.Response(200, json=bad))


async def test_a_rollout_the_coordinator_lacks() -> None:
    async with remote(lambda r: error(404, "ROLLOUT_NOT_FOUND", "no rollout")) as api:
        with pytest.raises(RolloutNotFound):
            await api.status("r-1")


async def test_a_worker_list_cut_short_is_never_shown_as_whole() -> None:
    """The first page names a next one that ends early: refused, not printed short."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if "/workers" in request.url.path:
            return httpx.Response(200, json=[])  # no rows, no Link: the list ends here
        body: dict[str, Any] = {"expected": 2, "workers": [], "workers_next": "/api/v1/x/workers"}
        return httpx.Response(200, content=json.dumps(body))

    assert "listed 0 of the rollout's 2 workers" in await unavailable(handler)
    assert seen[0].startswith(f"{URL}/api/v1/rollouts/r-1?") and len(seen) == 2


async def test_a_refused_connection_is_unavailable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    assert "unreachable: ConnectError" in await unavailable(handler)


def paged(link: str | None, rows: list[dict[str, Any]] | None = None) -> httpx.Response:
    headers = {"Link": f'<{link}>; rel="next"'} if link else {}
    return httpx.Response(200, json=rows if rows is not None else [{}], headers=headers)


def first_page(request: httpx.Request, next_path: str) -> httpx.Response:
    body = {"expected": 5, "workers": [], "workers_next": next_path}
    return httpx.Response(200, json=body)


async def test_a_next_link_seen_before_is_not_followed_again() -> None:
    """A coordinator (or something else) that links a page to itself: refused, not a loop."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path.endswith("/workers"):
            return paged("/api/v1/rollouts/r-1/workers?cursor=a")
        return first_page(request, "/api/v1/rollouts/r-1/workers?cursor=a")

    assert "not a next page" in await unavailable(handler)
    assert len(seen) == 2  # the rollout and the page of workers; its link to itself refused


async def test_a_next_link_to_another_host_is_not_followed() -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return first_page(request, "http://elsewhere.test/api/v1/rollouts/r-1/workers")

    assert "not a next page" in await unavailable(handler)
    assert all(url.startswith(URL) for url in asked)


async def test_an_empty_page_that_names_a_next_one_is_refused() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/workers"):
            return paged(f"/api/v1/rollouts/r-1/workers?cursor={len(request.url.query)}", [])
        return first_page(request, "/api/v1/rollouts/r-1/workers")

    assert "empty page with a next one" in await unavailable(handler)


async def test_workers_that_are_not_a_list_and_a_link_that_is_no_url() -> None:
    bad = {"expected": 1, "workers": {"w1": {}}}
    assert "cannot read" in await unavailable(lambda r: httpx.Response(200, json=bad))
    assert "not a next page" in await unavailable(lambda r: first_page(r, "http://[::1"))
