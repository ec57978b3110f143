"""Reload tensors in place from safetensors files: validate everything, then copy.

No destination tensor is written before every header, name, shape, dtype and checksum is checked,
and no second copy of the model is ever held (one tensor, or a bounded staging buffer, at most).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

from controlplane.wire.errors import ErrorCode, RunnerError, WeightsCorrupted
from workers.runners.base import ReloadResult
from workers.weights.paths import (
    CheckpointFiles,
    check_member,
    checkpoint_files,
    open_member,
    relative_member,
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
DEFAULT_STAGING_BYTES = 64 * 1024 * 1024
#: Host-memory destinations are read in chunks of this size, from ``read_threads`` threads.
DEFAULT_READ_CHUNK_BYTES = 8 * 1024 * 1024
MAX_READ_THREADS = 4
#: Chunks each reader may have queued ahead: enough that none idles between tensors.
READ_WINDOW_CHUNKS_PER_THREAD = 4
_HASH_CHUNK = 8 * 1024 * 1024

#: Called with (tensors copied, tensors to copy): once when copying begins, then after each tensor.
Progress = Callable[[int, int], None]


def default_read_threads() -> int:
    """Readers per reload: torch's intra-op threads, at most ``MAX_READ_THREADS``.

    From the page cache, one ``preadv`` copies on one core; chunks read from several threads
    (``preadv`` releases the GIL) use every core, as torch's own ``copy_`` does. From a disk that
    must seek, concurrent readers cost throughput (about 17 % with two on the benchmark's ext4
    disk, docs/benchmarks.md section 3): pass ``read_threads=1`` where checkpoints are usually
    read cold.
    """
    return max(1, min(torch.get_num_threads(), MAX_READ_THREADS))


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
    (``workers.weights.paths.open_member``).
    """

    files: CheckpointFiles
    entries: dict[str, TensorEntry]
    fds: dict[Path, int]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


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
    ckpt = OpenCheckpoint(files=files, entries={}, fds={})
    try:
        for file in files.files:
            fd = ckpt.fds[file] = open_member(file, files.members[file], files.within)
            for name, entry in _read_header(fd, file).items():
                if name in ckpt.entries:
                    raise _unreadable(
                        f"tensor {name!r} is in both {ckpt.entries[name].file.name!r} and {file.name!r}"
                    )
                ckpt.entries[name] = entry
        if files.weight_map is not None:
            _check_index(files.weight_map, ckpt.entries)
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
) -> ReloadResult:
    """Validate the checkpoint at ``path`` against ``targets``, then copy it into them in place.

    Before copying: RunnerError (WEIGHTS_*, CHECKSUM_MISMATCH, COMMAND_TIMEOUT when cancelled),
    targets untouched. Once copying began, any failure or cancel raises WeightsCorrupted.
    ``sync`` runs after the last copy (an XLA runner flushes its lazy graph there) and, for
    devices copied through host tensors, after every ``staging_bytes`` to bound host memory.

    Contiguous host-memory targets (CPU tensors, or host aliases of device buffers) are read
    straight into, in ``read_chunk_bytes`` chunks from ``read_threads`` threads (default
    ``default_read_threads()``; 1 reads each tensor with a single reader).
    """
    if read_threads is not None and read_threads < 1:
        raise ValueError(f"read_threads must be at least 1, not {read_threads}")
    if read_chunk_bytes < 1:
        raise ValueError(f"read_chunk_bytes must be at least 1, not {read_chunk_bytes}")
    readers = default_read_threads() if read_threads is None else read_threads
    started = time.perf_counter()
    with open_checkpoint(path) as ckpt:
        plan = plan_copy(ckpt.entries, targets, strict=strict, aliases=aliases or {})
        if sha256:
            verify_sha256(ckpt, sha256, cancel)
        if cancel is not None and cancel.is_set():
            raise RunnerError(
                "reload cancelled before copying began", code=ErrorCode.COMMAND_TIMEOUT
            )
        copy_started = time.perf_counter()
        total = sum(entry.nbytes for entry, _ in plan)
        copier = _Copier(staging_bytes, flush=sync, threads=readers, read_chunk=read_chunk_bytes)
        _copy(ckpt, plan, copier, version, from_version, cancel, progress, sync)
        finished = time.perf_counter()
    copy_s = finished - copy_started
    return ReloadResult(
        version=version,
        files=len(ckpt.files.files),
        tensors=len(plan),
        bytes=total,
        validate_s=copy_started - started,
        copy_s=copy_s,
        duration_s=finished - started,
        gbps=total / copy_s / 1e9 if copy_s > 0 else 0.0,
    )


# --------------------------------------------------------------------------- validation


