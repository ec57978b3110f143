"""Reload tensors in place from safetensors files: validate everything (prepare), then copy.

No destination tensor is written before every header, name, shape, dtype and checksum is checked,
and no second copy of the model is ever held (one tensor, or a bounded staging buffer, at most).
The checks are in checks.py and the copy engine in copy.py; this module opens a checkpoint and
runs the two in that order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import time_ns  # not through ``time``: tests replace that module's clock

import torch
from pydantic import JsonValue

from controlplane.wire.errors import RunnerError, WireCode
from workers.weights.checks import (
    OpenCheckpoint,
    TensorEntry,
    check_index,
    names,
    plan_copy,
    read_header,
    verify_sha256,
)
from workers.weights.copy import (
    DEFAULT_READ_CHUNK_BYTES,
    Copier,
    Progress,
    byte_view,
    copy_plan,
    default_read_threads,
    read_exact,
    readers_for,
)
from workers.weights.oms import (
    ModelTrust,
    SignedDigests,
    Span,
    check_index_digest,
    signed_digests,
)
from workers.weights.paths import checkpoint_files, open_member, unreadable
from workers.weights.stats import LoadStats
from workers.weights.verify import CopiedBytesMismatch, CopyHasher, whole_file_spans

__all__ = [  # what runners, tests and benchmarks import (or patch) here
    "DEFAULT_STAGING_BYTES",
    "CopiedBytesMismatch",
    "PreparedCheckpoint",
    "_Copier",
    "_byte_view",
    "_read_exact",
    "checkpoint_files",
    "copy_plan",
    "load_checkpoint",
    "module_targets",
    "open_checkpoint",
    "prepare_checkpoint",
    "verify_sha256",
]

#: The names the copy engine had when it lived here (tests and bench/reload/ use them).
_Copier = Copier
_byte_view = byte_view
_read_exact = read_exact

DEFAULT_STAGING_BYTES = 64 * 1024 * 1024
#: A file whose change time (ctime) was at least this long before it was opened, and whose
#: size, mtime and ctime are the same when the copy begins, was not written in between: any
#: write sets ctime to the clock's "now", later than that (ctime cannot be set back, and its
#: granularity, a clock tick, is far below this). A file changed more recently than this
#: cannot be proven unchanged by its fstat alone: it is hashed again (see ``copy``).
QUIET_S = 2.0


def module_targets(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A module's parameters and persistent buffers by name, and its aliases (tied weights)."""
    targets: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        canonical = first_name.setdefault(id(tensor), name)
        if canonical == name:
            targets[name] = tensor
        else:
            aliases[name] = canonical
    return targets, aliases


@contextlib.contextmanager
def open_checkpoint(path: Path, roots: Sequence[Path] | None = None) -> Iterator[OpenCheckpoint]:
    """Open every file of the checkpoint at ``path`` and read and check its header.

    Every file is contained in ``roots`` (default: see ``workers.weights.paths.checkpoint_files``) and
    opened as exactly the file that was checked (CommandRejected(PATH_NOT_ALLOWED) otherwise).
    """
    files = checkpoint_files(path, roots)
    ckpt = OpenCheckpoint(files=files, entries={}, fds={}, opened_ns=time_ns())
    try:
        for file in files.files:
            fd = ckpt.fds[file] = open_member(file, files.members[file], files.within)
            ckpt.stats[file] = os.fstat(fd)  # before the header is read: see _changed_files
            entries, ckpt.headers[file] = read_header(fd, file)
            for name, entry in entries.items():
                if name in ckpt.entries:
                    raise unreadable(
                        f"tensor {name!r} is in both {ckpt.entries[name].file.name!r} and {file.name!r}"
                    )
                ckpt.entries[name] = entry
        if files.weight_map is not None:
            check_index(files.weight_map, ckpt.entries)
        yield ckpt
    finally:
        ckpt.close()


