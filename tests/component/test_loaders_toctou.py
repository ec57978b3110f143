"""The bytes that decide what is loaded are the bytes hashed: a header or an index changed in place
after the signature was checked, parsed by the worker, then changed back to the signed bytes
before they would be read a second time, is refused (the parsed bytes are what is hashed).

The attacker writes the checkpoint's storage (the same files, so the open descriptors see every
change); the signed bytes are put back right after the worker parsed them, before the loader's
next step.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import workers.weights.loaders as loaders
from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.test_loaders_verified import (
    SERIALIZATIONS,
    SHARD,
    By,
    checkpoint,
    keys,
    plain_runner,
    runner,
    same,
    signed,
    state,
    tensor_offset,
    weights,
)
from workers.runners.torch_runner import TorchRunner
from workers.weights.loaders import load_checkpoint
from workers.weights.oms import load_model_trust, sign_checkpoint
from workers.weights.verify import CopiedBytesMismatch

pytest.importorskip("model_signing", reason="the [verify] extra is not installed")

__all__ = ["keys"]  # the fixture, used by name


def swap_two_tensors(file: Path) -> bytes:
    """Give two tensors of the same dtype and shape each other's bytes, by swapping their offsets
    in the header (same length: the file's size and layout do not change). Returns the header
    bytes as they were, for restoring them."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    signed_header = raw[8 : 8 + length]
    header = json.loads(signed_header)
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = (info["dtype"], tuple(info["shape"]))
        if kind in seen:
            first = header[seen[kind]]
            first["data_offsets"], info["data_offsets"] = (
                info["data_offsets"],
                first["data_offsets"],
            )
            break
        seen[kind] = name
    else:
        raise AssertionError(f"{file.name} has no two tensors of one shape")
    evil = json.dumps(header, separators=(",", ":")).encode()
    assert len(evil) <= length
    with open(file, "r+b") as fh:
        fh.seek(8)
        fh.write(evil.ljust(length, b" "))
    return signed_header


def restore_before(
    step: str, monkeypatch: pytest.MonkeyPatch, restore: Callable[[], object]
) -> list[int]:
    """Put the signed bytes back just before the loader's ``step`` (``check_index``: the index
    and every header were parsed; ``plan_copy``: and the index checked), the first time only
    (a restore of the previous checkpoint runs it again). Returns a list that records it."""
    done: list[int] = []
    original = getattr(loaders, step)

    def then_step(*args: Any, **kwargs: Any) -> Any:
        if not done:
            restore()
            done.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(loaders, step, then_step)
    return done


def header_restorer(file: Path, signed_header: bytes) -> Callable[[], object]:
    def restore() -> None:
        with open(file, "r+b") as fh:
            fh.seek(8)
            fh.write(signed_header)

    return restore


def refused_and_kept(
    made: TorchRunner, path: Path, restored: list[int], **spec: Any
) -> RunnerError:
    before, v1_state = weights(made), state(made)
    with pytest.raises(RunnerError) as caught:
        made.reload_weights(ReloadWeightsSpec(path=str(path), version="v2", **spec), path)
    assert restored, "the signed bytes were never put back"
    assert caught.value.code in (WireCode.CHECKSUM_MISMATCH, WireCode.MODEL_SIGNATURE_INVALID)
    assert state(made) == v1_state
    assert same(weights(made), before)
    return caught.value


@SERIALIZATIONS
@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "last-of-3-shards"])
def test_a_header_swapped_then_restored_after_parsing_is_refused(
    tmp_path: Path,
    keys: dict[str, tuple[Path, Path]],
    monkeypatch: pytest.MonkeyPatch,
    by: By,
    shards: int,
) -> None:
    """The reviewer's attack: a signed file's tensors swapped in its header, the signed header
    back once parsed. With shards, the last one's header (hashed last, after the others'
    tensors are copied: the widest window)."""
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private, shard_bytes=by), public)
    v2 = signed(tmp_path, "v2", 2, private, shards=shards, shard_bytes=by)
    target = sorted(v2.parent.glob("*.safetensors"))[-1]
    restored = restore_before(
        "plan_copy", monkeypatch, header_restorer(target, swap_two_tensors(target))
    )
    refused = refused_and_kept(made, v2, restored)
    assert isinstance(refused.__cause__, CopiedBytesMismatch)
    assert "'v1' was restored" in refused.message


