"""``python -m bench.dashboard --quick`` in CI: headless Chromium on the dashboard of a
synthetic fleet; it must exit 0 and write its numbers (never asserted: they are measurements)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_bench_quick import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_dashboard_bench_quick(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    data = run_bench(request.config, "dashboard", tmp_path)
    browser, baseline = data["browser"], data["baseline"]
    assert len(browser["first_render_ms"]) == data["parameters"]["loads"] == 1
    assert browser["first_load_bytes"] > 0
    [steps] = browser["milestones"]
    assert {"page_ms", "events_sent_ms", "events_ms", "workers_ms", "ready_ms"} <= steps.keys()
    for key in ("updates", "bytes_after_first_render", "per_update_bytes", "by_path"):
        assert key in browser, key
    assert baseline["full_poll_bytes"] > 0 and baseline["every_rollout_with_workers_bytes"] > 0
    assert [t["name"] for t in data["targets"]] == [
        "< 100 KB per update after the first (the largest)",
        "first render < 1 s (median of the loads)",
    ]
