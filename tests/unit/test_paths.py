"""Allowed-root checks and checkpoint file discovery (no torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from controlplane.wire.errors import CommandRejected, RunnerError, WireCode
from workers.weights.paths import checkpoint_files, relative_member, resolve_weights_path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "weights"
    (root / "ckpt").mkdir(parents=True)
    (root / "ckpt" / "model.safetensors").write_bytes(b"x")
    return root


def rejected(path: str, roots: list[Path]) -> CommandRejected:
    with pytest.raises(CommandRejected) as info:
        resolve_weights_path(path, roots)
    assert info.value.code is WireCode.PATH_NOT_ALLOWED
    assert info.value.is_rejection
    return info.value


def test_a_path_inside_a_root_resolves(root: Path) -> None:
    assert resolve_weights_path(str(root / "ckpt"), [root]) == (root / "ckpt").resolve()
    # Not existing yet is fine here: the runner reports WEIGHTS_UNREADABLE later.
    assert resolve_weights_path(str(root / "later"), [root]) == (root / "later").resolve()
    assert resolve_weights_path(str(root), [root]) == root.resolve()


def test_dotdot_escape_is_rejected(root: Path, tmp_path: Path) -> None:
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    error = rejected(str(root / "ckpt" / ".." / ".." / "secret.safetensors"), [root])
    assert "outside the allowed roots" in error.message
    # A `..` that stays inside is fine.
    inside = resolve_weights_path(str(root / "ckpt" / ".." / "ckpt" / "model.safetensors"), [root])
    assert inside == (root / "ckpt" / "model.safetensors").resolve()


def test_symlink_escape_is_rejected(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    os.symlink(outside, root / "link-out")
    os.symlink(outside / "model.safetensors", root / "file-link.safetensors")
    rejected(str(root / "link-out" / "model.safetensors"), [root])
    rejected(str(root / "file-link.safetensors"), [root])


def test_symlink_staying_inside_and_symlinked_root_are_fine(root: Path, tmp_path: Path) -> None:
    os.symlink(root / "ckpt", root / "latest")
    assert resolve_weights_path(str(root / "latest"), [root]) == (root / "ckpt").resolve()
    alias = tmp_path / "alias-root"
    os.symlink(root, alias)
    assert resolve_weights_path(str(alias / "ckpt"), [alias]) == (root / "ckpt").resolve()


def test_sibling_with_a_common_prefix_is_outside(root: Path, tmp_path: Path) -> None:
    rejected(str(tmp_path / "weights-evil" / "x.safetensors"), [root])


def test_no_roots_allows_nothing_and_relative_paths_are_refused(root: Path) -> None:
    error = rejected(str(root / "ckpt"), [])
    assert "no weights root" in error.message
    rejected("weights/ckpt", [root])
    rejected(str(root / "ckpt") + "\x00", [root])


def test_any_of_several_roots(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    assert resolve_weights_path(str(other / "a"), [root, other]) == (other / "a").resolve()


def unreadable(path: Path) -> RunnerError:
    with pytest.raises(RunnerError) as info:
        checkpoint_files(path)
    assert info.value.code is WireCode.WEIGHTS_UNREADABLE
    return info.value


def test_single_file_and_directory(tmp_path: Path) -> None:
    for name in ("b.safetensors", "a.safetensors", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    one = checkpoint_files(tmp_path / "b.safetensors")
    assert one.files == [tmp_path / "b.safetensors"] and one.base_dir == tmp_path
    assert one.weight_map is None
    listing = checkpoint_files(tmp_path)
    assert listing.files == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_index_json(tmp_path: Path) -> None:
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(
        json.dumps(
            {
                "metadata": {"total_size": 8},
                "weight_map": {
                    "b": "model-00002-of-00002.safetensors",
                    "a": "model-00001-of-00002.safetensors",
                },
            }
        )
    )
    found = checkpoint_files(index)
    assert [f.name for f in found.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert found.weight_map == {
        "a": tmp_path / "model-00001-of-00002.safetensors",
        "b": tmp_path / "model-00002-of-00002.safetensors",
    }
    assert found.metadata == {"total_size": 8}
    # A directory holding one index uses it; two are ambiguous.
    assert checkpoint_files(tmp_path).index == index
    (tmp_path / "other.safetensors.index.json").write_text(index.read_text())
    assert "several indexes" in unreadable(tmp_path).message


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"metadata": {}}),
        json.dumps({"weight_map": {}}),
        json.dumps({"weight_map": {"a": 3}}),
        json.dumps({"weight_map": {"a": "absent.safetensors"}}),
        json.dumps({"metadata": "no", "weight_map": {"a": "x.safetensors"}}),
    ],
)
def test_bad_index_is_unreadable(tmp_path: Path, content: str) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"x")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    unreadable(index)


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/passwd", "a/../../b.safetensors"])
def test_index_naming_files_outside_the_checkpoint_is_refused(tmp_path: Path, name: str) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": name}}))
    with pytest.raises(CommandRejected) as info:
        checkpoint_files(index)
    assert info.value.code is WireCode.PATH_NOT_ALLOWED


def test_missing_and_non_checkpoint_paths_are_unreadable(tmp_path: Path) -> None:
    unreadable(tmp_path / "nope.safetensors")
    unreadable(tmp_path / "nope.safetensors.index.json")
    (tmp_path / "empty").mkdir()
    assert "holds no" in unreadable(tmp_path / "empty").message
    (tmp_path / "weights.bin").write_bytes(b"x")
    unreadable(tmp_path / "weights.bin")


def test_relative_member() -> None:
    base = Path("/base")
    assert relative_member(base, "sub/x.safetensors", "file") == Path("/base/sub/x.safetensors")
    assert relative_member(base, "./x", "file") == Path("/base/x")
    for bad in ("", "..", "a/../../x", "/abs", "a\\b"):
        with pytest.raises(CommandRejected):
            relative_member(base, bad, "file")


# --------------------------------------------------------------------------- every file contained


def not_allowed(path: Path, roots: list[Path] | None = None) -> CommandRejected:
    with pytest.raises(CommandRejected) as info:
        checkpoint_files(path, roots)
    assert info.value.code is WireCode.PATH_NOT_ALLOWED
    return info.value


def test_a_symlinked_shard_in_a_directory_must_stay_inside_the_roots(
    root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not yours")
    ckpt = root / "ckpt"
    (ckpt / "evil.safetensors").symlink_to(outside)
    checked = resolve_weights_path(str(ckpt), [root])
    assert "outside" in not_allowed(checked).message  # the roots come with the checked path
    not_allowed(ckpt, [root])
    not_allowed(ckpt)  # no roots known: the checkpoint's own directory


def test_a_symlinked_shard_named_by_an_index_must_stay_inside_the_roots(
    root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model-00002-of-00002.safetensors").write_bytes(b"y")
    ckpt = root / "ckpt"
    (ckpt / "model-00002-of-00002.safetensors").symlink_to(
        outside / "model-00002-of-00002.safetensors"
    )
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    index = ckpt / "model.safetensors.index.json"
    index.write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
        )
    )  # fmt: skip
    not_allowed(resolve_weights_path(str(index), [root]))
    not_allowed(resolve_weights_path(str(ckpt), [root]))  # the directory's index
    # The index itself, linked from outside, is refused the same way.
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(b"y")
    assert checkpoint_files(index, [root]).index == index
    index.rename(outside / "model.safetensors.index.json")
    index.symlink_to(outside / "model.safetensors.index.json")
    not_allowed(index, [root])


def test_symlinks_inside_the_roots_are_followed_and_recorded(root: Path) -> None:
    # The Hugging Face cache layout: snapshots/<rev>/model.safetensors -> ../../blobs/<sha>.
    blobs, snapshot = root / "blobs", root / "snapshots" / "rev1"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    (blobs / "abc123").write_bytes(b"x")
    (snapshot / "model.safetensors").symlink_to("../../blobs/abc123")
    found = checkpoint_files(resolve_weights_path(str(snapshot), [root]))
    assert found.files == [snapshot / "model.safetensors"]
    member = found.members[snapshot / "model.safetensors"]
    assert member.real == (blobs / "abc123").resolve()
    assert (member.dev, member.ino) == (
        os.stat(blobs / "abc123").st_dev,
        os.stat(blobs / "abc123").st_ino,
    )
    # Without the roots only the snapshot directory is allowed: the blob is outside it.
    not_allowed(snapshot)


def test_dangling_links_and_directories_are_not_shards(root: Path) -> None:
    ckpt = root / "ckpt"
    (ckpt / "gone.safetensors").symlink_to(ckpt / "nothing-here")
    (ckpt / "dir.safetensors").mkdir()
    assert checkpoint_files(ckpt, [root]).files == [ckpt / "model.safetensors"]