def load_checkpoint(
    path: Path,
    targets: Mapping[str, torch.Tensor],
    *,
    version: str,
    from_version: str | None,
    strict: bool = True,
    sha256: Mapping[str, str] | None = None,
    aliases: Mapping[str, str] | None = None,
    cancel: threading.Event | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    progress: Progress | None = None,
    sync: Callable[[], None] | None = None,
    read_threads: int | None = None,
    read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES,
    model_trust: ModelTrust | None = None,
    signed: SignedDigests | None = None,
    sha256_while_copying: bool = False,
) -> LoadStats:
    """Validate the checkpoint at ``path`` against ``targets``, then copy it into them in place:
    :func:`prepare_checkpoint`, then :meth:`PreparedCheckpoint.copy`.

    Before copying: RunnerError (WEIGHTS_*, CHECKSUM_MISMATCH, COMMAND_TIMEOUT when cancelled),
    targets untouched. Once copying began, any failure or cancel raises WeightsCorrupted.
    ``sync`` runs after the last copy (an XLA runner flushes its lazy graph there) and, for
    devices copied through host tensors, after every ``staging_bytes`` to bound host memory.

    Contiguous host-memory targets (CPU tensors, or host aliases of device buffers) are read
    straight into, in ``read_chunk_bytes`` chunks from ``read_threads`` threads (default
    ``default_read_threads()``; 1 reads each tensor with a single reader).

    Signed checkpoints (oms.py): with ``model_trust``, the signature is checked before anything
    else (MODEL_SIGNATURE_MISSING / MODEL_SIGNATURE_INVALID, targets untouched), and the bytes
    copied are then hashed against the signed digests: a difference raises CopiedBytesMismatch
    (a WeightsCorrupted). ``signed``: check against these digests instead (the runner restoring
    the checkpoint it had verified before). The digests used are in the result's ``signed``.
    The data files of the ``sha256`` manifest are hashed as they are copied (what the model
    gets is what is hashed; a difference raises CopiedBytesMismatch) and, unless
    ``sha256_while_copying`` (a caller that can restore what it had), hashed before copying
    too, so that a wrong checkpoint is refused before anything is written.
    """
    with prepare_checkpoint(
        path,
        targets,
        strict=strict,
        sha256=sha256,
        aliases=aliases,
        cancel=cancel,
        model_trust=model_trust,
        signed=signed,
        sha256_while_copying=sha256_while_copying,
    ) as prepared:
        return prepared.copy(
            version=version,
            from_version=from_version,
            cancel=cancel,
            staging_bytes=staging_bytes,
            progress=progress,
            sync=sync,
            read_threads=read_threads,
            read_chunk_bytes=read_chunk_bytes,
        )


