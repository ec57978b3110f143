"""`controlplane targets set` / `rollout start` options (controlplane/cli/progressive.py).

Parsing only: a usage error ends the command before any Kafka client exists.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from controlplane.cli import main as _registered  # noqa: F401  (registers the commands)
from controlplane.cli.common import app
from controlplane.wire.exits import CliExit


@pytest.mark.parametrize(
    "args",
    [
        ["targets", "set", "tiny", "-s", "model=tiny", "--weights", "/ckpt", "-v", "v1"],
        ["rollout", "start", "tiny", "--weights", "/ckpt", "-v", "v1"],
    ],
    ids=["targets set", "rollout start"],
)
def test_dash_v_is_not_the_weights_version(args: list[str]) -> None:
    """As for reload-weights (issue 15): `-v` reads as verbose or the tool's version; the
    weights' version is spelled `--version`."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == CliExit.USAGE, result.output
    assert "No such option: -v" in result.output
