"""The dashboard (controlplane/api/static/dashboard.html) in headless Chromium against a live
coordinator in process (uvicorn on a free port, no Kafka): what it shows from the fleet event
stream, that it reads no list again when nothing changed, its rollout detail (failed and lost
first, with codes; an ended rollout never "expires"), the workers' filters and pages, its
actions' coded answers and the token it asks for. Assertions are on contract C3's DOM
(docs/api.md, "Dashboard"); tests/browser drives it during real rollouts on the real broker.

Skipped where Chromium and chromedriver are not installed (scripts/setup.sh installs them; the
browser tests in tests/browser fail instead).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.app import create_app
from controlplane.api.server import ApiServer
from controlplane.coordinator.service import Coordinator
from controlplane.wire.control import ControlPhase
from controlplane.wire.protocol import AckState, Command
from tests.browser.chrome import BrowserMissing, Page, chrome
from tests.component.conftest import ack, command, feed, succeeded
from tests.component.test_api_progressive import feed_control, rollout_spec, state
from tests.component.test_api_progressive import targets as targets  # the fixture
from tests.component.test_api_scale import many_workers

#: URLs the page requested so far (the Resource Timing API), without the origin.
REQUESTED = (
    "return performance.getEntriesByType('resource').map(e => e.name.replace(location.origin, ''))"
)


@pytest.fixture
async def browser(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Page]:
    try:
        driver = chrome()
    except BrowserMissing as exc:
        pytest.skip(str(exc))
    try:
        yield Page(driver, tmp_path, request.node.name)
    finally:
        driver.quit()


@pytest.fixture
async def url(coordinator: Coordinator) -> AsyncIterator[str]:
    app: FastAPI = create_app(coordinator, sse_tick_s=0.2, fleet_min_interval_s=0)
    async with ApiServer(coordinator, port=0, app=app) as server:
        yield server.url


async def open_page(page: Page, url: str) -> None:
    await page.get(url)
    await page.element('html[data-ready="1"]', timeout=30)
    await page.element('#connection[data-state="live"]', timeout=30)


async def ids(page: Page, css: str, attribute: str) -> list[str]:
    found: list[str] = await page.script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))",
        css,
        attribute,
    )
    return found


async def test_the_dashboard_follows_the_stream_and_shows_failed_workers_first(
    coordinator: Coordinator, browser: Page, url: str, fleet_of_two: dict[str, Command]
) -> None:
    await open_page(browser, url)
    rows = await ids(browser, "[data-rollout-id]", "data-rollout-id")
    assert rows == ["r-new", "r-old"]  # newest first, before any worker
    assert await browser.attribute('[data-rollout-id="r-new"]', "data-phase") == "progressing"
    assert await ids(browser, "#workers [data-worker-id]", "data-worker-id") == ["w1", "w2"]
    assert await ids(browser, "#versions [data-version]", "data-version") == ["v2"]
    top = await browser.script(
        "return document.querySelector('#workers').getBoundingClientRect().top"
    )
    rollouts = await browser.script(
        "return document.querySelector('#rollouts').getBoundingClientRect().top"
    )
    assert rollouts < top  # rollouts come first
    width = await browser.script("return document.documentElement.scrollWidth")
    assert width <= 1400  # fits 1,400 px: nothing cut, no page-wide scrolling

    await browser.click('[data-rollout-id="r-new"]')
    detail = '[data-rollout-detail="r-new"]'
    first = f"{detail} [data-worker-id]"
    assert await browser.text(f'{first}[data-state="rejected"] .error-code') == "CHECKSUM_MISMATCH"
    assert await browser.attribute(first, "data-worker-id") == "w1"  # the failed one first
    assert "expires" in await browser.text(detail)  # still running

    before = int(await browser.attribute("html", "data-updates") or 0)
    read = len(await browser.script(REQUESTED))
    feed(coordinator, ack(fleet_of_two["new"], "w2", AckState.SUCCEEDED, 9.5))
    await browser.element('[data-rollout-id="r-new"][data-phase="failed"]', timeout=30)
    await browser.element(f'{detail} [data-worker-id="w2"][data-state="succeeded"]', timeout=30)
    assert int(await browser.attribute("html", "data-updates") or 0) > before
    assert "expires" not in await browser.text(detail)  # ended: never "expires in"
    assert "expires" not in await browser.text('[data-rollout-id="r-new"]')
    # Driven by the stream: the change read only the open rollout's workers and one page of
    # workers, never the rollouts or the summary again.
    since = (await browser.script(REQUESTED))[read:]
    assert since and all(
        p.startswith(("/api/v1/rollouts/r-new/workers?", "/api/v1/workers?")) for p in since
    ), since
    await browser.screenshot("failed-first")


async def test_the_workers_panel_pages_filters_and_groups_problems_first(
    coordinator: Coordinator, browser: Page, url: str
) -> None:
    workers = many_workers(coordinator, 120)
    late = command("r-late", workers=workers[:3], issued=9.5)
    feed(coordinator, late, ack(late, workers[2], AckState.FAILED, 9.8))
    await open_page(browser, url)
    shown = await ids(browser, "#workers [data-worker-id]", "data-worker-id")
    assert len(shown) == 50 and "1–50 of 120" in await browser.text("#workers-page")
    await browser.click('#workers-page [data-page="next"]')
    await browser.until(
        lambda d: "51–100 of 120" in d.find_element("css selector", "#workers-page").text,
        "the second page",
        30,
    )
    second = await ids(browser, "#workers [data-worker-id]", "data-worker-id")
    assert len(second) == 50 and not set(second) & set(shown)
    # Problems first: w0002 drifts (r-late wants v2 of it, it runs v1), then the busy ones
    # (updating), then those in sync.
    busy = workers[::10]
    assert shown[0] == workers[2] and shown[1 : 1 + len(busy)] == busy
    await browser.click('#workers-page [data-page="prev"]')
    await browser.element(f'#workers [data-worker-id="{shown[0]}"]', timeout=30)

    await browser.type("input#worker-filter", workers[77])
    await browser.until(
        lambda d: d.execute_script(
            "const r = document.querySelectorAll('#workers [data-worker-id]');"
            "return r.length === 1 && r[0].dataset.workerId === arguments[0]",
            workers[77],
        ),
        "only the searched worker",
        30,
    )
    await browser.type("input#worker-filter", "zone=z3")
    await browser.until(
        lambda d: d.execute_script(
            "const r = [...document.querySelectorAll('#workers [data-worker-id]')];"
            "return r.length === 30 && r.every(e => /zone=z3/.test(e.textContent))"
        ),
        "the 30 workers of zone z3",
        30,
    )


async def test_actions_show_the_apis_coded_answer(
    coordinator: Coordinator, browser: Page, url: str, targets: None
) -> None:
    feed_control(coordinator, rollout_spec("r-live", "v4"))
    feed_control(coordinator, state("r-live", ControlPhase.PROGRESSING, 1))
    await open_page(browser, url)
    row = '[data-progressive-id="r-live"]'
    await browser.element(f'{row}[data-phase="progressing"]')
    assert await browser.attribute('[data-progressive-id="r-bad"]', "data-phase") == "rolled_back"
    assert await ids(browser, 'button[data-progressive-id="r-bad"]', "data-action") == []
    await browser.element('[data-target="tiny"]')
    assert await ids(browser, "button[data-target]", "data-target") == ["tiny"]  # undo

    await browser.click(f'button[data-action="abort"]{row}')
    result = await browser.text("#action-result .error-code", timeout=30)
    assert result == "UNAUTHORIZED"  # no token typed: the API's code, no dialog
    await browser.type("input#token", "not-the-token")
    await browser.click('button[data-action="undo"][data-target="tiny"]')
    await browser.until(
        lambda d: "invalid bearer token" in d.find_element("css selector", "#action-result").text,
        "the refused undo",
        30,
    )
    assert await browser.attribute("#action-result", "data-outcome") == "error"


async def test_a_dry_run_reads_validated_with_a_badge_never_applied(
    coordinator: Coordinator, browser: Page, url: str, fleet_of_two: dict[str, Command]
) -> None:
    checked = command("r-dry", issued=9.6, version="v4").model_copy(update={"dry_run": True})
    feed(coordinator, checked, *succeeded(checked, "w1", "w2", sent=9.8))
    await open_page(browser, url)
    row = '[data-rollout-id="r-dry"]'
    assert await browser.attribute(row, "data-phase") == "succeeded"  # C3: the phase as it is
    assert await browser.attribute(row, "data-dry-run") == "1"
    shown = await browser.text(row)
    assert "dry run" in shown and "validated" in shown and "succeeded" not in shown
    real = '[data-rollout-id="r-old"]'
    assert await browser.attribute(real, "data-dry-run") is None
    shown = await browser.text(real)
    assert "succeeded" in shown and "dry run" not in shown and "validated" not in shown


class StreamAfterWorkers:
    """ASGI middleware: the fleet stream answers only once a page of workers was asked for."""

    def __init__(self, app: ASGIApp, asked: asyncio.Event) -> None:
        self.app = app
        self.asked = asked

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/api/v1/workers":
            self.asked.set()
        elif scope["type"] == "http" and scope["path"] == "/api/v1/events":
            with contextlib.suppress(TimeoutError):  # never asked: the page never gets ready
                async with asyncio.timeout(20):
                    await self.asked.wait()
        await self.app(scope, receive, send)


async def test_the_first_page_of_workers_is_read_beside_the_stream_not_after_it(
    coordinator: Coordinator, browser: Page, fleet_of_two: dict[str, Command]
) -> None:
    app = create_app(coordinator, sse_tick_s=0.2, fleet_min_interval_s=0)
    asked = asyncio.Event()
    app.add_middleware(StreamAfterWorkers, asked=asked)
    async with ApiServer(coordinator, port=0, app=app) as server:
        await browser.get(server.url)
        # The bug: the page asked for workers only once the snapshot came (held here until then).
        await browser.element('html[data-ready="1"]', timeout=15)
        assert await ids(browser, "#workers [data-worker-id]", "data-worker-id") == ["w1", "w2"]
        assert "of 2" in await browser.text("#workers-page")  # with the fleet's counts
        assert await ids(browser, "[data-rollout-id]", "data-rollout-id") == ["r-new", "r-old"]
