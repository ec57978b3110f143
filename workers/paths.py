"""Where weights may come from: allowed-root checks and the list of a checkpoint's files.

No torch and no tensor data here: only paths, directory listings and the small index json.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from controlplane.errors import CommandRejected, ErrorCode, RunnerError

INDEX_SUFFIX = ".index.json"
SAFETENSORS_SUFFIX = ".safetensors"
#: An index json larger than this is refused unread (a 70B model's index is ~100 KiB).
MAX_INDEX_BYTES = 64 * 1024 * 1024


def resolve_weights_path(path: str, allowed_roots: Sequence[Path]) -> Path:
    """``path`` with symlinks and ``..`` resolved, if it lies inside one of ``allowed_roots``.

    Relative paths are refused (a fleet command cannot know a worker's working directory), and so
    is everything when ``allowed_roots`` is empty. Raises CommandRejected(PATH_NOT_ALLOWED).
    """
    if not allowed_roots:
        raise CommandRejected(
            "no weights root is allowed on this worker", code=ErrorCode.PATH_NOT_ALLOWED
        )
    if "\x00" in path:
        raise CommandRejected("path contains a NUL byte", code=ErrorCode.PATH_NOT_ALLOWED)
    candidate = Path(path)
    if not candidate.is_absolute():
        raise CommandRejected(
            f"weights path {path!r} must be absolute", code=ErrorCode.PATH_NOT_ALLOWED
        )
    try:
        resolved = candidate.resolve(strict=False)
        roots = [Path(root).resolve(strict=False) for root in allowed_roots]
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on Python < 3.13
        raise CommandRejected(
            f"cannot resolve weights path {path!r}: {exc}", code=ErrorCode.PATH_NOT_ALLOWED
        ) from None
    if any(resolved.is_relative_to(root) for root in roots):
        return resolved
    raise CommandRejected(
        f"weights path {path!r} resolves to {str(resolved)!r}, outside the allowed roots "
        f"{[str(r) for r in roots]}",
        code=ErrorCode.PATH_NOT_ALLOWED,
    )


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint's data files, sorted, and the index's tensor -> file map when there is one."""

    base_dir: Path
    files: list[Path]
    weight_map: dict[str, Path] | None = None
    index: Path | None = None
    metadata: dict[str, object] | None = None


def checkpoint_files(path: Path) -> CheckpointFiles:
    """The files of the checkpoint at ``path``: a .safetensors file, a directory, or an index json.

    A directory holding one index json uses it (several are ambiguous: refused); otherwise it
    means every ``*.safetensors`` file in it.
    Raises RunnerError(WEIGHTS_UNREADABLE) when nothing readable is there.
    """
    try:
        if path.is_dir():
            indexes = sorted(path.glob(f"*{SAFETENSORS_SUFFIX}{INDEX_SUFFIX}"))
            if len(indexes) > 1:
                names = [p.name for p in indexes]
                raise _unreadable(
                    f"directory {str(path)!r} holds several indexes {names}; name one"
                )
            if indexes:
                return _from_index(indexes[0])
            files = sorted(p for p in path.glob(f"*{SAFETENSORS_SUFFIX}") if p.is_file())
            if not files:
                raise _unreadable(f"directory {str(path)!r} holds no *{SAFETENSORS_SUFFIX} file")
            return CheckpointFiles(base_dir=path, files=files)
        if path.name.endswith(INDEX_SUFFIX):
            return _from_index(path)
        if path.is_file():
            if path.suffix != SAFETENSORS_SUFFIX:
                raise _unreadable(
                    f"{str(path)!r} is neither a {SAFETENSORS_SUFFIX} file nor an index"
                )
            return CheckpointFiles(base_dir=path.parent, files=[path])
        raise _unreadable(f"checkpoint {str(path)!r} does not exist or is not a regular file")
    except OSError as exc:
        raise _unreadable(f"cannot list checkpoint {str(path)!r}: {exc}") from None


def relative_member(base_dir: Path, name: str, what: str) -> Path:
    """``base_dir / name`` for a plain relative ``name``; refuses absolute names and ``..``."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\x00" in name or "\\" in name:
        raise CommandRejected(
            f"{what} {name!r} must be a plain relative name inside the checkpoint",
            code=ErrorCode.PATH_NOT_ALLOWED,
        )
    return base_dir / pure


def _from_index(index: Path) -> CheckpointFiles:
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise _unreadable(f"index {str(index)!r} is larger than {MAX_INDEX_BYTES} bytes")
        raw = json.loads(index.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _unreadable(f"cannot read index {str(index)!r}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise _unreadable(f"index {str(index)!r} has no 'weight_map' object")
    metadata = raw.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _unreadable(f"index {str(index)!r}: 'metadata' must be an object")
    base = index.parent
    weight_map: dict[str, Path] = {}
    for tensor, file in raw["weight_map"].items():
        if not isinstance(file, str):
            raise _unreadable(f"index {str(index)!r}: file of tensor {tensor!r} is not a string")
        weight_map[tensor] = relative_member(base, file, "index file name")
    files = sorted(set(weight_map.values()))
    if not files:
        raise _unreadable(f"index {str(index)!r} maps no tensor")
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing:
        raise _unreadable(f"index {str(index)!r} names missing shard(s) {missing[:5]}")
    return CheckpointFiles(
        base_dir=base, files=files, weight_map=weight_map, index=index, metadata=metadata
    )


def _unreadable(message: str) -> RunnerError:
    return RunnerError(message, code=ErrorCode.WEIGHTS_UNREADABLE)
