"""Reading a rollout from a coordinator's HTTP API instead of the log (``--api URL``).

A coordinator has already folded the log: asking it costs one request (plus one per thousand
workers of the rollout, for ``--json``'s full list), never a replay, whatever the fleet's
history; ``kubectl`` asks its API server the same way. The answer is the coordinator's
judgment, made by the same rules a reader of the log applies (docs/rollouts.md), so
``status <id> --api URL`` prints what ``status <id>`` prints, and exits with the same code;
``workers --api URL`` lists the workers the coordinator knows, a thousand a request.

A coordinator whose reads need a token (its ``api_read_token``) gets the one in
``FLEET_API_TOKEN`` (the read token, or the write token), as a bearer token to its own origin
only: pagination never follows a link elsewhere. Only reads go this way; a publish still
writes to Kafka itself. A coordinator that cannot
answer (unreachable, not caught up yet: 503, an answer that is not the API's) is
``COORDINATOR_UNAVAILABLE`` (exit 4): the CLI says so rather than read the log behind the
user's back.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final
from urllib.parse import quote

import httpx

from controlplane.rollout.models import RolloutStatus, WorkerLevel
from controlplane.rollout.registry import WorkerView
from controlplane.wire.errors import ControlPlaneError, LocalCode

#: The API's path prefix (``controlplane.api.models.API``; not imported: FastAPI stays out of
#: the CLI).
API_PREFIX: Final = "/api/v1"
#: Workers per page when the full list is fetched (the API's largest page).
WORKERS_PAGE: Final = 1000
#: The environment variable holding the token the CLI reads with (the coordinator's read token;
#: its write token reads too).
TOKEN_ENV: Final = "FLEET_API_TOKEN"
#: How often ``--watch`` asks again (the coordinator re-judges a rollout at most this often
#: for its own streams too).
WATCH_EVERY_S: Final = 1.0


class CoordinatorUnavailable(ControlPlaneError):
    """The coordinator's API did not answer as one does."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=LocalCode.COORDINATOR_UNAVAILABLE)


class RolloutNotFound(LookupError):
    """The coordinator has no such rollout (404)."""