def test_an_index_edited_then_restored_after_parsing_is_refused(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index edited to name only the first shard (a non-strict reload would then load half
    of v2 over v1), the signed index back once parsed: refused before anything is copied."""
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    index = signed(tmp_path, "v2", 2, private, shards=2)
    signed_index = index.read_bytes()
    content = json.loads(signed_index)
    first = min(content["weight_map"].values())
    content["weight_map"] = {t: f for t, f in content["weight_map"].items() if f == first}
    evil = json.dumps(content).encode()
    assert len(evil) < len(signed_index)
    index.write_bytes(evil.ljust(len(signed_index), b" "))  # the signed size
    restored = restore_before("check_index", monkeypatch, lambda: index.write_bytes(signed_index))
    refused = refused_and_kept(made, index, restored, strict=False)
    assert refused.code == WireCode.CHECKSUM_MISMATCH
    assert "differs from the signed one" in refused.message
    assert not isinstance(refused.__cause__, CopiedBytesMismatch)  # found before copying


@pytest.mark.parametrize("restorable", [True, False], ids=["hashed-as-copied", "seeded"])
def test_the_commands_sha256_hashes_the_header_it_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restorable: bool
) -> None:
    """The same attack against the command's sha256 manifest: hashed as copied (v1 restored),
    or, for seeded weights, before copying (nothing written)."""
    from workers.demo.checkpoints import sha256_manifest

    made = plain_runner(checkpoint(tmp_path, "v1", 1) if restorable else None)
    v2 = checkpoint(tmp_path, "v2", 2)
    manifest = sha256_manifest(v2)
    restored = restore_before("plan_copy", monkeypatch, header_restorer(v2, swap_two_tensors(v2)))
    refused = refused_and_kept(made, v2, restored, sha256=manifest)
    assert refused.code == WireCode.CHECKSUM_MISMATCH
    assert isinstance(refused.__cause__, CopiedBytesMismatch) == restorable
    assert made.describe().degraded is None


@pytest.mark.parametrize(
    "where",
    ["cpu-strided", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("by", [SHARD, None, "blake3"], ids=["shards", "files", "blake3"])
def test_a_tensor_read_into_a_device_or_strided_destination_is_hashed_as_it_arrived(
    tmp_path: Path,
    keys: dict[str, tuple[Path, Path]],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    by: By,
) -> None:
    """Destinations the copy does not read straight into (a device, a strided tensor) are hashed
    from what they hold, not from a second read of the file: a tensor's bytes changed for the
    read that copied it, then changed back, are found."""
    import workers.weights.copy as copy_engine

    private, public = keys["trusted"]
    directory = tmp_path / "v2"
    directory.mkdir()
    path = directory / "model.safetensors"
    save_file({"a": torch.full((8, 64), 1.0), "b": torch.full((64,), 2.0)}, str(path))
    if by == "blake3":
        sign_checkpoint(directory, private, algorithm="blake3")
    else:
        sign_checkpoint(directory, private, shard_bytes=by)
    device = torch.device("cuda" if where == "cuda" else "cpu")
    a = torch.zeros((64, 8), device=device).t()  # strided on the CPU
    if where == "cuda":
        a = torch.zeros((8, 64), device=device)
    targets = {"a": a, "b": torch.zeros(64, device=device)}
    read_exact = copy_engine.read_exact
    changed: list[int] = []

    def changed_for_the_copy(fd: int, buf: memoryview, entry: Any, start: int = 0) -> None:
        if entry.name != "a":
            return read_exact(fd, buf, entry, start)
        signed_bytes = os.pread(fd, entry.nbytes, entry.offset)
        with open(path, "r+b") as fh:
            fh.seek(entry.offset)
            fh.write(bytes(b ^ 0x55 for b in signed_bytes))
            fh.flush()
            try:
                read_exact(fd, buf, entry, start)
            finally:
                fh.seek(entry.offset)
                fh.write(signed_bytes)
        changed.append(1)
        return None

    monkeypatch.setattr(copy_engine, "read_exact", changed_for_the_copy)
    trust = load_model_trust([public], required=True)
    with pytest.raises(CopiedBytesMismatch):
        load_checkpoint(
            path, targets, version="v2", from_version="v1", model_trust=trust, read_threads=1
        )
    assert changed, "the copy never read tensor 'a'"


def test_seeded_weights_hash_the_commands_sha256_again_as_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded weights check the manifest before copying (nothing written if it is wrong), and
    the bytes copied again as copied: a tensor changed after the last check, as the copy
    begins, is found (degraded: there is nothing to restore), not loaded as if it had been
    checked. (A change before the copy begins is refused untouched: test_reload_phases.py,
    test_seeded_weights_changed_while_draining_are_refused_untouched.)"""
    from workers.demo.checkpoints import sha256_manifest

    made = plain_runner(None)
    v2 = checkpoint(tmp_path, "v2", 2)
    manifest = sha256_manifest(v2)
    changed: list[int] = []
    copy_plan = loaders.copy_plan

    def change_then_copy(*args: Any, **kwargs: Any) -> None:
        fd = os.open(v2, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xde\xad", tensor_offset(v2, -1) + 3)
        finally:
            os.close(fd)
        changed.append(1)
        copy_plan(*args, **kwargs)

    monkeypatch.setattr(loaders, "copy_plan", change_then_copy)
    with pytest.raises(WeightsCorrupted) as caught:
        made.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2", sha256=manifest), v2)
    assert changed
    assert isinstance(caught.value, CopiedBytesMismatch)
    assert made.describe().degraded is not None
    assert made.describe().weights_version != "v2"


def test_seeded_signed_bytes_changed_after_the_checks_are_refused_untouched(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded weights (nothing to restore) and a signed checkpoint: its signed bytes are hashed
    before the drain, and a tensor changed after that, before the copy begins, is refused
    (CHECKSUM_MISMATCH) with the model untouched, not copied and found as copied (degraded)."""
    private, public = keys["trusted"]
    made = runner(None, public)
    v2 = signed(tmp_path, "v2", 2, private)
    before, seeded = weights(made), state(made)
    changed: list[int] = []
    check_sizes = loaders.PreparedCheckpoint._check_sizes

    def change_then_check(self: loaders.PreparedCheckpoint) -> None:
        with open(v2, "r+b") as fh:
            fh.seek(tensor_offset(v2, -1) + 3)
            fh.write(b"\xde\xad")
        changed.append(1)
        check_sizes(self)

    monkeypatch.setattr(loaders.PreparedCheckpoint, "_check_sizes", change_then_check)
    with pytest.raises(RunnerError) as caught:
        made.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2"), v2)
    assert changed
    assert not isinstance(caught.value, WeightsCorrupted)
    assert caught.value.code is WireCode.CHECKSUM_MISMATCH
    assert state(made) == seeded and seeded[1] is None
    assert same(weights(made), before)


@pytest.mark.parametrize("quiet", [True, False], ids=["quiet-files", "just-written"])
def test_seeded_copy_hashes_again_unless_no_file_can_have_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet: bool
) -> None:
    """What keeps a seeded worker's pause short: the manifest hashed while serving is not hashed
    again inside the drain when every file's fstat proves it unchanged (its ctime older than
    ``QUIET_S`` before it was opened, the same now); a file written just before is hashed
    again before the first write."""
    from workers.demo.checkpoints import sha256_manifest

    made = plain_runner(None)
    v2 = checkpoint(tmp_path, "v2", 2)
    if quiet:  # as if v2 had been written long ago (its ctime is before the open's clock)
        monkeypatch.setattr(loaders, "QUIET_S", 0.0)
    hashed_in_copy: list[int] = []
    verify_bytes = loaders.PreparedCheckpoint.verify_bytes
    copy = loaders.PreparedCheckpoint.copy

    def counting(self: loaders.PreparedCheckpoint, *args: Any, **kwargs: Any) -> None:
        hashed_in_copy.append(1)
        verify_bytes(self, *args, **kwargs)

    def copy_counting(self: loaders.PreparedCheckpoint, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(loaders.PreparedCheckpoint, "verify_bytes", counting)
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(loaders.PreparedCheckpoint, "copy", copy_counting)
    spec = ReloadWeightsSpec(path=str(v2), version="v2", sha256=sha256_manifest(v2))
    made.reload_weights(spec, v2)
    assert made.describe().weights_version == "v2"
    assert hashed_in_copy == ([] if quiet else [1])
