"""The browser tests' page: headless Chromium (tests/browser/chrome.py), quit after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.browser.chrome import RESULTS, Page, chrome


@pytest.fixture
async def page(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Page]:
    """A blank page in a fresh headless Chromium; screenshots go to ``tmp_path/screenshots``
    and test-results/browser/, named after the test."""
    for old in RESULTS.glob(f"{request.node.name}-*.png"):  # a previous run's
        old.unlink()
    driver = chrome()  # BrowserMissing: the test fails, saying what to install
    try:
        yield Page(driver, tmp_path / "screenshots", request.node.name)
    finally:
        driver.quit()
