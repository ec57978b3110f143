"""The loader on its own: header checks, name/shape/dtype matching, checksums, tied weights,
progress and cancel, in-place and host-staged copy. Chunked parallel reads and containment are
in test_loaders; the shared tensors in tests/component/conftest.py.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from controlplane.wire.errors import (
    CommandRejected,
    LocalCode,
    RunnerError,
    WeightsCorrupted,
    WireCode,
)
from tests.component.conftest import load, source, targets
from workers.demo.checkpoints import sha256_manifest, write_safetensors
from workers.weights.loaders import module_targets, open_checkpoint


def code_of(
    path: Path, dst: dict[str, torch.Tensor] | None = None, **kw: Any
) -> WireCode | LocalCode:
    dst = dst if dst is not None else targets()
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(RunnerError) as info:
        load(path, dst, **kw)
    assert not isinstance(info.value, WeightsCorrupted)
    assert all(torch.equal(before[k], dst[k]) for k in dst), "a refused reload touched a tensor"
    return info.value.code


def test_reads_files_written_by_the_safetensors_library(tmp_path: Path) -> None:
    src = source()
    save_file({k: v.contiguous() for k, v in src.items()}, str(tmp_path / "m.safetensors"))
    dst = targets()
    pointers = {k: v.data_ptr() for k, v in dst.items()}
    result = load(tmp_path / "m.safetensors", dst)
    assert all(torch.equal(dst[k], src[k]) for k in src)
    assert {k: v.data_ptr() for k, v in dst.items()} == pointers, "copied in place"
    assert (result.tensors, result.files, result.version) == (4, 1, "v1")
    assert result.bytes == 4 * 3 * 4 + 3 * 2 + 8
    assert result.duration_s >= result.copy_s > 0


def test_strided_destination_goes_through_a_host_tensor(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "m.safetensors", {"w": torch.arange(12.0).reshape(3, 4)})
    base = torch.zeros(4, 3)
    dst = {"w": base.t()}  # a non-contiguous view of base
    load(tmp_path / "m.safetensors", dst)
    assert torch.equal(base.t(), torch.arange(12.0).reshape(3, 4))


def header_file(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length"),
    [
        ({"w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}}, b"\0" * 47, None),
        ({"w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 44]}}, b"\0" * 48, None),
        ({"w": {"dtype": "F33", "shape": [4, 3], "data_offsets": [0, 48]}}, b"\0" * 48, None),
        ({"w": {"dtype": "F32", "shape": [4, -3], "data_offsets": [0, 48]}}, b"\0" * 48, None),
        ({"w": {"dtype": "F32", "shape": [True, 3], "data_offsets": [0, 12]}}, b"\0" * 48, None),
        ({"w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [48, 0]}}, b"\0" * 48, None),
        ({"w": {"dtype": "F32", "shape": [4, 3]}}, b"\0" * 48, None),
        ({"w": [1, 2]}, b"", None),
        ([1, 2], b"", None),
        (b"\xff\xfe not utf8", b"", None),
        ({"w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}}, b"\0" * 48, 10**9),
        (
            {
                "w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
                "b": {"dtype": "F32", "shape": [3], "data_offsets": [40, 52]},
            },
            b"\0" * 52,
            None,
        ),
    ],
    ids=[
        "data-short",
        "size-vs-shape",
        "dtype",
        "negative-dim",
        "bool-dim",
        "reversed-offsets",
        "no-offsets",
        "entry-not-object",
        "header-not-object",
        "not-utf8",
        "huge-length",
        "overlap",
    ],
)
def test_insane_headers_are_unreadable(
    tmp_path: Path, header: Any, data: bytes, length: int | None
) -> None:
    path = header_file(tmp_path / "m.safetensors", header, data, length)
    assert (
        code_of(path, {"w": torch.zeros(4, 3), "b": torch.zeros(3)}) is WireCode.WEIGHTS_UNREADABLE
    )


def test_tiny_file_and_duplicate_tensor_across_files(tmp_path: Path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"\1\2\3")
    assert code_of(tmp_path / "short.safetensors") is WireCode.WEIGHTS_UNREADABLE
    both = tmp_path / "dup"
    write_safetensors(both / "a.safetensors", {"w": torch.ones(4, 3)})
    write_safetensors(both / "b.safetensors", {"w": torch.ones(4, 3)})
    assert code_of(both, {"w": torch.zeros(4, 3)}) is WireCode.WEIGHTS_UNREADABLE


def test_index_must_agree_with_the_shards(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "s1.safetensors", {"w": torch.ones(4, 3)})
    write_safetensors(tmp_path / "s2.safetensors", {"b": torch.ones(3)})
    index = tmp_path / "model.safetensors.index.json"
    dst = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    index.write_text(json.dumps({"weight_map": {"w": "s1.safetensors", "b": "s2.safetensors"}}))
    load(index, dst)
    assert torch.equal(dst["w"], torch.ones(4, 3))
    index.write_text(json.dumps({"weight_map": {"w": "s2.safetensors", "b": "s2.safetensors"}}))
    assert code_of(index, dict(dst)) is WireCode.WEIGHTS_UNREADABLE
    # A shard the index does not name is not part of the checkpoint.
    index.write_text(json.dumps({"weight_map": {"w": "s1.safetensors"}}))
    assert code_of(index, dict(dst)) is WireCode.WEIGHTS_MISSING
    write_safetensors(tmp_path / "s1.safetensors", {"w": torch.ones(4, 3), "b": torch.ones(3)})
    assert code_of(index, dict(dst)) is WireCode.WEIGHTS_UNREADABLE  # s1 holds b, index omits it
    index.write_text(json.dumps({"weight_map": {"w": "s1.safetensors", "c": "s1.safetensors"}}))
    assert code_of(index, dict(dst)) is WireCode.WEIGHTS_UNREADABLE


def test_names_shapes_dtypes(tmp_path: Path) -> None:
    src = source()
    path = tmp_path / "m.safetensors"

    write_safetensors(path, {k: v for k, v in src.items() if k != "steps"})
    assert code_of(path) is WireCode.WEIGHTS_MISSING
    write_safetensors(path, {**src, "extra": torch.ones(1)})
    assert code_of(path) is WireCode.WEIGHTS_UNEXPECTED
    assert code_of(path, strict=False) is WireCode.WEIGHTS_UNEXPECTED  # even when not strict
    write_safetensors(path, {**src, "w": torch.ones(3, 4)})
    assert code_of(path) is WireCode.WEIGHTS_SHAPE_MISMATCH
    write_safetensors(path, {**src, "b": src["b"].float()})
    assert code_of(path) is WireCode.WEIGHTS_DTYPE_MISMATCH
    write_safetensors(path, {})
    assert code_of(path, strict=False) is WireCode.WEIGHTS_MISSING  # nothing at all to load


def test_messages_name_the_first_few_offenders(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {})
    dst = {f"layer{i}.w": torch.zeros(1) for i in range(9)}
    with pytest.raises(RunnerError) as info:
        load(path, dst)
    assert "layer0.w, layer1.w, layer2.w, layer3.w, layer4.w and 4 more" in info.value.message


def test_non_strict_partial_reload(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"w": torch.ones(4, 3)})
    dst = targets()
    result = load(path, dst, strict=False)
    assert result.tensors == 1 and torch.equal(dst["w"], torch.ones(4, 3))
    assert torch.equal(dst["steps"], torch.tensor(0))


def test_sha256_manifest(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, source())
    good = sha256_manifest(path)
    assert list(good) == ["m.safetensors"]
    load(path, targets(), sha256=good)
    wrong = {"m.safetensors": "0" * 64}
    assert code_of(path, sha256=wrong) is WireCode.CHECKSUM_MISMATCH
    # Every data file must be covered; a listed file that is not there is unreadable.
    assert code_of(path, sha256={"other.safetensors": "0" * 64}) is WireCode.CHECKSUM_MISMATCH
    assert code_of(path, sha256={**good, "config.json": "0" * 64}) is WireCode.WEIGHTS_UNREADABLE
    (tmp_path / "config.json").write_text("{}")
    import hashlib

    extra = {**good, "config.json": hashlib.sha256(b"{}").hexdigest()}
    load(path, targets(), sha256=extra)
    with pytest.raises(CommandRejected) as info:
        load(path, targets(), sha256={**good, "../m.safetensors": "0" * 64})
    assert info.value.code is WireCode.PATH_NOT_ALLOWED


def test_tied_weights_load_once_under_either_name(tmp_path: Path) -> None:
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(5, 2)
    model.head = torch.nn.Linear(2, 5, bias=False)
    model.head.weight = model.emb.weight
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    dst, aliases = module_targets(model)
    assert list(dst) == ["emb.weight"] and aliases == {"head.weight": "emb.weight"}
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"head.weight": torch.ones(5, 2)})  # only the alias
    load(path, dst, aliases=aliases)
    assert torch.equal(model.emb.weight, torch.ones(5, 2))
    write_safetensors(
        path, {"emb.weight": torch.full((5, 2), 2.0), "head.weight": torch.ones(5, 2)}
    )
    load(path, dst, aliases=aliases)
    assert torch.equal(model.head.weight, torch.full((5, 2), 2.0))  # the canonical name wins


def test_progress_and_cancel(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, source())
    seen: list[tuple[int, int]] = []
    load(path, targets(), progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]

    cancel = threading.Event()
    cancel.set()
    assert code_of(path, cancel=cancel) is WireCode.COMMAND_TIMEOUT
    assert code_of(path, cancel=cancel, sha256=sha256_manifest(path)) is WireCode.COMMAND_TIMEOUT

    cancel = threading.Event()

    def cancel_after_first(done: int, total: int) -> None:
        if done == 1:
            cancel.set()

    with pytest.raises(WeightsCorrupted) as info:  # one reader: no chunk is read ahead
        load(path, targets(), cancel=cancel, progress=cancel_after_first, read_threads=1)
    assert (info.value.from_version, info.value.to_version) == ("v0", "v1")
    assert info.value.code is WireCode.WEIGHTS_CORRUPTED and "1 of 4" in info.value.message


def test_truncation_after_copy_began_is_a_short_read_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, source())
    with open_checkpoint(path) as ckpt:
        first_end = min(e.offset + e.nbytes for e in ckpt.entries.values() if e.nbytes)

    def truncate(done: int, total: int) -> None:
        if done == 1:
            os.truncate(path, first_end)

    dst = targets()
    with pytest.raises(WeightsCorrupted) as info:  # one reader: no chunk is read ahead
        load(path, dst, progress=truncate, read_threads=1)
    assert "ended inside tensor" in info.value.message


def test_host_staged_copies_flush_every_staging_budget(tmp_path: Path) -> None:
    # Tensors copied through a host tensor (XLA, strided) call sync once per budget, then at the end.
    src = {f"w{i}": torch.full((512, 512), float(i)) for i in range(3)}  # 1 MiB each
    write_safetensors(tmp_path / "m.safetensors", src)
    bases = {k: torch.zeros(512, 512) for k in src}
    dst = {k: v.t() for k, v in bases.items()}  # strided: the host path
    syncs: list[int] = []
    load(
        tmp_path / "m.safetensors", dst, staging_bytes=2 * 1024 * 1024, sync=lambda: syncs.append(1)
    )
    assert len(syncs) == 2  # one after 2 MiB pending, one at the end
    assert all(torch.equal(bases[k].t(), src[k]) for k in src)
