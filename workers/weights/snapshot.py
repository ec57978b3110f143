"""Private snapshots of a checked checkpoint: the copies an engine that reads files by name loads.

vLLM reloads from a directory path, so what it reads must be a copy only this worker writes,
made from the descriptors that were checked (see vllm_runner.VllmRunner._validate).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from controlplane.wire.errors import RunnerError, WireCode
from workers.weights.checks import OpenCheckpoint, TensorEntry
from workers.weights.paths import checkpoint_files

#: The index name vLLM's default loader honours; with none it reads every *.safetensors file.
VLLM_INDEX_NAME = "model.safetensors.index.json"
#: Snapshot directories inside the snapshot root are named with this prefix (and only they are
#: ever removed from a root the operator named).
SNAPSHOT_PREFIX = "v-"
_COPY_CHUNK = 8 * 1024 * 1024


def files_vllm_reads(weights_dir: Path, within: Sequence[Path]) -> list[Path]:
    """The data files vLLM loads from ``weights_dir``: the index's shards, else every
    ``*.safetensors`` file in it."""
    index = weights_dir / VLLM_INDEX_NAME
    if index.is_file():
        return checkpoint_files(index, within).files
    return sorted(p for p in weights_dir.glob("*.safetensors") if p.is_file())


def layout(
    entries: Mapping[str, TensorEntry],
) -> dict[str, tuple[str, str, tuple[int, ...], int, int]]:
    """What a header says, per tensor, independent of where the file is."""
    return {n: (e.file.name, e.dtype, e.shape, e.offset, e.nbytes) for n, e in entries.items()}


class SnapshotRoot:
    """The directory where this runner keeps the private copies vLLM loads.

    Created private (0700) when the runner makes it; one the operator names must be owned by
    this user and writable by nobody else. Snapshots inside it get the root's read permissions
    (so a sidecar running as another user of the root's group can read them), never write ones.
    """

    def __init__(self, root: Path, *, owned: bool) -> None:
        self.root = root
        self._owned = owned  # made by us: removed whole at close
        mode = stat.S_IMODE(os.stat(root).st_mode)
        self._dir_mode = mode & 0o755
        self._file_mode = mode & 0o444

    @classmethod
    def create(cls, configured: str | None) -> SnapshotRoot:
        if configured is None:
            return cls(Path(tempfile.mkdtemp(prefix="fleet-vllm-snapshots-")), owned=True)
        root = Path(configured)
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(root, follow_symlinks=False)
        except OSError as exc:
            raise RunnerError(f"snapshot_dir {configured!r}: {exc}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise RunnerError(
                f"snapshot_dir {configured!r} must be a directory owned by this user and "
                "writable by no one else (the copies vLLM loads live there)"
            )
        made = cls(root.resolve(), owned=False)
        for leftover in root.glob(f"{SNAPSHOT_PREFIX}*"):  # from an earlier run of this runner
            made.remove(leftover)
        return made

    def new(self) -> Path:
        path = Path(tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=self.root))
        os.chmod(path, self._dir_mode)
        return path

    def remove(self, path: Path) -> None:
        if path.parent != self.root or not path.name.startswith(SNAPSHOT_PREFIX):
            return  # not one of ours (the model the engine started from)
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            for leftover in self.root.glob(f"{SNAPSHOT_PREFIX}*"):
                self.remove(leftover)

    @property
    def file_mode(self) -> int:
        return self._file_mode


def snapshot_checkpoint(
    ckpt: OpenCheckpoint,
    dest: Path,
    *,
    hash_files: bool,
    cancel: threading.Event | None = None,
    file_mode: int = 0o400,
) -> dict[Path, str]:
    """Copy every data file of ``ckpt`` from its open descriptor into ``dest`` (new files,
    ``file_mode``), and an index when it has one; return each file's sha256 when ``hash_files``
    (taken of the bytes written, so what is checked is what the copy holds).

    Without hashing the kernel copies (``copy_file_range``: a reflink where the filesystem
    can). Raises RunnerError (WEIGHTS_UNREADABLE; COMMAND_TIMEOUT when cancelled).
    """
    base = ckpt.files.base_dir
    digests: dict[Path, str] = {}
    for file in ckpt.files.files:
        relative = file.relative_to(base)
        if len(relative.parts) != 1:
            raise RunnerError(
                f"vLLM reads only the files directly in a checkpoint's directory, not {str(relative)!r}",
                code=WireCode.WEIGHTS_UNREADABLE,
            )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            out = os.open(dest / relative, flags, file_mode)
        except OSError as exc:
            raise RunnerError(
                f"cannot create the snapshot of {file.name!r} in {str(dest)!r}: {exc}"
            ) from None
        try:
            digest = _copy_fd(ckpt.fds[file], out, hash_files, cancel, file.name)
        finally:
            os.close(out)
        if digest is not None:
            digests[file] = digest
    if ckpt.files.weight_map is not None:
        weight_map = {t: f.relative_to(base).as_posix() for t, f in ckpt.files.weight_map.items()}
        body: dict[str, object] = {"weight_map": weight_map}
        if ckpt.files.metadata is not None:
            body["metadata"] = ckpt.files.metadata
        index = dest / VLLM_INDEX_NAME
        index.write_text(json.dumps(body))
        os.chmod(index, file_mode)
    return digests


def _copy_fd(
    src: int, dst: int, hash_files: bool, cancel: threading.Event | None, name: str
) -> str | None:
    def cancelled() -> None:
        if cancel is not None and cancel.is_set():
            raise RunnerError("reload cancelled while copying", code=WireCode.COMMAND_TIMEOUT)

    offset = 0
    if not hash_files:
        try:
            while n := os.copy_file_range(src, dst, _COPY_CHUNK, offset, offset):
                offset += n
                cancelled()
            return None
        except OSError as exc:
            if exc.errno not in (
                errno.EXDEV,
                errno.EINVAL,
                errno.ENOSYS,
                errno.EOPNOTSUPP,
                errno.EPERM,
            ):
                raise RunnerError(
                    f"cannot copy {name!r}: {exc}", code=WireCode.WEIGHTS_UNREADABLE
                ) from None
            # Not supported between these files: copy the rest through memory.
    digest = hashlib.sha256() if hash_files else None
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    try:
        while n := os.preadv(src, [view], offset):
            cancelled()
            chunk = view[:n]
            if digest is not None:
                digest.update(chunk)
            written = 0
            while written < n:
                written += os.pwrite(dst, chunk[written:], offset + written)
            offset += n
    except OSError as exc:
        raise RunnerError(
            f"cannot copy {name!r}: {exc}", code=WireCode.WEIGHTS_UNREADABLE
        ) from None
    return digest.hexdigest() if digest is not None else None
