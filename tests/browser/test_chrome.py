"""Without Chromium or its driver the browser tests fail with one line saying what to install
(never skipped: CI must have them, scripts/setup.sh installs them)."""

from __future__ import annotations

import shutil

import pytest

from tests.browser import chrome as module


def test_a_missing_browser_is_one_line_naming_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, **kw: None if name == "chromedriver" else real(name)
    )
    with pytest.raises(module.BrowserMissing) as caught:
        module.chrome()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("chromedriver (chromium-driver) not found")
    assert "scripts/setup.sh" in message and "apt-get install chromium chromium-driver" in message