class Remote:
    """``async with Remote(url) as api:`` one HTTP client for the command's requests."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        token: str | None = None,
    ) -> None:
        """``token``: the bearer token to read with; default :data:`TOKEN_ENV`'s, if set."""
        self.url = url.rstrip("/")
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        self._has_token = token is not None
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        self._client = httpx.AsyncClient(
            base_url=self.url, timeout=timeout_s, transport=transport, headers=headers
        )

    async def __aenter__(self) -> Remote:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def _get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        try:
            response = await self._client.get(path, params=params)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from None
        if response.status_code == 404 and _error_code(response) == "ROLLOUT_NOT_FOUND":
            raise RolloutNotFound(path)
        if response.status_code in (401, 403):
            hint = (
                f"{TOKEN_ENV} is not a token it accepts for reads"
                if self._has_token
                else f"its reads need a token: set {TOKEN_ENV} (its read token)"
            )
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} answered {response.status_code} for {path}: {hint}"
            )
        if response.status_code != 200:
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} answered {response.status_code} for {path}"
                f"{_reason(response)}"
            )
        return response

    async def _pages(self, path: str) -> AsyncIterator[list[dict[str, Any]]]:
        """The rows of a paginated list, page by page, from ``path`` along ``Link: rel="next"``.
        A link to another origin, a link seen before or a page of no rows that names a next one
        is not the API's pagination: refused, never followed (no loop, no other host)."""
        seen: set[str] = set()
        next_path: str | None = path
        while next_path is not None:
            try:
                url = self._client.base_url.join(next_path)
            except httpx.InvalidURL:
                url = httpx.URL()  # no origin: refused below
            if (url.scheme, url.host, url.port) != (
                self._client.base_url.scheme,
                self._client.base_url.host,
                self._client.base_url.port,
            ) or str(url) in seen:
                raise CoordinatorUnavailable(
                    f"coordinator API at {self.url} paginated to {next_path!r}: not a next page"
                )
            seen.add(str(url))
            page = await self._get(str(url.copy_set_param("limit", WORKERS_PAGE)))
            rows = _json_list(page, self.url)
            link = page.links.get("next", {}).get("url")
            if link and not rows:
                raise CoordinatorUnavailable(
                    f"coordinator API at {self.url} answered an empty page with a next one"
                )
            yield rows
            next_path = link or None

    async def status(self, rollout_id: str, *, workers: bool = True) -> RolloutStatus:
        """The rollout's status as the coordinator judges it now; with every worker when
        ``workers`` (the pages ``workers_next`` names), else the first page only."""
        path = f"{API_PREFIX}/rollouts/{quote(rollout_id, safe='')}"
        first = await self._get(path, {"workers_limit": WORKERS_PAGE if workers else 0})
        body = _json_object(first, self.url)
        next_path = body.pop("workers_next", None)
        listed = body.get("workers", [])
        if not isinstance(listed, list) or not isinstance(next_path, str | None):
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} answered a rollout this CLI cannot read"
            )
        if workers and next_path:
            async for rows in self._pages(next_path):
                listed.extend({k: v for k, v in row.items() if k != "unexpected"} for row in rows)
        if workers and len(listed) < _expected(body):
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} listed {len(listed)} of the rollout's "
                f"{_expected(body)} workers"
            )
        try:
            return RolloutStatus.model_validate(body)
        except ValueError as exc:
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} answered a rollout this CLI cannot read: {exc}"
            ) from None

    async def workers(self) -> tuple[list[WorkerView], list[WorkerLevel]]:
        """Every worker the coordinator knows (its pages, ``Link: rel="next"``): the latest
        heartbeat of each heard from, and each one's level (desired against reported)."""
        views: list[WorkerView] = []
        levels: list[WorkerLevel] = []
        try:
            async for rows in self._pages(f"{API_PREFIX}/workers"):
                for row in rows:
                    heartbeat = row.pop("heartbeat", None)
                    row.pop("target", None)
                    levels.append(WorkerLevel.model_validate(row))
                    if heartbeat is not None:
                        views.append(WorkerView.model_validate(heartbeat))
        except ValueError as exc:
            raise CoordinatorUnavailable(
                f"coordinator API at {self.url} answered workers this CLI cannot read: {exc}"
            ) from None
        return views, levels

    async def watch(
        self, rollout_id: str, on_status: Callable[[RolloutStatus], None], *, json_out: bool
    ) -> RolloutStatus:
        """Ask every :data:`WATCH_EVERY_S` until the rollout is terminal; ``on_status`` sees
        each answer (counts only: the full list is fetched once, at the end, for ``--json``)."""
        import asyncio

        while True:
            started = time.monotonic()
            status = await self.status(rollout_id, workers=False)
            on_status(status)
            if status.terminal:
                return await self.status(rollout_id) if json_out else status
            await asyncio.sleep(max(0.0, WATCH_EVERY_S - (time.monotonic() - started)))


def _expected(body: dict[str, Any]) -> int:
    value = body.get("expected", 0)
    return value if isinstance(value, int) else 0


def _error_code(response: httpx.Response) -> str | None:
    """The API error's code (a 404 of the API, not of something else listening at the URL)."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return f": {error.get('code', '')} {error['message']}".rstrip()
    return ""


def _json_object(response: httpx.Response, url: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise CoordinatorUnavailable(f"coordinator API at {url} answered something not JSON")
    return body


def _json_list(response: httpx.Response, url: str) -> list[dict[str, Any]]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, list) or not all(isinstance(row, dict) for row in body):
        raise CoordinatorUnavailable(f"coordinator API at {url} answered something not a list")
    return body
