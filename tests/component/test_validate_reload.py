"""Dry runs on the torch and XLA runners (``validate_reload`` / ``validate_config``): every check
a reload or config update makes before it would change anything, with the code it would get, and
nothing changed: the same tensors, version, digest and config, and requests served throughout.

Real torch modules and checkpoints written by the project; every broken kind of
``workers.demo.checkpoints`` (the damage in the last tensor), a command's sha256 manifest that
a reload of restorable weights checks only as it copies, and signed checkpoints whose bytes
differ from the signature (also checked only as copied by a reload).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import TINY, MakeCheckpoint, MakeRunner
from tests.component.test_loaders_verified import keys, signed, tensor_offset
from workers.demo.checkpoints import BrokenKind, sha256_manifest, write_broken
from workers.runners.torch_runner import TorchRunner

__all__ = ["keys"]  # the fixture, used by name


def weights(runner: TorchRunner) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in runner._targets.items()}


def unchanged(runner: TorchRunner, before: dict[str, torch.Tensor], facts: Any) -> None:
    """The model holds exactly ``before``, and describes itself as ``facts`` did."""
    after = weights(runner)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in after)
    described = runner.describe()
    assert (described.weights_version, described.degraded, described.config_digest) == facts[:3]
    assert described.extra["weights_digest"] == facts[3]
    assert described.extra["last_reload"] == facts[4]
    assert described.extra["phase"] == "idle"


def facts_of(runner: TorchRunner) -> tuple[Any, ...]:
    d = runner.describe()
    return (
        d.weights_version,
        d.degraded,
        d.config_digest,
        d.extra["weights_digest"],
        d.extra["last_reload"],
    )


def reload_spec(path: Path, version: str = "v2", **more: Any) -> ReloadWeightsSpec:
    return ReloadWeightsSpec(path=str(path), version=version, **more)


def test_a_good_checkpoint_validates_and_nothing_changes(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    """Facts of what was checked; the weights, version, digest and outputs as before."""
    runner = make_runner(initial_checkpoint=str(make_checkpoint(1)), initial_version="v1")
    v2 = make_checkpoint(2, shards=2)
    out_before = runner.generate("Hello")
    before, described = weights(runner), facts_of(runner)
    facts = runner.validate_reload(reload_spec(v2, sha256=sha256_manifest(v2)), v2)
    assert facts["files"] == 2 and facts["tensors"] == len(before)
    assert facts["bytes"] == sum(t.numel() * t.element_size() for t in before.values())
    assert facts["sha256"] is True and facts["signed"] is False
    unchanged(runner, before, described)
    assert runner.generate("Hello") == out_before
    # And the real reload of the same spec then applies it (the dry run left nothing held).
    runner.reload_weights(reload_spec(v2, sha256=sha256_manifest(v2)), v2)
    assert runner.describe().weights_version == "v2"


@pytest.mark.parametrize("kind", list(BrokenKind), ids=[k.value for k in BrokenKind])
@pytest.mark.parametrize("restorable", [True, False], ids=["restorable", "seeded"])
def test_a_dry_run_refuses_with_the_code_the_reload_gets(
    make_runner: MakeRunner,
    make_checkpoint: MakeCheckpoint,
    tmp_path: Path,
    kind: BrokenKind,
    restorable: bool,
) -> None:
    """Every broken kind: the dry run's code is the one the real reload then gets, and the dry
    run changed nothing. With restorable weights a reload checks the manifest only as it
    copies (then restores): the dry run still finds it without copying."""
    options: dict[str, Any] = {}
    if restorable:
        options = {"initial_checkpoint": str(make_checkpoint(1)), "initial_version": "v1"}
    runner = make_runner(**options)
    broken = write_broken(kind, tmp_path / kind.value, model_kwargs=TINY, seed=9)
    spec = reload_spec(broken.path, sha256=broken.sha256)
    before, described = weights(runner), facts_of(runner)
    with pytest.raises(RunnerError) as dry:
        runner.validate_reload(spec, broken.path)
    assert dry.value.code is broken.code
    unchanged(runner, before, described)
    with pytest.raises(RunnerError) as real:
        runner.reload_weights(spec, broken.path)
    assert real.value.code is dry.value.code


@pytest.mark.parametrize("by", [4096, "blake3"], ids=["shards", "blake3"])
def test_a_signed_checkpoint_whose_bytes_differ_is_refused_without_copying(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], by: int | str
) -> None:
    """A reload hashes a signed checkpoint's tensors as it copies them (and restores on a
    difference); a dry run hashes them from the file: CHECKSUM_MISMATCH, the model untouched.
    An unsigned checkpoint where one is required: MODEL_SIGNATURE_MISSING, as for a reload."""
    private, public = keys["trusted"]
    v1 = signed(tmp_path, "v1", 1, private, shard_bytes=by)  # type: ignore[arg-type]
    runner = TorchRunner(
        {
            "model_kwargs": TINY,
            "seed": 0,
            "initial_checkpoint": str(v1),
            "initial_version": "v1",
            "model_trust": [str(public)],
            "require_model_signature": True,
        }
    )
    runner.load()
    try:
        v2 = signed(tmp_path, "v2", 2, private, shard_bytes=by)  # type: ignore[arg-type]
        assert runner.validate_reload(reload_spec(v2), v2)["signed"] is True
        fd = os.open(v2, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xde\xad", tensor_offset(v2, -1) + 3)
        finally:
            os.close(fd)
        before, described = weights(runner), facts_of(runner)
        with pytest.raises(RunnerError) as dry:
            runner.validate_reload(reload_spec(v2), v2)
        assert dry.value.code is WireCode.CHECKSUM_MISMATCH
        assert "differ from the signed ones" in dry.value.message
        unchanged(runner, before, described)
        with pytest.raises(RunnerError) as real:
            runner.reload_weights(reload_spec(v2), v2)
        assert real.value.code is WireCode.CHECKSUM_MISMATCH

        plain = tmp_path / "plain"
        plain_path = signed(tmp_path, "plain", 3, private)
        (plain / "model.sig").unlink()
        with pytest.raises(RunnerError) as unsigned:
            runner.validate_reload(reload_spec(plain_path), plain_path)
        assert unsigned.value.code is WireCode.MODEL_SIGNATURE_MISSING
    finally:
        runner.close()


def test_a_dry_run_with_no_model_loaded_is_model_not_loaded(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    runner = make_runner(load=False)
    v2 = make_checkpoint(2)
    with pytest.raises(RunnerError) as caught:
        runner.validate_reload(reload_spec(v2), v2)
    assert caught.value.code is WireCode.MODEL_NOT_LOADED


def test_a_dry_run_is_cancelled_by_its_commands_cancel(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    """The command's cancel (its timeout, a shutdown) ends a dry run while it hashes."""
    runner = make_runner()
    v2 = make_checkpoint(2)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RunnerError) as caught:
        runner.validate_reload(reload_spec(v2, sha256=sha256_manifest(v2)), v2, cancel=cancel)
    assert caught.value.code is WireCode.COMMAND_TIMEOUT
    assert runner.describe().weights_version == "init"


def test_validate_config_checks_keys_and_values_and_changes_nothing(
    make_runner: MakeRunner,
) -> None:
    runner = make_runner()
    before = runner.describe()
    assert runner.validate_config({"top_k": 5, "temperature": 0.5}) == {
        "keys": ["temperature", "top_k"]
    }
    with pytest.raises(RunnerError) as key:
        runner.validate_config({"nope": 1})
    assert key.value.code is WireCode.CONFIG_KEY_REJECTED
    with pytest.raises(RunnerError) as value:
        runner.validate_config({"top_k": -1})
    assert value.value.code is WireCode.CONFIG_VALUE_INVALID
    after = runner.describe()
    assert (after.config, after.config_digest) == (before.config, before.config_digest)
