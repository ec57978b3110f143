"""The fake runner: scripted outcomes, recorded history, the same errors as real runners."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from workers.runners.base import ReloadResult
from workers.runners.fake_runner import FakeRunner, fake_probe, fake_weights_digest
from workers.weights.stats import LoadStats


def spec(version: str, path: Path) -> ReloadWeightsSpec:
    return ReloadWeightsSpec(path=str(path), version=version)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 100)
    return path


def test_reload_records_versions_and_bytes(ckpt: Path) -> None:
    runner = FakeRunner({})
    assert runner.describe().weights_version is None
    runner.load()
    result = runner.reload_weights(spec("v1", ckpt), ckpt)
    assert (result.version, result.bytes, result.files) == ("v1", 100, 1)
    dir_result = runner.reload_weights(spec("v2", ckpt.parent), ckpt.parent)
    assert dir_result.files == 1
    assert runner.history == ["init", "v1", "v2"]
    assert runner.describe().weights_version == "v2"


def test_model_not_loaded_and_missing_path(ckpt: Path) -> None:
    runner = FakeRunner({})
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec("v1", ckpt), ckpt)
    assert info.value.code is WireCode.MODEL_NOT_LOADED
    runner.load()
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec("v1", ckpt.parent / "nope"), ckpt.parent / "nope")
    assert info.value.code is WireCode.WEIGHTS_UNREADABLE


def test_a_scripted_load_failure_leaves_no_model(ckpt: Path) -> None:
    runner = FakeRunner({"load_error": "out of memory"})
    with pytest.raises(RunnerError, match="cannot build the model: out of memory"):
        runner.load()
    assert not runner.describe().model_loaded and runner.describe().weights_version is None
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec("v1", ckpt), ckpt)
    assert info.value.code is WireCode.MODEL_NOT_LOADED


def test_scripted_failure_and_corruption(ckpt: Path) -> None:
    runner = FakeRunner({})
    runner.load()
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec("fail-1", ckpt), ckpt)
    assert info.value.code is WireCode.RUNNER_FAILED
    assert runner.describe().degraded is None
    with pytest.raises(WeightsCorrupted) as corrupted:
        runner.reload_weights(spec("corrupt-2", ckpt), ckpt)
    assert (corrupted.value.from_version, corrupted.value.to_version) == ("init", "corrupt-2")
    degraded = runner.describe().degraded
    assert degraded is not None and degraded.code == "WEIGHTS_CORRUPTED"
    assert runner.describe().weights_version == "init"
    runner.reload_weights(spec("v3", ckpt), ckpt)
    assert runner.describe().degraded is None and runner.history == ["init", "v3"]


def test_delay_is_cancellable(ckpt: Path) -> None:
    runner = FakeRunner({"reload_delay_s": 30})
    runner.load()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec("v1", ckpt), ckpt, cancel=cancel)
    assert info.value.code is WireCode.COMMAND_TIMEOUT
    assert runner.describe().weights_version == "init"


def test_update_config_is_validated(ckpt: Path) -> None:
    runner = FakeRunner({"config": {"max_new_tokens": 4}})
    before = runner.describe()
    assert before.config["max_new_tokens"] == 4
    assert before.accepts["temperature"] == "number"
    after = runner.update_config({"max_new_tokens": 8})
    assert after.config["max_new_tokens"] == 8 and after.config_digest != before.config_digest
    with pytest.raises(RunnerError) as info:
        runner.update_config({"max_new_tokens": 9, "nope": 1})
    assert info.value.code is WireCode.CONFIG_KEY_REJECTED
    assert runner.describe().config["max_new_tokens"] == 8


# --------------------------------------------------------------------------- probe


def test_probe_is_a_function_of_the_version_and_the_prompt(ckpt: Path) -> None:
    one, two = FakeRunner({}), FakeRunner({})
    for runner in (one, two):
        runner.load()
        runner.reload_weights(spec("v1", ckpt), ckpt)
    first = one.probe("The capital of France is", 8)
    assert first is not None and len(first.tokens) == 8
    assert all(0 <= t < 256 for t in first.tokens)
    assert -2.0 <= first.mean_logprob <= -0.5
    assert two.probe("The capital of France is", 8) == first  # another worker, same weights
    assert first == fake_probe("v1", "The capital of France is", 8)
    longer = one.probe("The capital of France is", 64)
    assert longer is not None and len(longer.tokens) == 64
    assert one.probe("Another prompt", 8) != first
    one.reload_weights(spec("v2", ckpt), ckpt)
    assert one.probe("The capital of France is", 8) != first
    assert one.probes == [
        ("v1", "The capital of France is", 8),
        ("v1", "The capital of France is", 64),
        ("v1", "Another prompt", 8),
        ("v2", "The capital of France is", 8),
    ]
    assert first.as_dict() == {
        "tokens": list(first.tokens),
        "mean_logprob": round(first.mean_logprob, 6),
    }


def test_a_badprobe_version_applies_but_probes_wrong(ckpt: Path) -> None:
    runner = FakeRunner({})
    runner.load()
    runner.reload_weights(spec("badprobe-v2", ckpt), ckpt)
    assert runner.describe().weights_version == "badprobe-v2"  # it validated and applied
    bad = runner.probe("p", 8)
    assert bad is not None and bad.mean_logprob == -50.0
    assert bad.tokens != fake_probe("badprobe-v2", "p", 8).tokens
    custom = FakeRunner({"bad_probe_prefix": "wrong-"})
    custom.load()
    custom.reload_weights(spec("wrong-1", ckpt), ckpt)
    assert custom.probe("p", 8) == fake_probe("wrong-1", "p", 8, bad=True)
    custom.reload_weights(spec("badprobe-v2", ckpt), ckpt)
    assert custom.probe("p", 8) == fake_probe("badprobe-v2", "p", 8)


def test_probe_refusals_and_scripted_outcomes(ckpt: Path) -> None:
    runner = FakeRunner({})
    with pytest.raises(RunnerError) as info:
        runner.probe("p", 8)
    assert info.value.code is WireCode.MODEL_NOT_LOADED
    runner.load()
    runner.reload_weights(spec("probefail-1", ckpt), ckpt)
    with pytest.raises(RunnerError) as info:
        runner.probe("p", 8)
    assert info.value.code is WireCode.RUNNER_FAILED
    with pytest.raises(WeightsCorrupted):
        runner.reload_weights(spec("corrupt-2", ckpt), ckpt)
    with pytest.raises(RunnerError) as info:
        runner.probe("p", 8)
    assert info.value.code is WireCode.WEIGHTS_CORRUPTED
    unsupported = FakeRunner({"probe_unsupported": True})
    unsupported.load()
    assert unsupported.probe("p", 8) is None


def test_a_probe_delay_ends_at_close() -> None:
    runner = FakeRunner({"probe_delay_s": 600})
    runner.load()
    done = threading.Event()

    def probe() -> None:
        runner.probe("p", 1)
        done.set()

    thread = threading.Thread(target=probe)
    thread.start()
    deadline = time.monotonic() + 60
    while not runner.probes:  # the probe started its delay
        assert time.monotonic() < deadline, "the probe never began"
        time.sleep(0.01)
    assert not done.is_set()
    runner.close()
    thread.join(timeout=60)
    assert done.is_set()


def test_weights_digest_is_of_the_version_and_the_salt_makes_workers_disagree(ckpt: Path) -> None:
    one, two, salted = FakeRunner({}), FakeRunner({}), FakeRunner({"digest_salt": "x"})
    for runner in (one, two, salted):
        runner.load()
    first = one.reload_weights(spec("v1", ckpt), ckpt).as_dict()["weights_digest"]
    assert first == hashlib.sha256(b"v1").hexdigest() == fake_weights_digest("v1")
    assert two.reload_weights(spec("v1", ckpt), ckpt).as_dict()["weights_digest"] == first
    other = salted.reload_weights(spec("v1", ckpt), ckpt).weights_digest
    assert other == fake_weights_digest("v1", "x") != first
    assert one.reload_weights(spec("v2", ckpt), ckpt).weights_digest != first


def test_a_reload_result_without_a_digest_has_no_digest_key() -> None:
    stats = LoadStats("v1", 2, 10, 1000, 0.1, 0.2, 0.3, 0.005)
    plain = ReloadResult.of(stats).as_dict()
    assert plain == {
        "version": "v1",
        "files": 2,
        "tensors": 10,
        "bytes": 1000,
        "validate_s": 0.1,
        "copy_s": 0.2,
        "duration_s": 0.3,
        "gbps": 0.005,
    }
    assert ReloadResult.of(stats, weights_digest="ab").as_dict() == {
        **plain,
        "weights_digest": "ab",
    }


def test_a_dry_run_checks_what_a_reload_checks_and_changes_nothing(ckpt: Path) -> None:
    """validate_reload: the path's files and "badshape-*" (WEIGHTS_SHAPE_MISMATCH, as the
    reload gets); "fail-*" and "corrupt-*" fail while applying, which a dry run cannot see.
    Nothing is applied or recorded as a reload."""
    runner = FakeRunner({})
    with pytest.raises(RunnerError) as unloaded:
        runner.validate_reload(spec("v1", ckpt), ckpt)
    assert unloaded.value.code is WireCode.MODEL_NOT_LOADED
    runner.load()
    before = runner.describe()
    assert runner.validate_reload(spec("v1", ckpt), ckpt) == {
        "files": 1,
        "tensors": 0,
        "bytes": 100,
    }
    for version in ("fail-1", "corrupt-1"):
        runner.validate_reload(spec(version, ckpt), ckpt)
    with pytest.raises(RunnerError) as shape:
        runner.validate_reload(spec("badshape-1", ckpt), ckpt)
    assert shape.value.code is WireCode.WEIGHTS_SHAPE_MISMATCH
    with pytest.raises(RunnerError) as missing:
        runner.validate_reload(spec("v1", ckpt.parent / "nope"), ckpt.parent / "nope")
    assert missing.value.code is WireCode.WEIGHTS_UNREADABLE
    assert [s.version for s in runner.validations] == [
        "v1",
        "v1",
        "fail-1",
        "corrupt-1",
        "badshape-1",
        "v1",
    ]
    assert runner.history == ["init"] and runner.reloads == []
    assert runner.describe() == before
    with pytest.raises(RunnerError) as real:
        runner.reload_weights(spec("badshape-1", ckpt), ckpt)
    assert real.value.code is WireCode.WEIGHTS_SHAPE_MISMATCH
    assert runner.history == ["init"] and runner.describe().weights_version == "init"


def test_validate_config_checks_and_changes_nothing() -> None:
    runner = FakeRunner({})
    runner.load()
    before = runner.describe()
    assert runner.validate_config({"top_k": 3, "temperature": 1.0}) == {
        "keys": ["temperature", "top_k"]
    }
    with pytest.raises(RunnerError) as key:
        runner.validate_config({"nope": 1})
    assert key.value.code is WireCode.CONFIG_KEY_REJECTED
    with pytest.raises(RunnerError) as value:
        runner.validate_config({"top_k": "many"})
    assert value.value.code is WireCode.CONFIG_VALUE_INVALID
    assert runner.config_updates == [] and len(runner.config_validations) == 3
    assert runner.describe() == before
