"""The worker's settings: validated when they are built, before anything connects."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from controlplane.errors import ControlPlaneError, ErrorCode
from controlplane.protocol import Heartbeat
from controlplane.settings import load_settings
from workers import settings as settings_module
from workers.settings import WorkerSettings, load_worker_settings, worker_dir_name


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


@pytest.mark.parametrize(
    "values",
    [
        {"labels": {"bad key": "x"}},
        {"labels": {"zone": "x" * 64}},
        {"labels": {"": "x"}},
        {"worker_id": "a b"},
        {"worker_id": "a%2Fb"},  # '%' would make two ids share a directory
        {"runner": "nope"},
    ],
)
def test_what_a_heartbeat_carries_is_checked_when_the_settings_are_built(
    values: dict[str, object],
) -> None:
    (field,) = values
    with pytest.raises(ControlPlaneError) as refused:
        load_worker_settings(**values)
    assert refused.value.code is ErrorCode.SETTINGS_INVALID and field in refused.value.message


def test_any_rule_of_the_wire_applies_to_the_settings_it_comes_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The settings are checked by building a heartbeat: a bound the wire gains applies too."""

    class StricterHeartbeat(Heartbeat):
        interval_s: Annotated[float, Field(gt=0, le=60)]

    monkeypatch.setattr(settings_module, "Heartbeat", StricterHeartbeat)
    assert load_worker_settings(heartbeat_interval_s=60).heartbeat_interval_s == 60
    with pytest.raises(ControlPlaneError, match="heartbeat_interval_s") as refused:
        load_worker_settings(heartbeat_interval_s=61)
    assert refused.value.code is ErrorCode.SETTINGS_INVALID


def test_each_worker_id_has_its_own_state_directory(tmp_path: Path) -> None:
    def directory(worker_id: str) -> Path:
        return WorkerSettings(worker_id=worker_id, state_dir=tmp_path).worker_state_dir

    # Ids without "/" keep the directory they always had (their journals stay theirs).
    assert directory("w1") == tmp_path / "w1"
    assert directory("gpu-3.zone_a:x@y") == tmp_path / "gpu-3.zone_a:x@y"
    ids = ["a/b", "a_b", "a_2Fb", "a/b/c", "a_b/c", "a/b_c", "x/..", "x/."]
    dirs = [directory(i) for i in ids]
    assert len(set(dirs)) == len(ids), dict(zip(ids, dirs, strict=True))
    assert all(d.parent == tmp_path for d in dirs)  # "/" never makes a subdirectory
    assert directory("a/b") == tmp_path / "a%2Fb"
    assert worker_dir_name("a/b") != worker_dir_name("a_b")
