"""The dashboard in a real browser during real rollouts (issue 15): headless Chromium driven by
Selenium, the real broker, in-process agents with the fake runner, a controller that leads and
a second coordinator serving the API with uvicorn (tests/integration/test_api_progressive.py).

The page is opened before anything happens and never reloaded: the rollout appears and moves
on its own (server-sent events), a failed worker shows its id and error code, an abort clicked
on the page ends a progressive rollout. Assertions are on the DOM of contract C3
(docs/api.md: ``data-*`` attributes); every wait is for a condition. Screenshots go to the
test's directory and to test-results/browser/ (git-ignored) for a person to look at.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from controlplane.kafka.settings import KafkaSettings
from tests.browser.chrome import Page
from tests.integration.test_api_progressive import TOKEN, api_of, start
from tests.integration.test_coordinator_api import until
from tests.integration.test_progressive import fleet_of
from workers.runners.fake_runner import FakeRunner

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: Installed once the first render is done: every phase each rollout row showed, in order,
#: and a marker that a reload would wipe out.
WATCH = """
window.__watch = {phases: {}};
const note = () => {
  for (const row of document.querySelectorAll(
      '[data-rollout-id][data-phase], [data-progressive-id][data-phase]')) {
    const id = row.getAttribute('data-rollout-id') || row.getAttribute('data-progressive-id');
    const seen = (window.__watch.phases[id] ||= []);
    const phase = row.getAttribute('data-phase');
    if (seen[seen.length - 1] !== phase) seen.push(phase);
  }
};
new MutationObserver(note).observe(document.documentElement, {
  subtree: true, childList: true, attributes: true, attributeFilter: ['data-phase']});