@dataclass
class PreparedCheckpoint:
    """A checkpoint open and checked against a model's tensors, nothing written yet: every file
    contained and open, every header read, the plan (each tensor to its target, names, shapes
    and dtypes checked), the signature checked and what must be hashed before copying hashed.

    Its files stay open until the :func:`prepare_checkpoint` block ends: :meth:`copy` reads the
    very files that were checked, and hashes what it copies against ``digests``, so a file
    changed between the two is still caught. A runner prepares while it serves, then drains
    and copies (the pause covers the copy alone).
    """

    ckpt: OpenCheckpoint
    #: (entry, target) pairs in file order, targets as given to :func:`prepare_checkpoint`.
    plan: list[tuple[TensorEntry, torch.Tensor]]
    #: Per data file, the spans the copied bytes are hashed against; None: none are.
    digests: Mapping[Path, tuple[Span, ...]] | None
    signed: SignedDigests | None
    #: Whether the command's sha256 manifest was checked, whole, before copying.
    sha256_checked: bool
    #: ``time.perf_counter()`` when preparing began and ended: the result's ``validate_s``
    #: (its ``duration_s`` runs from ``started`` to the copy's end, a drain's wait included).
    started: float
    checked: float
    #: Each target's name (by identity): :meth:`copy` may write other tensors of those names.
    target_names: dict[int, str] = field(default_factory=dict)
    #: Whether every byte the copy hashes (``digests``) was hashed from the files before it
    #: (the manifest checked whole, or :meth:`verify_bytes`).
    bytes_verified: bool = False

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry, _ in self.plan)

    def facts(self) -> dict[str, JsonValue]:
        """What was checked, for a dry run's ack: files, tensors, bytes, and the digests."""
        return {
            "files": len(self.ckpt.files.files),
            "tensors": len(self.plan),
            "bytes": self.nbytes,
            "sha256": self.sha256_checked,
            "signed": self.signed is not None,
        }

    def verify_bytes(self, cancel: threading.Event | None = None) -> None:
        """Hash every byte the copy would hash (the signed spans, the manifest's data files)
        from the files, without copying: RunnerError CHECKSUM_MISMATCH (COMMAND_TIMEOUT when
        cancelled) when one differs. A dry run's check; a reload hashes as it copies instead."""
        if self.digests is None:
            return
        hasher = CopyHasher(
            self.ckpt, [], self.digests, threads=default_read_threads(), cancel=cancel
        )
        try:
            wrong = hasher.mismatches()
        except OSError as exc:
            raise unreadable(f"cannot hash the checkpoint: {exc}") from None
        finally:
            hasher.close()
        if wrong:
            expected = "the signed ones" if self.signed is not None else "the sha256 manifest"
            raise RunnerError(
                f"the checkpoint's bytes differ from {expected} in {names(wrong)}",
                code=WireCode.CHECKSUM_MISMATCH,
            )
        self.bytes_verified = True

    def copy(
        self,
        targets: Mapping[str, torch.Tensor] | None = None,
        *,
        version: str,
        from_version: str | None,
        cancel: threading.Event | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        progress: Progress | None = None,
        sync: Callable[[], None] | None = None,
        read_threads: int | None = None,
        read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES,
        verify_first: bool = False,
    ) -> LoadStats:
        """Copy the plan in place (into ``targets``: tensors of the same names, shapes and
        dtypes as those prepared against, e.g. host aliases of them; default those), hashing
        what is copied against ``digests``. See :func:`load_checkpoint` for the errors.

        Before the first byte is written every file is checked to still hold each planned
        tensor (a file truncated since it was prepared: WEIGHTS_UNREADABLE, untouched). With
        nothing hashed (no manifest, no signature), each is also checked to be the file that
        was checked: the same size, mtime and ctime (fstat of the open descriptor) and the same
        header bytes; a file changed since: WEIGHTS_UNREADABLE, untouched. With ``digests``, the
        bytes copied are hashed: a caller that can restore what it had restores it on a
        difference (CopiedBytesMismatch).

        ``verify_first`` (a caller that cannot restore what it has, e.g. seeded weights): with
        ``digests``, a file whose fstat or header changed since it was checked is refused
        (CHECKSUM_MISMATCH, untouched), and every byte to be hashed is hashed from the files
        again before the first write unless it was hashed while preparing and no file can have
        changed since (each quiet for ``QUIET_S`` before it was opened, its fstat the same
        now): a difference is refused (CHECKSUM_MISMATCH), untouched, not found as it is copied
        (WeightsCorrupted, degraded)."""
        if read_threads is not None and read_threads < 1:
            raise ValueError(f"read_threads must be at least 1, not {read_threads}")
        if read_chunk_bytes < 1:
            raise ValueError(f"read_chunk_bytes must be at least 1, not {read_chunk_bytes}")
        readers = default_read_threads() if read_threads is None else read_threads
        ckpt = self.ckpt
        if not ckpt.fds:
            raise RuntimeError("the prepared checkpoint was closed")
        plan = self.plan if targets is None else self._retarget(targets)
        if cancel is not None and cancel.is_set():
            raise RunnerError(
                "reload cancelled before copying began", code=WireCode.COMMAND_TIMEOUT
            )
        self._check_sizes()
        if self.digests is None:
            self._changed_files()
        elif verify_first and (self._changed_files() or not self.bytes_verified):
            self.verify_bytes(cancel)  # the model untouched until these bytes are right
        copy_started = time.perf_counter()
        copiers = readers if read_threads is not None else readers_for(ckpt.fds.values(), readers)
        copier = Copier(staging_bytes, flush=sync, threads=copiers, read_chunk=read_chunk_bytes)
        if self.digests is None:
            copy_plan(ckpt, plan, copier, version, from_version, cancel, progress, sync)
        else:
            hasher = CopyHasher(ckpt, plan, self.digests, threads=readers, cancel=cancel)
            try:
                copy_plan(
                    ckpt,
                    plan,
                    copier,
                    version,
                    from_version,
                    cancel,
                    progress,
                    sync,
                    hasher.advance,
                )
                hasher.finish(version=version, from_version=from_version)
            finally:
                hasher.close()
        finished = time.perf_counter()
        stats = LoadStats.measured(
            version,
            files=len(ckpt.files.files),
            tensors=len(plan),
            nbytes=self.nbytes,
            started=self.started,
            copy_started=copy_started,
            finished=finished,
            signed=self.signed,
        )
        return dataclasses.replace(stats, validate_s=self.checked - self.started)

    def _retarget(
        self, targets: Mapping[str, torch.Tensor]
    ) -> list[tuple[TensorEntry, torch.Tensor]]:
        out: list[tuple[TensorEntry, torch.Tensor]] = []
        for entry, prepared in self.plan:
            dst = targets[self.target_names[id(prepared)]]
            if dst.shape != prepared.shape or dst.dtype != prepared.dtype:
                raise ValueError(
                    f"target {self.target_names[id(prepared)]!r} changed since prepared"
                )
            out.append((entry, dst))
        return out

    def _changed_files(self) -> list[Path]:
        """Refuse (untouched) a file whose fstat or header bytes differ from what was checked;
        return the files whose fstat cannot prove them unchanged (changed within ``QUIET_S``
        before they were opened). The descriptors are read, not the paths: a file renamed over
        the checkpoint's is not read, and its inode and device are those of the descriptor."""
        ckpt = self.ckpt
        quiet_before = ckpt.opened_ns - int(QUIET_S * 1e9)
        unproven: list[Path] = []
        for file, fd in ckpt.fds.items():
            was, now = ckpt.stats[file], os.fstat(fd)
            same = (was.st_size, was.st_mtime_ns, was.st_ctime_ns) == (
                now.st_size,
                now.st_mtime_ns,
                now.st_ctime_ns,
            )
            header = ckpt.headers[file]
            if not same or os.pread(fd, len(header), 0) != header:
                raise RunnerError(
                    f"{file.name!r} changed after it was checked (before the copy began);"
                    " nothing was copied",
                    code=WireCode.WEIGHTS_UNREADABLE
                    if self.digests is None
                    else WireCode.CHECKSUM_MISMATCH,
                )
            if now.st_ctime_ns >= quiet_before:
                unproven.append(file)
        return unproven

    def _check_sizes(self) -> None:
        """Every planned tensor still lies within its file (pread past the end would be a short
        read mid-copy: refused here, before anything is written)."""
        ends: dict[Path, int] = {}
        for entry, _ in self.plan:
            ends[entry.file] = max(ends.get(entry.file, 0), entry.offset + entry.nbytes)
        for file, end in ends.items():
            size = os.fstat(self.ckpt.fds[file]).st_size
            if size < end:
                raise unreadable(
                    f"{file.name!r} shrank to {size} bytes after it was checked (tensors end at"
                    f" byte {end}); nothing was copied"
                )