def _read_header(fd: int, file: Path) -> dict[str, TensorEntry]:
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise _unreadable(f"{file.name!r} is too short to be a safetensors file ({size} bytes)")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise _unreadable(f"{file.name!r}: header length {length} is impossible for {size} bytes")
    try:
        raw = json.loads(os.pread(fd, length, 8))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _unreadable(f"{file.name!r}: header is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _unreadable(f"{file.name!r}: header is not a JSON object")
    data_start = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        entries[name] = _parse_entry(file, name, info, data_start, size)
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _unreadable(f"{file.name!r}: tensors {first!r} and {second!r} overlap")
    return entries


def _parse_entry(file: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    where = f"{file.name!r}, tensor {name!r}"
    if not isinstance(info, dict):
        raise _unreadable(f"{where}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _unreadable(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _unreadable(f"{where}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _unreadable(f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != expected:
        raise _unreadable(f"{where}: {end - begin} bytes for {dtype}{shape} (needs {expected})")
    if data_start + end > size:
        raise _unreadable(f"{where}: data ends at byte {data_start + end}, file has {size}")
    return TensorEntry(name, file, dtype, tuple(shape), data_start + begin, expected)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_index(weight_map: Mapping[str, Path], entries: Mapping[str, TensorEntry]) -> None:
    wrong = [
        name
        for name, file in weight_map.items()
        if name not in entries or entries[name].file != file
    ]
    if wrong:
        raise _unreadable(f"index and shard headers disagree about {_names(wrong)}")
    unindexed = [name for name in entries if name not in weight_map]
    if unindexed:
        raise _unreadable(f"shards hold tensors the index does not list: {_names(unindexed)}")


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
            f"checkpoint has tensors the model lacks: {_names(sorted(unexpected))}",
            code=ErrorCode.WEIGHTS_UNEXPECTED,
        )
    missing = [name for name in targets if name not in chosen]
    if (strict and missing) or not chosen:
        raise RunnerError(
            f"checkpoint lacks {len(missing)} of the model's {len(targets)} tensors: {_names(missing)}",
            code=ErrorCode.WEIGHTS_MISSING,
        )
    shapes = [
        f"{e.name} {list(e.shape)} vs {list(targets[c].shape)}"
        for e, c in checked
        if e.shape != tuple(targets[c].shape)
    ]
    if shapes:
        raise RunnerError(
            f"shape mismatch (checkpoint vs model): {_names(shapes)}",
            code=ErrorCode.WEIGHTS_SHAPE_MISMATCH,
        )
    dtypes = [
        f"{e.name} {e.dtype} vs {targets[c].dtype}"
        for e, c in checked
        if getattr(torch, DTYPES[e.dtype][0], None) != targets[c].dtype
    ]
    if dtypes:
        raise RunnerError(
            f"dtype mismatch (checkpoint vs model): {_names(dtypes)}",
            code=ErrorCode.WEIGHTS_DTYPE_MISMATCH,
        )
    plan = [(entry, targets[canonical]) for canonical, entry in chosen.items()]
    plan.sort(key=lambda item: (str(item[0].file), item[0].offset))
    return plan


def verify_sha256(
    ckpt: OpenCheckpoint,
    expected: Mapping[str, str],
    cancel: threading.Event | None = None,
    digests: Mapping[Path, str] | None = None,
) -> None:
    """Hash the manifest's files (relative names); every data file must be listed in it.

    ``digests`` are hashes already taken of some files (while copying them), not read again.
    """
    base = ckpt.files.base_dir
    wanted = {
        relative_member(base, name, "sha256 manifest entry"): hexd
        for name, hexd in expected.items()
    }
    uncovered = [f.name for f in ckpt.files.files if f not in wanted]
    if uncovered:
        raise RunnerError(
            f"sha256 manifest does not cover checkpoint file(s) {_names(uncovered)}",
            code=ErrorCode.CHECKSUM_MISMATCH,
        )
    wrong: list[str] = []
    for file, hexd in sorted(wanted.items()):
        if digests is not None and file in digests:
            digest = digests[file]
        elif file in ckpt.fds:
            digest = _sha256_fd(ckpt.fds[file], cancel)
        else:  # another file of the checkpoint's directory: contained and opened the same way
            member = check_member(file, ckpt.files.within)
            if member is None:
                raise _unreadable(f"sha256 manifest lists {file.name!r}, which is not a file")
            fd = open_member(file, member, ckpt.files.within)
            try:
                digest = _sha256_fd(fd, cancel)
            finally:
                os.close(fd)
        if digest != hexd.lower():
            wrong.append(f"{file.relative_to(base)} (got {digest[:12]}, want {hexd[:12]})")
    if wrong:
        raise RunnerError(f"sha256 mismatch: {_names(wrong)}", code=ErrorCode.CHECKSUM_MISMATCH)


def _sha256_fd(fd: int, cancel: threading.Event | None) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    offset = 0
    while n := os.preadv(fd, [view], offset):
        if cancel is not None and cancel.is_set():
            raise RunnerError("reload cancelled while hashing", code=ErrorCode.COMMAND_TIMEOUT)
        digest.update(view[:n])
        offset += n
    return digest.hexdigest()


# --------------------------------------------------------------------------- copy


class _ShortRead(OSError):
    pass


def _completed() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


#: Stands in the window for a tensor copied synchronously behind chunks still in flight.
_DONE: Final = _completed()
#: A read in the copier's window: the read, tensors it completes, what to do once it is in.
_Read = tuple[Future[None], int, Callable[[], None] | None]
#: The smallest staging slot (a smaller ``staging_bytes`` still gets two slots of this size).
_MIN_SLOT_BYTES: Final = 512 * 1024


def _copy(
    ckpt: OpenCheckpoint,
    plan: list[tuple[TensorEntry, torch.Tensor]],
    copier: _Copier,
    version: str,
    from_version: str | None,
    cancel: threading.Event | None,
    progress: Progress | None,
    sync: Callable[[], None] | None,
) -> None:
    reported = 0

    def report() -> None:
        # One call per tensor, in plan order, once every byte of it is in.
        nonlocal reported
        if progress is None:
            reported = copier.done
            return
        while reported < copier.done:
            reported += 1
            progress(reported, len(plan))

    try:
        if progress is not None:
            progress(0, len(plan))
        with torch.no_grad():
            for entry, dst in plan:
                if cancel is not None and cancel.is_set():
                    raise RunnerError("cancelled", code=ErrorCode.COMMAND_TIMEOUT)
                copier.copy(ckpt.fds[entry.file], entry, dst)
                report()
            copier.finish()
            report()
            if sync is not None:
                sync()
    except Exception as exc:
        copier.abandon()  # every reader has stopped before the failure is reported
        reason = exc.message if isinstance(exc, RunnerError) else f"{type(exc).__name__}: {exc}"
        raise WeightsCorrupted(
            f"reload to {version!r} failed after {copier.done} of {len(plan)} tensors were "
            f"written ({reason}); the model mixes {from_version!r} and {version!r}",
            from_version=from_version,
            to_version=version,
        ) from exc
    finally:
        copier.close()  # no reader thread outlives the reload, nor writes after it returns


class _Copier:
    """Moves tensors' bytes from a file into their destinations without a second model copy.

    Reads go to a pool of readers, chunk by chunk, with a window of chunks in flight across
    tensor boundaries, so that no reader idles at the end of a tensor waiting for the next one:

    * host-memory destinations (CPU tensors, host aliases of device buffers) are read straight
      into, in ``read_chunk`` chunks;
    * CUDA destinations are read into a ring of pinned staging slots (``staging_bytes`` in all),
      and each slot is copied to the device asynchronously as soon as its read is in, then reused
      once that copy has finished: reads overlap each other and the host-to-device copies;
    * anything else (XLA's own path, strided tensors) goes through one host tensor at a time.

    ``done`` counts the tensors, in plan order, whose every byte has been read (and, for CUDA,
    whose copies have been issued; :meth:`finish` waits for those).
    """

    def __init__(
        self,
        staging_bytes: int,
        flush: Callable[[], None] | None = None,
        *,
        threads: int = 1,
        read_chunk: int = DEFAULT_READ_CHUNK_BYTES,
    ) -> None:
        self._threads = threads
        self._read_chunk = read_chunk
        self._pool: ThreadPoolExecutor | None = None  # started by the first pooled read
        #: Reads submitted and not yet collected, in submission order: the read, the number of
        #: tensors complete once it is in (1 for a tensor's last chunk, else 0), and what the
        #: calling thread does with it then (issue a staged chunk's device copy), if anything.
        self._in_flight: collections.deque[_Read] = collections.deque()
        self._window = READ_WINDOW_CHUNKS_PER_THREAD * threads
        self.done = 0
        self._budget = staging_bytes
        self._flush = flush
        self._pending = 0
        self._slot_bytes = min(read_chunk, max(_MIN_SLOT_BYTES, staging_bytes // 2))
        self._slot_count = max(2, staging_bytes // self._slot_bytes)
        self._slots: list[torch.Tensor] = []  # free staging slots
        self._slots_made = 0
        #: Slots whose device copy was issued, oldest first, with the event that marks its end.
        self._copying: collections.deque[tuple[torch.Tensor, torch.cuda.Event | None]] = (
            collections.deque()
        )

    def copy(self, fd: int, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Copy one tensor, or submit its chunks to the readers and return."""
        if entry.nbytes == 0:
            pass
        elif dst.device.type == "cpu" and dst.is_contiguous():
            # Page cache -> parameter memory: no mmap, no temporary; chunks from several threads.
            if self._threads > 1:
                self._submit_direct(fd, _byte_view(dst.detach()), entry)
                return
            _read_exact(fd, _byte_view(dst.detach()), entry)
        elif dst.device.type == "cuda" and dst.is_contiguous():
            self.copy_staged(fd, entry, dst)
            return
        else:
            # XLA and other devices (or strided tensors): one host tensor at a time.
            host = torch.empty(entry.shape, dtype=dst.dtype)
            _read_exact(fd, _byte_view(host), entry)
            dst.copy_(host)
            # A lazy device (XLA) may hold each host tensor until it syncs: flush every
            # staging budget so host memory stays bounded, not a second copy of the model.
            self._pending += entry.nbytes
            if self._flush is not None and self._pending >= self._budget:
                self._flush()
                self._pending = 0
        self._count_done()

    def copy_staged(self, fd: int, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Read ``entry`` through the staging slots into ``dst`` (CUDA; any contiguous tensor)."""
        if entry.nbytes == 0:
            self._count_done()
            return
        pool = self._readers()
        dst_bytes = dst.detach().reshape(-1).view(torch.uint8)
        size = self._slot_bytes
        for start in range(0, entry.nbytes, size):
            n = min(size, entry.nbytes - start)
            slot = self._free_slot(pinned=dst.device.type == "cuda")
            read = pool.submit(_read_exact, fd, slot.numpy().data[:n], entry, start)
            target = dst_bytes[start : start + n]
            self._in_flight.append(
                (read, 1 if start + n >= entry.nbytes else 0, self._device_copy(slot, target))
            )

    def _count_done(self) -> None:
        """A tensor copied synchronously: counted after those still in flight, in plan order."""
        if not self._in_flight:
            self.done += 1
        else:
            self._in_flight.append((_DONE, 1, None))

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="reload-pread")
        return self._pool

    def _submit_direct(self, fd: int, buf: memoryview, entry: TensorEntry) -> None:
        pool = self._readers()
        chunk = self._read_chunk
        for start in range(0, entry.nbytes, chunk):
            while len(self._in_flight) >= self._window:
                self._collect_oldest()
            read = pool.submit(_read_exact, fd, buf[start : start + chunk], entry, start)
            self._in_flight.append((read, 1 if start + chunk >= entry.nbytes else 0, None))
        while self._in_flight and self._in_flight[0][0].done():
            self._collect_oldest()

    def _collect_oldest(self) -> None:
        read, completes, then = self._in_flight.popleft()
        read.result()  # the first error in plan (= file) order; the caller abandons the rest
        if then is not None:
            then()
        self.done += completes

    def _free_slot(self, *, pinned: bool) -> torch.Tensor:
        """A staging slot nobody reads into or copies from, waiting for one if need be."""
        while not self._slots:
            if self._slots_made < self._slot_count:
                self._slots_made += 1
                return torch.empty(self._slot_bytes, dtype=torch.uint8, pin_memory=pinned)
            if self._copying:
                slot, event = self._copying.popleft()
                if event is not None:
                    event.synchronize()  # its device copy has finished: the slot is free
                self._slots.append(slot)
            else:
                self._collect_oldest()  # a read into a slot is in: its copy is issued
        return self._slots.pop()

    def _device_copy(self, slot: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
        def issue() -> None:
            n = target.numel()
            if target.device.type != "cuda":  # a synchronous copy: the slot is free again
                target.copy_(slot[:n])
                self._slots.append(slot)
                return
            target.copy_(slot[:n], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(target.device))  # type: ignore[no-untyped-call]
            self._copying.append((slot, event))

        return issue

    def finish(self) -> None:
        """Wait until every byte is in place (raising the first read error)."""
        while self._in_flight:
            self._collect_oldest()
        self._wait_for_copies()

    def abandon(self) -> None:
        """After a failure: wait for every read and device copy still in flight, so that none
        writes after the failure is reported."""
        wait_futures([read for read, _, _ in self._in_flight])
        self._in_flight.clear()
        self._wait_for_copies()

    def _wait_for_copies(self) -> None:
        while self._copying:
            slot, event = self._copying.popleft()
            if event is not None:
                event.synchronize()
            self._slots.append(slot)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._wait_for_copies()  # no device copy may still read a slot that is freed
        self._slots.clear()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _read_exact(fd: int, buf: memoryview, entry: TensorEntry, start: int = 0) -> None:
    done = 0
    size = len(buf)
    while done < size:
        n = os.preadv(fd, [buf[done:]], entry.offset + start + done)
        if n == 0:
            raise _ShortRead(
                f"{entry.file.name!r} ended inside tensor {entry.name!r} "
                f"({start + done} of {entry.nbytes} bytes read)"
            )
        done += n


def _names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def _unreadable(message: str) -> RunnerError:
    return RunnerError(message, code=ErrorCode.WEIGHTS_UNREADABLE)
