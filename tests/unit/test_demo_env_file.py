"""The demo's ``<workdir>/env.sh`` holds the write token: only its owner may read it (review LOW-12)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli.demo import Demo

TOKEN = "demo-write-token-123"


@pytest.fixture
def lax_umask() -> Iterator[None]:
    """The common default umask (files 0644 unless created otherwise)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _demo(workdir: Path) -> Demo:
    workdir.mkdir()
    demo = Demo(workdir)
    demo.bootstrap = "127.0.0.1:9092"
    return demo


@pytest.mark.usefixtures("lax_umask")
def test_env_file_is_created_owner_only(tmp_path: Path) -> None:
    script = _demo(tmp_path / "demo").second_terminal("http://127.0.0.1:8080", TOKEN)
    assert stat.S_IMODE(script.stat().st_mode) == 0o600
    assert f"export FLEET_API_TOKEN={TOKEN}" in script.read_text()


@pytest.mark.usefixtures("lax_umask")
def test_env_file_left_world_readable_by_an_older_demo_is_replaced_owner_only(
    tmp_path: Path,
) -> None:
    demo = _demo(tmp_path / "demo")
    old = demo.workdir / "env.sh"
    old.write_text("export FLEET_API_TOKEN=old\n")
    old.chmod(0o644)
    script = demo.second_terminal("http://127.0.0.1:8080", TOKEN)
    assert stat.S_IMODE(script.stat().st_mode) == 0o600
    assert "old" not in script.read_text()
    assert [p.name for p in demo.workdir.iterdir()] == ["env.sh"]  # no temporary left behind
