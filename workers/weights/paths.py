"""Where weights may come from: allowed-root checks and the list of a checkpoint's files.

No torch and no tensor data here: only paths, directory listings, the small index json, and the
one way a data file is opened (:func:`open_member`).

Containment covers every file, not only the path in the command: each data file (found by
listing a directory or named by an index) and the index itself is resolved, symlinks and all,
and must lie inside the allowed roots; its identity (st_dev, st_ino) is recorded then, and
:func:`open_member` opens the resolved path with ``O_NOFOLLOW`` and refuses a file whose
identity or kernel-reported location differs (a swap between check and open).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PosixPath, PurePosixPath

from controlplane.wire.errors import CommandRejected, RunnerError, WireCode

INDEX_SUFFIX = ".index.json"
SAFETENSORS_SUFFIX = ".safetensors"
#: An index json larger than this is refused unread (a 70B model's index is ~100 KiB).
MAX_INDEX_BYTES = 64 * 1024 * 1024


class WeightsPath(PosixPath):
    """A resolved weights path that remembers the (resolved) roots it was checked against.

    :func:`checkpoint_files` contains every file of the checkpoint in these same roots. Paths
    derived from it (``/``, ``parent``, ``resolve()``) do not carry the roots.
    """

    allowed_roots: tuple[Path, ...] = ()


def resolve_weights_path(path: str, allowed_roots: Sequence[Path]) -> Path:
    """``path`` with symlinks and ``..`` resolved, if it lies inside one of ``allowed_roots``.

    Relative paths are refused (a fleet command cannot know a worker's working directory), and so
    is everything when ``allowed_roots`` is empty. Raises CommandRejected(PATH_NOT_ALLOWED).
    The result is a :class:`WeightsPath`: the checkpoint's files are contained in the same roots.
    """
    if not allowed_roots:
        raise CommandRejected(
            "no weights root is allowed on this worker", code=WireCode.PATH_NOT_ALLOWED
        )
    if "\x00" in path:
        raise CommandRejected("path contains a NUL byte", code=WireCode.PATH_NOT_ALLOWED)
    candidate = Path(path)
    if not candidate.is_absolute():
        raise CommandRejected(
            f"weights path {path!r} must be absolute", code=WireCode.PATH_NOT_ALLOWED
        )
    try:
        resolved = candidate.resolve(strict=False)
        roots = [Path(root).resolve(strict=False) for root in allowed_roots]
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on Python < 3.13
        raise CommandRejected(
            f"cannot resolve weights path {path!r}: {exc}", code=WireCode.PATH_NOT_ALLOWED
        ) from None
    if any(resolved.is_relative_to(root) for root in roots):
        checked = WeightsPath(resolved)
        checked.allowed_roots = tuple(roots)
        return checked
    raise CommandRejected(
        f"weights path {path!r} resolves to {str(resolved)!r}, outside the allowed roots "
        f"{[str(r) for r in roots]}",
        code=WireCode.PATH_NOT_ALLOWED,
    )


@dataclass(frozen=True)
class Member:
    """A checked file: where it really is (symlinks resolved, contained) and which inode it was."""

    real: Path
    dev: int
    ino: int


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint's data files, sorted, and the index's tensor -> file map when there is one.

    ``files`` and ``weight_map`` name files as the checkpoint does (under ``base_dir``);
    ``members`` says where each really is; ``within`` are the roots everything was contained in.
    ``index_bytes``: the index exactly as it was parsed (what its digest is checked against).
    """

    base_dir: Path
    files: list[Path]
    weight_map: dict[str, Path] | None = None
    index: Path | None = None
    metadata: dict[str, object] | None = None
    members: Mapping[Path, Member] = field(default_factory=dict)
    within: tuple[Path, ...] = ()
    index_bytes: bytes | None = None


def checkpoint_files(path: Path, roots: Sequence[Path] | None = None) -> CheckpointFiles:
    """The files of the checkpoint at ``path``: a .safetensors file, a directory, or an index json.

    A directory holding one index json uses it (several are ambiguous: refused); otherwise it
    means every ``*.safetensors`` file in it.
    Every file is resolved and must lie inside ``roots``; by default the roots ``path`` was
    checked against (a :class:`WeightsPath`), else the checkpoint's own resolved directory.
    Raises CommandRejected(PATH_NOT_ALLOWED) for a file that escapes, RunnerError
    (WEIGHTS_UNREADABLE) when nothing readable is there.
    """
    try:
        within = _containment(path, roots)
        if path.is_dir():
            indexes = sorted(path.glob(f"*{SAFETENSORS_SUFFIX}{INDEX_SUFFIX}"))
            if len(indexes) > 1:
                names = [p.name for p in indexes]
                raise unreadable(f"directory {str(path)!r} holds several indexes {names}; name one")
            if indexes:
                return _from_index(indexes[0], within)
            members: dict[Path, Member] = {}
            for candidate in sorted(path.glob(f"*{SAFETENSORS_SUFFIX}")):
                member = check_member(candidate, within)
                if member is not None:
                    members[candidate] = member
            if not members:
                raise unreadable(f"directory {str(path)!r} holds no *{SAFETENSORS_SUFFIX} file")
            return CheckpointFiles(
                base_dir=path, files=list(members), members=members, within=within
            )
        if path.name.endswith(INDEX_SUFFIX):
            return _from_index(path, within)
        member = check_member(path, within)
        if member is not None:
            if path.suffix != SAFETENSORS_SUFFIX:
                raise unreadable(
                    f"{str(path)!r} is neither a {SAFETENSORS_SUFFIX} file nor an index"
                )
            return CheckpointFiles(
                base_dir=path.parent, files=[path], members={path: member}, within=within
            )
        raise unreadable(f"checkpoint {str(path)!r} does not exist or is not a regular file")
    except OSError as exc:
        raise unreadable(f"cannot list checkpoint {str(path)!r}: {exc}") from None


def _containment(path: Path, roots: Sequence[Path] | None) -> tuple[Path, ...]:
    if roots is None:
        roots = getattr(path, "allowed_roots", None) or None
    if roots is not None:
        return tuple(Path(root).resolve() for root in roots)
    real = path.resolve()
    return (real if real.is_dir() else real.parent,)


def check_member(path: Path, within: Sequence[Path]) -> Member | None:
    """``path`` resolved and contained in ``within``, with its identity; None when it is not
    a regular file (missing, a dangling link, a directory).

    Raises CommandRejected(PATH_NOT_ALLOWED) when it resolves outside ``within``.
    """
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        return None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on Python < 3.13
        if isinstance(exc, OSError) and exc.errno == errno.ENOTDIR:
            return None
        raise CommandRejected(
            f"cannot resolve checkpoint file {str(path)!r}: {exc}",
            code=WireCode.PATH_NOT_ALLOWED,
        ) from None
    if not _inside(real, within):
        raise CommandRejected(
            f"checkpoint file {str(path)!r} resolves to {str(real)!r}, outside "
            f"{[str(r) for r in within]}",
            code=WireCode.PATH_NOT_ALLOWED,
        )
    st = os.stat(real, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        return None
    return Member(real=real, dev=st.st_dev, ino=st.st_ino)


def open_member(name: Path, member: Member, within: Sequence[Path]) -> int:
    """A read-only descriptor of exactly the file that was checked (``O_NOFOLLOW``, identity).

    Raises CommandRejected(PATH_NOT_ALLOWED) when the file was replaced since it was checked
    (a symlink now, another inode, or opened somewhere outside ``within``), RunnerError
    (WEIGHTS_UNREADABLE) when it cannot be opened.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(member.real, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _swapped(name, "it is a symlink now") from None
        raise unreadable(f"cannot open {name.name!r}: {exc}") from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (member.dev, member.ino) or not stat.S_ISREG(st.st_mode):
            raise _swapped(name, "another file is there now")
        where = _fd_location(fd)
        if where is not None and not _inside(where, within):
            raise _swapped(name, f"it was opened at {str(where)!r}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fd_location(fd: int) -> Path | None:
    """Where the kernel says the open file is (Linux ``/proc``), None when it cannot say."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not link.startswith("/") or link.endswith(" (deleted)"):
        return None
    return Path(link)


def _inside(real: Path, within: Sequence[Path]) -> bool:
    return any(real.is_relative_to(root) for root in within)


def _swapped(name: Path, how: str) -> CommandRejected:
    return CommandRejected(
        f"checkpoint file {str(name)!r} changed between check and open ({how}); refused",
        code=WireCode.PATH_NOT_ALLOWED,
    )


def relative_member(base_dir: Path, name: str, what: str) -> Path:
    """``base_dir / name`` for a plain relative ``name``; refuses absolute names and ``..``."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\x00" in name or "\\" in name:
        raise CommandRejected(
            f"{what} {name!r} must be a plain relative name inside the checkpoint",
            code=WireCode.PATH_NOT_ALLOWED,
        )
    return base_dir / pure


def _from_index(index: Path, within: tuple[Path, ...]) -> CheckpointFiles:
    member = check_member(index, within)
    if member is None:
        raise unreadable(f"index {str(index)!r} does not exist or is not a regular file")
    try:
        fd = open_member(index, member, within)
        try:
            if os.fstat(fd).st_size > MAX_INDEX_BYTES:
                raise unreadable(f"index {str(index)!r} is larger than {MAX_INDEX_BYTES} bytes")
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read(MAX_INDEX_BYTES + 1)
        finally:
            os.close(fd)
        raw = json.loads(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise unreadable(f"cannot read index {str(index)!r}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise unreadable(f"index {str(index)!r} has no 'weight_map' object")
    metadata = raw.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise unreadable(f"index {str(index)!r}: 'metadata' must be an object")
    base = index.parent
    weight_map: dict[str, Path] = {}
    for tensor, file in raw["weight_map"].items():
        if not isinstance(file, str):
            raise unreadable(f"index {str(index)!r}: file of tensor {tensor!r} is not a string")
        weight_map[tensor] = relative_member(base, file, "index file name")
    files = sorted(set(weight_map.values()))
    if not files:
        raise unreadable(f"index {str(index)!r} maps no tensor")
    members: dict[Path, Member] = {}
    missing: list[str] = []
    for file in files:
        found = check_member(file, within)
        if found is None:
            missing.append(file.name)
        else:
            members[file] = found
    if missing:
        raise unreadable(f"index {str(index)!r} names missing shard(s) {missing[:5]}")
    return CheckpointFiles(
        base_dir=base,
        files=files,
        weight_map=weight_map,
        index=index,
        metadata=metadata,
        members=members,
        within=within,
        index_bytes=data,
    )


def unreadable(message: str) -> RunnerError:
    return RunnerError(message, code=WireCode.WEIGHTS_UNREADABLE)