note();
"""


async def open_dashboard(page: Page, url: str) -> int:
    """Open the dashboard, wait for its first render, start watching; its update count."""
    await page.get(url)
    await page.element('html[data-ready="1"]')
    await page.element('#connection[data-state="live"]')
    await page.script(WATCH)
    return int(await page.attribute("html", "data-updates") or 0)


async def phases_seen(page: Page, rollout_id: str) -> list[str]:
    seen: list[str] | None = await page.script(
        "return window.__watch && window.__watch.phases[arguments[0]] || null", rollout_id
    )
    assert seen is not None, "the page was reloaded (its watcher is gone)"
    return seen


def hold_reloads(runners: Iterable[FakeRunner]) -> threading.Event:
    """Each runner's reloads wait (in the agent's thread) until the returned event is set."""
    gate = threading.Event()
    for runner in runners:

        def held(*args: Any, inner: Any = runner.reload_weights, **kw: Any) -> Any:
            gate.wait(120)
            return inner(*args, **kw)

        setattr(runner, "reload_weights", held)  # noqa: B010 - this instance only
    return gate


async def test_a_rollout_appears_progresses_and_names_the_failed_worker_without_a_reload(
    kafka: KafkaSettings, tmp_path: Path, page: Page
) -> None:
    async with fleet_of(kafka, tmp_path, 2) as fleet, api_of(kafka) as api:
        await fleet.start_agent("w-bad", tmp_path, {"fail_prefix": "v2"})
        await until(api, "/api/v1/workers", lambda ws: sum(w["alive"] for w in ws) == 3)
        gate = hold_reloads(fleet.runners.values())
        updates = await open_dashboard(page, str(api.base_url))
        await page.element('#workers [data-worker-id="w-bad"]')
        await page.screenshot("1-fleet")

        body = {
            "kind": "reload_weights",
            "path": fleet.weights("v2").path,
            "version": "v2",
            "selector": {"labels": {"model": "tiny"}},
            "timeout_s": 60,
        }
        created = await api.post("/api/v1/rollouts", json=body)
        assert created.status_code == 201, created.text
        rollout_id = created.json()["rollout_id"]
        row = f'[data-rollout-id="{rollout_id}"]'

        # Acked and running (the reloads held): the page shows it moving on its own.
        await page.element(f'{row}[data-phase="progressing"]')
        await page.screenshot("2-progressing")
        gate.set()
        await page.element(f'{row}[data-phase="failed"]')
        seen = await phases_seen(page, rollout_id)
        assert seen[-2:] == ["progressing", "failed"] and set(seen) <= {"pending", *seen[-2:]}
        assert int(await page.attribute("html", "data-updates") or 0) > updates

        # The failed worker first in the rollout's detail, with its code; the others succeeded.
        await page.click(row)
        detail = f'[data-rollout-detail="{rollout_id}"]'
        bad = f'{detail} [data-worker-id="w-bad"][data-state="failed"]'
        assert await page.text(f"{bad} .error-code") == "RUNNER_FAILED"
        first = await page.attribute(f"{detail} [data-worker-id]", "data-worker-id")
        assert first == "w-bad"
        for worker in ("w00", "w01"):
            await page.element(f'{detail} [data-worker-id="{worker}"][data-state="succeeded"]')
        await page.screenshot("3-failed-worker")
        assert await phases_seen(page, rollout_id)  # still the same page

        # Fits 1,400 px with the detail open (nothing to scroll sideways); nothing from
        # another origin (works offline).
        wide = await page.script(
            "const e = document.documentElement; return [e.scrollWidth, e.clientWidth]"
        )
        assert wide[0] <= wide[1], f"the page is {wide[0]} px wide in a {wide[1]} px window"
        foreign = await page.script(
            "return performance.getEntriesByType('resource').map(r => r.name)"
            ".filter(u => new URL(u).origin !== location.origin)"
        )
        assert foreign == []


async def test_an_abort_clicked_on_the_page_rolls_a_progressive_rollout_back(
    kafka: KafkaSettings, tmp_path: Path, page: Page
) -> None:
    async with fleet_of(kafka, tmp_path, 3) as fleet, api_of(kafka) as api:
        await fleet.target()
        await until(api, "/api/v1/targets/tiny", lambda b: b["at_stable"] == 3)
        await open_dashboard(page, str(api.base_url))
        await page.element('[data-target="tiny"]')

        strategy: dict[str, Any] = {"canary": 1, "pause": "manual"}
        r = await start(api, fleet, {"version": "v2", "strategy": strategy, "rollout_id": "r-ui"})
        assert r.status_code == 201, r.text
        row = '[data-progressive-id="r-ui"]'
        await page.element(f'{row}[data-phase="paused"]')
        await page.screenshot("1-paused")

        await page.type("input#token", TOKEN)
        await page.click('button[data-action="abort"][data-progressive-id="r-ui"]')
        await page.element(f'{row}[data-phase="rolled_back"]')
        result = await page.text("#action-result")
        assert result and "error" not in result.lower(), result
        await page.screenshot("2-rolled-back")
        assert (await phases_seen(page, "r-ui"))[-1] == "rolled_back"

        body = (await api.get("/api/v1/progressive-rollouts/r-ui")).json()
        assert (body["phase"], body["code"]) == ("rolled_back", "ABORTED_BY_OPERATOR")
        canary = body["waves"][0]["workers"][0]
        assert fleet.runners[canary].history == ["v1", "v2", "v1"]


async def test_relative_times_stay_current_between_renders(
    kafka: KafkaSettings, page: Page
) -> None:
    """A row is re-rendered only when what it shows changed; its relative times ("issued 5s
    ago", "silent since 2m ago") are kept current by the page's clock all the same. A time the
    page did not render itself, 125 s old, reads "2m ago" without any update."""
    async with api_of(kafka) as api:
        await open_dashboard(page, str(api.base_url))
        issued = await page.script(
            "const t = document.createElement('time');"
            "t.id = 'probe'; t.dataset.ago = new Date(Date.now() - 125000).toISOString();"
            "t.textContent = 'as rendered'; document.body.append(t); return t.dataset.ago"
        )
        assert issued
        await page.until(
            lambda d: d.find_element("css selector", "#probe").text == "2m ago",
            "the probe's relative time, kept current",
        )
