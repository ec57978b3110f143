"""The vLLM environment itself: what ``vllm serve`` runs must not depend on the caller's PATH."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)


def test_vllm_collect_env_works_without_uv_on_path() -> None:
    """vLLM's /server_info runs collect_env: `python -m pip list` when pip is importable, else
    (a uv-made environment) `uv pip list` from PATH, and HTTP 500 when that is missing. A
    fresh machine's PATH (/usr/local/bin:/usr/bin:/bin) has no uv: pip must be in the venv."""
    probe = (
        "from vllm.collect_env import get_pip_packages, run\n"
        "name, listed = get_pip_packages(run)\n"
        "assert 'torch' in listed, listed\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
