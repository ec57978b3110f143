"""The worker's settings: validated when they are built, before anything connects."""

from __future__ import annotations

import pytest

from controlplane.errors import ControlPlaneError
from controlplane.settings import load_settings
from workers.settings import WorkerSettings


def test_command_bounds_have_defaults_and_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = WorkerSettings()
    assert settings.max_ttl_s == 7 * 24 * 3600 and settings.max_clock_skew_s == 300
    monkeypatch.setenv("FLEET_WORKER_MAX_TTL_S", "3600")
    monkeypatch.setenv("FLEET_WORKER_MAX_CLOCK_SKEW_S", "0")
    settings = WorkerSettings()
    assert settings.max_ttl_s == 3600 and settings.max_clock_skew_s == 0


@pytest.mark.parametrize(("field", "value"), [("max_ttl_s", 0), ("max_clock_skew_s", -1)])
def test_command_bounds_are_checked(field: str, value: float) -> None:
    with pytest.raises(ControlPlaneError, match=field):
        load_settings(WorkerSettings, **{field: value})
