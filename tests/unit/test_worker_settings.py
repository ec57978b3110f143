"""The worker's settings: validated when they are built, before anything connects."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from controlplane.kafka.settings import load_settings
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.protocol import MAX_HEARTBEAT_INTERVAL_S, MAX_LEASE_S, Heartbeat
from workers.agent import settings as settings_module
from workers.agent.settings import WorkerSettings, load_worker_settings, worker_dir_name


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
    assert refused.value.code is LocalCode.SETTINGS_INVALID and field in refused.value.message


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
    assert refused.value.code is LocalCode.SETTINGS_INVALID


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


def test_the_lease_defaults_to_ten_periods_and_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = WorkerSettings()
    assert settings.lease_s is None
    assert settings.effective_lease_s == 10 * settings.heartbeat_interval_s == 30
    assert WorkerSettings(heartbeat_interval_s=0.5).effective_lease_s == 5
    # The longest period still gets a lease the wire accepts (three periods at most).
    longest = load_worker_settings(heartbeat_interval_s=MAX_HEARTBEAT_INTERVAL_S)
    assert longest.effective_lease_s == MAX_LEASE_S
    monkeypatch.setenv("FLEET_WORKER_LEASE_S", "12.5")
    assert load_worker_settings().effective_lease_s == 12.5
    assert load_worker_settings(lease_s=3).effective_lease_s == 3  # one period is enough


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"lease_s": 2.9}, "shorter than heartbeat_interval_s 3"),
        ({"lease_s": 5, "heartbeat_interval_s": 10}, "shorter than heartbeat_interval_s 10"),
        ({"lease_s": 0}, "greater than 0"),
        ({"lease_s": MAX_LEASE_S + 1}, "less than or equal to"),
    ],
)
def test_a_lease_shorter_than_a_period_or_too_long_is_refused(
    values: dict[str, float], words: str
) -> None:
    with pytest.raises(ControlPlaneError) as refused:
        load_worker_settings(**values)
    assert refused.value.code is LocalCode.SETTINGS_INVALID
    assert "lease_s" in refused.value.message and words in refused.value.message


def test_the_lease_flag_is_checked_before_anything_connects(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from workers.cli import EXIT_SETTINGS, app

    result = CliRunner().invoke(
        app,
        [
            "run",
            "--runner",
            "fake",
            "--state-dir",
            str(tmp_path),
            "--heartbeat-s",
            "2",
            "--lease-s",
            "1",
        ],
    )
    assert result.exit_code == EXIT_SETTINGS, result.output
    assert "SETTINGS_INVALID" in result.output and "lease_s 1" in result.output
