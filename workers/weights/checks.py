"""Checks on a safetensors checkpoint, before any tensor is written: headers, names, shapes,
dtypes and checksums.

Headers are parsed here, not by the safetensors library: every offset, length and dtype is
checked against the file's size before it is trusted, and nothing but the header is read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from controlplane.wire.errors import RunnerError, WireCode
from workers.weights.paths import (
    CheckpointFiles,
    check_member,
    open_member,
    relative_member,
    unreadable,
)

#: safetensors dtype -> (torch dtype name, bytes per element).
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    getattr(torch, name): code for code, (name, _) in DTYPES.items() if hasattr(torch, name)
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself applies
_HASH_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors file: where its bytes are and what they mean."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, from the start of the file
    nbytes: int


@dataclass
class OpenCheckpoint:
    """A checkpoint whose headers were read and checked; its files stay open until closed.

    Hashing and copying read from these same descriptors, so a file replaced after validation
    is never the one copied; each was opened as the very file whose location was checked
    (``workers.weights.paths.open_member``). ``headers`` holds each file's first 8 + length
    bytes exactly as they were parsed: what is hashed for them (verify.py, ``verify_sha256``)
    is these bytes, never a second read that a writer could have changed back meanwhile.
    """

    files: CheckpointFiles
    entries: dict[str, TensorEntry]
    fds: dict[Path, int]
    headers: dict[Path, bytes] = field(default_factory=dict)
    #: Each file's fstat as it was opened, before its header was read; and the wall clock
    #: (``time.time_ns()``) just before the first was opened: what a copy compares against
    #: (``workers.weights.loaders.PreparedCheckpoint``) to find a file changed since checked.
    stats: dict[Path, os.stat_result] = field(default_factory=dict)
    opened_ns: int = 0

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def read_header(fd: int, file: Path) -> tuple[dict[str, TensorEntry], bytes]:
    """The tensors of the safetensors file open at ``fd``, every entry checked against its size,
    and the bytes they were parsed from (the 8-byte length and the header): the ones to hash."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise unreadable(f"{file.name!r} is too short to be a safetensors file ({size} bytes)")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise unreadable(f"{file.name!r}: header length {length} is impossible for {size} bytes")
    body = os.pread(fd, length, 8)
    if len(body) != length:
        raise unreadable(f"{file.name!r} ended inside its header")
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise unreadable(f"{file.name!r}: header is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise unreadable(f"{file.name!r}: header is not a JSON object")
    data_start = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        entries[name] = _parse_entry(file, name, info, data_start, size)
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise unreadable(f"{file.name!r}: tensors {first!r} and {second!r} overlap")
    return entries, head + body


def _parse_entry(file: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    where = f"{file.name!r}, tensor {name!r}"
    if not isinstance(info, dict):
        raise unreadable(f"{where}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise unreadable(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise unreadable(f"{where}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise unreadable(f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != expected:
        raise unreadable(f"{where}: {end - begin} bytes for {dtype}{shape} (needs {expected})")
    if data_start + end > size:
        raise unreadable(f"{where}: data ends at byte {data_start + end}, file has {size}")
    return TensorEntry(name, file, dtype, tuple(shape), data_start + begin, expected)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def check_index(weight_map: Mapping[str, Path], entries: Mapping[str, TensorEntry]) -> None:
    """The index and the shards' headers must name the same tensors in the same files."""
    wrong = [
        name
        for name, file in weight_map.items()
        if name not in entries or entries[name].file != file
    ]
    if wrong:
        raise unreadable(f"index and shard headers disagree about {names(wrong)}")
    unindexed = [name for name in entries if name not in weight_map]
    if unindexed:
        raise unreadable(f"shards hold tensors the index does not list: {names(unindexed)}")


def plan_copy(
    entries: Mapping[str, TensorEntry],
    targets: Mapping[str, torch.Tensor],
    *,
    strict: bool,
    aliases: Mapping[str, str],
) -> list[tuple[TensorEntry, torch.Tensor]]:
    """Match checkpoint tensors to targets, or raise the first class of mismatch found.

    An alias (the second name of a tied weight) counts as its canonical tensor; when both names
    are present the canonical one is copied and both are checked.
    """
    chosen: dict[str, TensorEntry] = {}
    checked: list[tuple[TensorEntry, str]] = []
    unexpected: list[str] = []
    for name, entry in entries.items():
        canonical = aliases.get(name, name)
        if canonical not in targets:
            unexpected.append(name)
            continue
        checked.append((entry, canonical))
        if name == canonical or canonical not in chosen:
            chosen[canonical] = entry
    if unexpected:
        raise RunnerError(
            f"checkpoint has tensors the model lacks: {names(sorted(unexpected))}",
            code=WireCode.WEIGHTS_UNEXPECTED,
        )
    missing = [name for name in targets if name not in chosen]
    if (strict and missing) or not chosen:
        raise RunnerError(
            f"checkpoint lacks {len(missing)} of the model's {len(targets)} tensors: {names(missing)}",
            code=WireCode.WEIGHTS_MISSING,
        )
    shapes = [
        f"{e.name} {list(e.shape)} vs {list(targets[c].shape)}"
        for e, c in checked
        if e.shape != tuple(targets[c].shape)
    ]
    if shapes:
        raise RunnerError(
            f"shape mismatch (checkpoint vs model): {names(shapes)}",
            code=WireCode.WEIGHTS_SHAPE_MISMATCH,
        )
    dtypes = [
        f"{e.name} {e.dtype} vs {targets[c].dtype}"
        for e, c in checked
        if getattr(torch, DTYPES[e.dtype][0], None) != targets[c].dtype
    ]
    if dtypes:
        raise RunnerError(
            f"dtype mismatch (checkpoint vs model): {names(dtypes)}",
            code=WireCode.WEIGHTS_DTYPE_MISMATCH,
        )
    plan = [(entry, targets[canonical]) for canonical, entry in chosen.items()]
    plan.sort(key=lambda item: (str(item[0].file), item[0].offset))
    return plan


def stand_ins(entries: Mapping[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """Shape-and-dtype stand-ins (meta tensors, no memory) for plan_copy's comparison."""
    return {
        name: torch.empty(
            e.shape, dtype=getattr(torch, DTYPES[e.dtype][0], torch.uint8), device="meta"
        )
        for name, e in entries.items()
    }


def verify_sha256(
    ckpt: OpenCheckpoint,
    expected: Mapping[str, str],
    cancel: threading.Event | None = None,
    digests: Mapping[Path, str] | None = None,
) -> None:
    """Hash the manifest's files (relative names); every data file must be listed in it.

    ``digests`` are hashes already taken of some files (while copying them), not read again.
    A data file's header and the index are hashed as they were parsed (not read again).
    """
    base = ckpt.files.base_dir
    wanted = {
        relative_member(base, name, "sha256 manifest entry"): hexd
        for name, hexd in expected.items()
    }
    uncovered = [f.name for f in ckpt.files.files if f not in wanted]
    if uncovered:
        raise RunnerError(
            f"sha256 manifest does not cover checkpoint file(s) {names(uncovered)}",
            code=WireCode.CHECKSUM_MISMATCH,
        )
    wrong: list[str] = []
    for file, hexd in sorted(wanted.items()):
        if digests is not None and file in digests:
            digest = digests[file]
        elif file in ckpt.fds:  # the header as parsed, then the rest from the file
            digest = _sha256_fd(ckpt.fds[file], cancel, ckpt.headers.get(file, b""))
        elif file == ckpt.files.index and ckpt.files.index_bytes is not None:
            digest = hashlib.sha256(ckpt.files.index_bytes).hexdigest()  # as parsed
        else:  # another file of the checkpoint's directory: contained and opened the same way
            member = check_member(file, ckpt.files.within)
            if member is None:
                raise unreadable(f"sha256 manifest lists {file.name!r}, which is not a file")
            fd = open_member(file, member, ckpt.files.within)
            try:
                digest = _sha256_fd(fd, cancel)
            finally:
                os.close(fd)
        if digest != hexd.lower():
            wrong.append(f"{file.relative_to(base)} (got {digest[:12]}, want {hexd[:12]})")
    if wrong:
        raise RunnerError(f"sha256 mismatch: {names(wrong)}", code=WireCode.CHECKSUM_MISMATCH)


def _sha256_fd(fd: int, cancel: threading.Event | None, parsed: bytes = b"") -> str:
    """The sha256 of ``parsed`` (the file's first bytes as they were parsed), then of the file
    at ``fd`` from there on."""
    digest = hashlib.sha256(parsed)
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    offset = len(parsed)
    while n := os.preadv(fd, [view], offset):
        if cancel is not None and cancel.is_set():
            raise RunnerError("reload cancelled while hashing", code=WireCode.COMMAND_TIMEOUT)
        digest.update(view[:n])
        offset += n
    return digest.hexdigest()


def names(items: list[str], limit: int = 5) -> str:
    """The first ``limit`` items, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def failure_reason(exc: BaseException) -> str:
    """A failure in one line: a RunnerError's message, else the exception's type and text."""
    if isinstance(exc, RunnerError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"
