"""Headless Chromium through Selenium, for the browser tests and ``bench/dashboard``.

Debian's ``chromium`` and ``chromium-driver`` (``scripts/setup.sh`` installs them): Selenium is
given both paths, so it never downloads a browser or a driver. Where either is missing,
:func:`chrome` raises :class:`BrowserMissing` with one line saying what to install: the browser
tests fail with it (never skipped), as CI must install them.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Screenshots of a local run, kept for a person to look at (git-ignored).
RESULTS = REPO_ROOT / "test-results" / "browser"
#: The window: the dashboard must fit 1,400 px wide (contract C3).
WIDTH, HEIGHT = 1400, 1000
T = TypeVar("T")


class BrowserMissing(RuntimeError):
    """Chromium or chromedriver is not installed."""


def _binary(name: str) -> str | None:
    found = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/lib/chromium")
    return found


def chrome(*, performance_log: bool = False) -> webdriver.Chrome:
    """A headless Chromium, 1,400 x 1,000; ``performance_log``: DevTools' network events are
    kept for ``driver.get_log("performance")``."""
    browser, driver = _binary("chromium"), _binary("chromedriver")
    if browser is None or driver is None:
        missing = " and ".join(
            f"{what} ({package})"
            for what, package, path in (
                ("chromium", "chromium", browser),
                ("chromedriver", "chromium-driver", driver),
            )
            if path is None
        )
        raise BrowserMissing(
            f"{missing} not found: run scripts/setup.sh as root (or with passwordless sudo), "
            "or `apt-get install chromium chromium-driver`"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--metrics-recording-only",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        options.add_argument(flag)
    if performance_log:
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def save_screenshot(driver: WebDriver, out_dir: Path, name: str) -> list[Path]:
    """``name.png`` in ``out_dir`` (the test's own directory) and in :data:`RESULTS`."""
    png = driver.get_screenshot_as_png()
    paths = []
    for directory in (out_dir, RESULTS):
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.png"
        path.write_bytes(png)
        paths.append(path)
    return paths


class Page:
    """A driver's page from async code: every WebDriver call runs in a thread, so the event
    loop (broker clients, agents, uvicorn) keeps running while the browser works or waits."""

    def __init__(self, driver: WebDriver, out_dir: Path, prefix: str) -> None:
        self.driver = driver
        self.out_dir = out_dir
        self.prefix = prefix

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(functools.partial(fn, *args))

    async def get(self, url: str) -> None:
        await self.call(self.driver.get, url)

    async def until(
        self, check: Callable[[WebDriver], T | None], what: str, timeout: float = 60
    ) -> T:
        """Until ``check(driver)`` is truthy (stale elements retried); a timeout names ``what``
        and saves a screenshot."""

        def wait() -> T:
            waiter = WebDriverWait(
                self.driver, timeout, 0.1, ignored_exceptions=(StaleElementReferenceException,)
            )
            return cast(T, waiter.until(check, what))

        try:
            return await self.call(wait)
        except TimeoutException:
            await self.screenshot("timeout")
            raise AssertionError(f"the page never showed {what} in {timeout:.0f} s") from None

    async def element(self, css: str, timeout: float = 60) -> WebElement:
        """The first element matching ``css``, once there is one."""

        def found(driver: WebDriver) -> WebElement | None:
            elements = driver.find_elements(By.CSS_SELECTOR, css)
            return elements[0] if elements else None

        return await self.until(found, css, timeout)

    async def text(self, css: str, timeout: float = 60) -> str:
        """The text of the first element matching ``css``, once it has some."""

        def shown(driver: WebDriver) -> str | None:
            elements = driver.find_elements(By.CSS_SELECTOR, css)
            text = elements[0].text.strip() if elements else ""
            return text or None

        return await self.until(shown, f"text in {css}", timeout)

    async def attribute(self, css: str, name: str) -> str | None:
        element = await self.element(css)
        return await self.call(element.get_attribute, name)

    async def click(self, css: str) -> None:
        """Click the first element matching ``css`` (found again if a render replaced it)."""

        def clicked(driver: WebDriver) -> bool | None:
            elements = driver.find_elements(By.CSS_SELECTOR, css)
            if not elements:
                return None
            elements[0].click()
            return True

        await self.until(clicked, f"{css} to click")

    async def type(self, css: str, text: str) -> None:
        """Type ``text`` into the first field matching ``css``, replacing what it held."""

        def typed(driver: WebDriver) -> bool | None:
            elements = driver.find_elements(By.CSS_SELECTOR, css)
            if not elements:
                return None
            elements[0].clear()
            elements[0].send_keys(text)
            return True

        await self.until(typed, f"{css} to type into")

    async def script(self, source: str, *args: Any) -> Any:
        return await self.call(self.driver.execute_script, source, *args)

    async def screenshot(self, name: str) -> list[Path]:
        return await self.call(save_screenshot, self.driver, self.out_dir, f"{self.prefix}-{name}")
