"""Bad settings from the environment are one coded line and exit 3, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from controlplane.cli import app as controlplane_app
from workers.cli import app as worker_app


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"FLEET_WORKER_HEARTBEAT_INTERVAL_S": "-1"}, "heartbeat_interval_s"),
        ({"FLEET_WORKER_LABELS": "not json"}, "labels"),
        ({"FLEET_WORKER_WORKER_ID": "bad id!"}, "worker_id"),
    ],
)
def test_worker_settings(env: dict[str, str], field: str) -> None:
    result = CliRunner().invoke(worker_app, ["run", "--runner", "fake"], env=env)
    assert result.exit_code == 3, result.output
    assert "SCHEMA_INVALID: invalid settings" in result.output and field in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_coordinator_settings() -> None:
    result = CliRunner().invoke(
        controlplane_app, ["coordinator"], env={"FLEET_COORDINATOR_PORT": "abc"}
    )
    assert result.exit_code == 3, result.output
    assert "SCHEMA_INVALID: invalid settings: port" in result.output
