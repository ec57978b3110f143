"""Runner config validation, digests and the runner registry (no torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from controlplane.wire.errors import RunnerError, WireCode
from workers.runners.base import (
    RUNNERS,
    ReloadResult,
    Runner,
    RunnerConfig,
    accepted_keys,
    apply_overrides,
    config_digest,
    create_runner,
)


class Config(RunnerConfig):
    max_new_tokens: int = Field(default=32, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0)
    greedy: bool = True
    name: str = "x"
    stop: int | None = None


def test_overrides_apply_and_leave_the_original_alone() -> None:
    current = Config()
    new = apply_overrides(current, {"max_new_tokens": 8, "temperature": 1, "stop": 3})
    assert (new.max_new_tokens, new.temperature, new.stop) == (8, 1.0, 3)
    assert isinstance(new.temperature, float)
    assert current == Config()


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_new_tokens": True},  # a bool is not an int
        {"max_new_tokens": 2.0},
        {"max_new_tokens": "8"},
        {"max_new_tokens": 0},
        {"max_new_tokens": 4097},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": False},
        {"greedy": 1},
        {"name": 5},
        {"stop": "never"},
    ],
)
def test_bad_values_are_rejected(overrides: dict[str, Any]) -> None:
    with pytest.raises(RunnerError) as info:
        apply_overrides(Config(), overrides)
    assert info.value.code is WireCode.CONFIG_VALUE_INVALID
    assert info.value.is_rejection
    assert next(iter(overrides)) in info.value.message


def test_unknown_keys_are_rejected_all_or_nothing() -> None:
    current = Config(max_new_tokens=4)
    with pytest.raises(RunnerError) as info:
        apply_overrides(current, {"max_new_tokens": 8, "max_tokens": 8, "beam": 2})
    assert info.value.code is WireCode.CONFIG_KEY_REJECTED
    assert "beam" in info.value.message and "max_tokens" in info.value.message
    assert current.max_new_tokens == 4


def test_a_good_key_next_to_a_bad_value_changes_nothing() -> None:
    current = Config()
    with pytest.raises(RunnerError):
        apply_overrides(current, {"max_new_tokens": 8, "temperature": -1})
    assert current.max_new_tokens == 32


def test_accepted_keys_are_json_type_names() -> None:
    assert accepted_keys(Config) == {
        "max_new_tokens": "integer",
        "temperature": "number",
        "greedy": "boolean",
        "name": "string",
        "stop": "integer|null",
    }


def test_config_digest_is_canonical() -> None:
    a = config_digest({"b": 1, "a": [1.5, "x"]})
    assert a == config_digest({"a": [1.5, "x"], "b": 1})
    assert len(a) == 16 and int(a, 16) >= 0
    assert a != config_digest({"b": 2, "a": [1.5, "x"]})


def test_reload_result_as_dict() -> None:
    result = ReloadResult("v1", 2, 10, 1000, 0.1, 0.2, 0.3, 0.005)
    assert result.as_dict()["bytes"] == 1000 and result.as_dict()["version"] == "v1"


def test_create_runner_lists_choices_for_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="fake, torch, vllm, xla"):
        create_runner("tensorflow", {})
    assert set(RUNNERS) == {"torch", "xla", "fake", "vllm"}


def test_create_runner_imports_lazily_and_validates_options() -> None:
    runner = create_runner("fake", {"initial_version": "v0"})
    assert isinstance(runner, Runner)
    assert runner.name == "fake"
    with pytest.raises(ValueError, match="reload_delay_s"):
        create_runner("fake", {"reload_delay_s": -1})
    with pytest.raises(ValueError, match="unknown_option"):
        create_runner("fake", {"unknown_option": 1})
    with pytest.raises(ValueError, match="initial config"):
        create_runner("fake", {"config": {"top_k": -1}})


def test_a_runner_whose_library_is_missing_is_a_coded_error(tmp_path: Path) -> None:
    """``fleet-worker run --runner xla`` without torch_xla: one coded line, RUNNER_LOAD_FAILED,
    its exit code and no traceback; never a worker running another runner. (A subprocess: the
    xla runner module imports torch, and torch_xla is hidden there only.)"""
    code = (
        "import sys; sys.modules['torch_xla'] = None\n"
        "from workers.runners.base import create_runner\n"
        "from controlplane.wire.errors import RunnerError\n"
        "try:\n"
        "    create_runner('xla', {})\n"
        "except RunnerError as exc:\n"
        "    print('raised', exc.code.value)\n"
        "from workers.cli import main\n"
        "sys.argv = ['fleet-worker', 'run', '--runner', 'xla', '--id', 'x1',\n"
        f"            '--state-dir', {str(tmp_path)!r}, '--bootstrap', '127.0.0.1:9']\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.stdout.splitlines() == ["raised RUNNER_LOAD_FAILED"]
    assert out.returncode == 7, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: RUNNER_LOAD_FAILED: runner 'xla' is not available here")
    assert "torch_xla" in line


def test_the_runner_modules_do_not_import_torch() -> None:
    code = "import sys, workers.runners.base, workers.weights.paths, workers.runners.fake_runner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
