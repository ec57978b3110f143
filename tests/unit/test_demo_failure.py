"""The demo says why it failed, verbatim, whatever the message holds (brackets are not markup)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.cli.demo import Demo
from controlplane.wire.errors import ControlPlaneError, LocalCode

MESSAGE = "[kafka] broker exited: see [/tmp/logs] and [/] [bold]"


def test_a_failed_demo_prints_its_coded_error_verbatim_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = Demo(tmp_path / "demo")

    def fail() -> None:
        raise ControlPlaneError(MESSAGE, code=LocalCode.BROKER_UNAVAILABLE)

    monkeypatch.setattr(demo, "_prepare", fail)
    assert demo.run() == 1
    out = capsys.readouterr().out
    assert f"demo failed: {LocalCode.BROKER_UNAVAILABLE}: {MESSAGE}" in out
