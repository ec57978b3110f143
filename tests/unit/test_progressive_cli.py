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


def test_markup_in_a_selector_or_a_target_is_shown_as_it_is() -> None:
    """A label value like ``[/dev/nvme0]`` is data: rich would read it as a closing tag and
    end the command with exit 5 (MarkupError)."""
    from rich.console import Console

    from controlplane.cli.progressive import history_table, rollout_table, targets_table
    from controlplane.rollout.targets import Rollout
    from tests.unit.test_control_records import ROLLOUT
    from tests.unit.test_target_digests import beat, status

    shown = status(beat("w1", None)).model_copy(update={"selector": {"disk": "[/dev/nvme0]"}})
    rollout = Rollout(spec=ROLLOUT.model_copy(update={"target": "[/x]"}), seq=0)
    for renderable, expected in (
        (targets_table([shown]), "disk=[/dev/nvme0]"),
        (history_table("rollouts of [/x]", [rollout]), "rollouts of [/x]"),
        (history_table("progressive rollouts", [rollout]), "[/x]"),
        (rollout_table(rollout), "[/x]: pending"),
    ):
        out = Console(width=300, record=True, color_system=None)
        out.print(renderable)
        assert expected in out.export_text()