@contextlib.contextmanager
def prepare_checkpoint(
    path: Path,
    targets: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    sha256: Mapping[str, str] | None = None,
    aliases: Mapping[str, str] | None = None,
    cancel: threading.Event | None = None,
    model_trust: ModelTrust | None = None,
    signed: SignedDigests | None = None,
    sha256_while_copying: bool = False,
) -> Iterator[PreparedCheckpoint]:
    """Every check :func:`load_checkpoint` makes before it writes a byte, the targets only read
    (their names, shapes and dtypes): the signature (with ``model_trust``, before any header is
    parsed), every file contained and opened, every header, the index, the plan, and the
    ``sha256`` manifest where it must be hashed before copying (see :func:`load_checkpoint`).
    Raises RunnerError (or CommandRejected for containment); yields the prepared checkpoint,
    whose files stay open for its :meth:`~PreparedCheckpoint.copy` until the block ends.
    """
    started = time.perf_counter()
    if signed is None and model_trust is not None:  # checked before any header is parsed
        signed = signed_digests(checkpoint_files(path), model_trust)
    with open_checkpoint(path) as ckpt:
        if signed is not None:
            unsigned = [f.name for f in ckpt.files.files if f not in signed.files]
            if unsigned:
                raise RunnerError(
                    f"the signature does not name checkpoint file(s) {unsigned[:5]}",
                    code=WireCode.MODEL_SIGNATURE_INVALID,
                )
            check_index_digest(ckpt.files, signed)
        plan = plan_copy(ckpt.entries, targets, strict=strict, aliases=aliases or {})
        digests: Mapping[Path, tuple[Span, ...]] | None = None if signed is None else signed.files
        checked = False
        if sha256 and signed is None:
            # The data files are hashed as copied: the bytes the model gets are the ones hashed.
            spans = whole_file_spans(ckpt, sha256)
            digests = spans
            if sha256_while_copying:  # every other file the manifest lists is hashed now
                verify_sha256(
                    ckpt, sha256, cancel, digests={f: s[0].digest for f, s in spans.items()}
                )
            else:  # and all of them first too: a wrong checkpoint is refused untouched
                verify_sha256(ckpt, sha256, cancel)
                checked = True
        elif sha256:
            verify_sha256(ckpt, sha256, cancel)
            checked = True
        by_id = {id(tensor): name for name, tensor in targets.items()}
        yield PreparedCheckpoint(
            ckpt,
            plan,
            digests,
            signed,
            checked,
            started,
            time.perf_counter(),
            by_id,
            bytes_verified=checked and signed is None,  # the manifest's hash is not the signed
        )
