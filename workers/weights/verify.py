"""Check the bytes a reload copies against the digests a trusted signature gives (oms.py).

Every signed span (a sha256 shard, or a whole file's sha256 or BLAKE3) is hashed as soon as
every tensor it overlaps has been copied, while the copy goes on, by threads of its own (hashlib
and blake3 release the GIL; a whole file in segments, in order; BLAKE3 splits each segment
between as many threads as the loader has readers). Every byte that decides what the model
holds is hashed as it was used, never read from the file a second time (a writer could have
changed it back meanwhile): each file's header as it was parsed (``OpenCheckpoint.headers``);
tensors from where they were copied to: host memory (the model's own parameters) directly,
other destinations (a device, a strided tensor) read back from them once the copy is done
(one chunk or tensor at a time, never a second copy of the model). Only bytes that decide
nothing are read from the file: gaps, and tensors not copied (a tied weight's second name).
The disk is read once for host-memory destinations; a byte changed in the file while it was
copied is caught, since the copied byte is what is hashed. What a verified reload costs:
docs/benchmarks.md, "3b".
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from workers.weights.checks import OpenCheckpoint, TensorEntry, failure_reason, names
from workers.weights.copy import byte_view
from workers.weights.oms import Hasher, Span, new_hasher
from workers.weights.paths import relative_member

_SCRATCH_BYTES = 8 * 1024 * 1024
#: A span larger than this (a whole file's digest) is hashed in segments as its tensors come in.
_SEGMENT_BYTES = 16 * 1024 * 1024


class CopiedBytesMismatch(WeightsCorrupted):
    """The bytes copied are not the signed ones: the model now mixes two checkpoints.

    A runner that knows the checkpoint in force before restores it and NACKs ``nack_code``:
    CHECKSUM_MISMATCH, or COMMAND_TIMEOUT when the reload was cancelled while hashing.
    """

    nack_code: WireCode = WireCode.CHECKSUM_MISMATCH


#: Read-backs from destinations that are not host memory, one at a time (XLA's lazy tensors are
#: not to be read from several threads at once).
_READBACK = threading.Lock()


@dataclass(frozen=True)
class _Region:
    """Bytes ``[offset, offset + nbytes)`` of a file, hashed as used: from ``memory`` (the header
    as parsed, a tensor copied to host memory) or read back from ``tensor`` (another device, a
    strided tensor) once the copy is done."""

    offset: int
    nbytes: int
    memory: memoryview | None
    tensor: torch.Tensor | None = None

    def hash_into(self, digest: Hasher, begin: int, stop: int) -> None:
        """Hash the region's bytes ``[begin, stop)`` (relative to ``offset``)."""
        if self.memory is not None:
            digest.update(self.memory[begin:stop])
            return
        assert self.tensor is not None
        with _READBACK, torch.no_grad():
            src = self.tensor.detach()
            if src.device.type == "cuda":  # a chunk at a time through host memory
                flat = src.contiguous().reshape(-1).view(torch.uint8)
                for at in range(begin, stop, _SCRATCH_BYTES):
                    digest.update(byte_view(flat[at : min(stop, at + _SCRATCH_BYTES)].cpu()))
            else:  # one host tensor (XLA compiles per shape: no chunks)
                digest.update(byte_view(src.cpu().contiguous())[begin:stop])


def _regions(
    ckpt: OpenCheckpoint, plan: list[tuple[TensorEntry, torch.Tensor]]
) -> dict[int, list[_Region]]:
    """Per open file, the bytes hashed from memory: its header as parsed (the bytes that said
    which tensor is where, never read again), and the tensors copied to host memory."""
    by_fd: dict[int, list[_Region]] = {}
    for file, header in ckpt.headers.items():
        by_fd.setdefault(ckpt.fds[file], []).append(_Region(0, len(header), memoryview(header)))
    for entry, dst in plan:
        if entry.nbytes == 0:
            continue
        if _in_host_memory(dst):
            region = _Region(entry.offset, entry.nbytes, byte_view(dst.detach()))
        else:
            region = _Region(entry.offset, entry.nbytes, None, dst)
        by_fd.setdefault(ckpt.fds[entry.file], []).append(region)
    for regions in by_fd.values():
        regions.sort(key=lambda r: r.offset)
    return by_fd


def _in_host_memory(dst: torch.Tensor) -> bool:
    """Whether the copy reads straight into ``dst`` (the bytes hashed are where it wrote)."""
    return dst.device.type == "cpu" and dst.is_contiguous()


def _feed(
    digest: Hasher,
    fd: int,
    start: int,
    end: int,
    regions: list[_Region],
    cancel: threading.Event | None,
) -> None:
    """Hash bytes ``[start, end)`` of the file at ``fd`` into ``digest``: those of copied tensors
    from where they were copied to, the others from the file."""
    scratch = memoryview(b"")  # for the bytes hashed from the file; most spans need none

    def from_file(begin: int, stop: int) -> None:
        nonlocal scratch
        if len(scratch) < min(_SCRATCH_BYTES, stop - begin):
            scratch = memoryview(bytearray(min(_SCRATCH_BYTES, stop - begin)))
        while begin < stop:
            if cancel is not None and cancel.is_set():
                raise RunnerError("cancelled while hashing", code=WireCode.COMMAND_TIMEOUT)
            n = os.preadv(fd, [scratch[: min(len(scratch), stop - begin)]], begin)
            if n == 0:
                raise RunnerError("file ended while hashing", code=WireCode.CHECKSUM_MISMATCH)
            digest.update(scratch[:n])
            begin += n

    pos = start
    starts = [r.offset for r in regions]
    i = max(0, bisect.bisect_right(starts, pos) - 1)
    while pos < end and i < len(regions):
        region = regions[i]
        i += 1
        r_end = region.offset + region.nbytes
        if r_end <= pos:
            continue
        if region.offset >= end:
            break
        if region.offset > pos:
            from_file(pos, region.offset)
            pos = region.offset
        stop = min(r_end, end)
        region.hash_into(digest, pos - region.offset, stop - region.offset)
        pos = stop
    from_file(pos, end)


class _SpanHash:
    """One span's running hash (sha256, or BLAKE3 on ``threads`` threads of its own), fed
    segment by segment, in order."""

    def __init__(self, span: Span, threads: int) -> None:
        self.digest = new_hasher(span.algorithm, threads=threads)
        self.last: Future[str | None] | None = None


def _hash_segment(
    unit: _Unit,
    prev: Future[str | None] | None,
    regions: list[_Region],
    cancel: threading.Event | None,
) -> str | None:
    if prev is not None:
        prev.result()  # the segment before (started earlier: the pool runs tasks in order)
    _feed(unit.state.digest, unit.fd, unit.start, unit.end, regions, cancel)
    return unit.state.digest.hexdigest() if unit.end == unit.span.end else None


@dataclass(frozen=True)
class _Unit:
    """A segment ``[start, end)`` of a span, hashed once ``ready`` tensors of the plan are in."""

    ready: int
    file: Path
    span: Span
    fd: int
    start: int
    end: int
    state: _SpanHash


def _segments(
    span: Span, tensors: list[tuple[int, int, int]], file: Path, fd: int, threads: int
) -> list[_Unit]:
    """``span`` cut after a tensor every ``_SEGMENT_BYTES`` or so (a whole file is hashed as
    it comes in, not once it is all in); ``tensors``: (offset, end, plan index) overlapping it."""
    state = _SpanHash(span, threads)
    units: list[_Unit] = []
    start, ready = span.start, 0
    for _, end, index in tensors:
        ready = max(ready, index + 1)
        cut = min(end, span.end)
        if cut - start >= _SEGMENT_BYTES and cut < span.end:
            units.append(_Unit(ready, file, span, fd, start, cut, state))
            start = cut
    units.append(_Unit(ready, file, span, fd, start, span.end, state))
    return units


class CopyHasher:
    """Hashes the signed spans while the copy goes on: each span as soon as every tensor it
    overlaps is in (``advance``, from the copy's progress), on its own threads, so hashing
    overlaps reading (a cold file); :meth:`finish` waits and compares. Close it in any case."""

    def __init__(
        self,
        ckpt: OpenCheckpoint,
        plan: list[tuple[TensorEntry, torch.Tensor]],
        digests: Mapping[Path, tuple[Span, ...]],
        *,
        threads: int,
        cancel: threading.Event | None = None,
    ) -> None:
        self._regions = _regions(ckpt, plan)
        self._cancel = cancel
        self._planned = len(plan)
        units: list[_Unit] = []
        for file in ckpt.files.files:
            # Plan positions, in file order (the plan is sorted by file, then offset); a tensor
            # read back from its destination counts as the last: its spans wait for finish().
            mine = [
                (e.offset, e.offset + e.nbytes, i if _in_host_memory(dst) else self._planned)
                for i, (e, dst) in enumerate(plan)
                if e.file == file
            ]
            offsets = [o for o, _, _ in mine]
            ends = [end for _, end, _ in mine]
            for span in digests[file]:
                lo = bisect.bisect_right(ends, span.start)
                hi = bisect.bisect_left(offsets, span.end)
                units.extend(_segments(span, mine[lo:hi], file, ckpt.fds[file], threads))
        units.sort(key=lambda u: u.ready)  # stable: a span's segments stay in order
        self._units = units
        self._next = 0
        self._hashed: list[tuple[_Unit, Future[str | None]]] = []
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="reload-hash")

    def advance(self, done: int) -> None:
        """``done`` tensors of the plan are in: hash every span that needs no more."""
        while self._next < len(self._units) and self._units[self._next].ready <= done:
            unit = self._units[self._next]
            regions = self._regions.get(unit.fd, [])
            future = self._pool.submit(_hash_segment, unit, unit.state.last, regions, self._cancel)
            unit.state.last = future
            if unit.end == unit.span.end:
                self._hashed.append((unit, future))
            self._next += 1

    def finish(self, *, version: str, from_version: str | None) -> None:
        """Every tensor is in (and the copy done: ``sync`` ran): hash the spans that read back
        from the destinations, wait for every span's hash; CopiedBytesMismatch if one differs
        from its signed digest (or could not be taken)."""
        try:
            wrong = self.mismatches()
        except (RunnerError, OSError) as exc:
            unchecked = CopiedBytesMismatch(
                f"the bytes copied for {version!r} could not be checked ({failure_reason(exc)});"
                f" the model may mix {from_version!r} and {version!r}",
                from_version=from_version,
                to_version=version,
            )
            if isinstance(exc, RunnerError) and exc.code == WireCode.COMMAND_TIMEOUT:
                unchecked.nack_code = WireCode.COMMAND_TIMEOUT
            raise unchecked from exc
        if wrong:
            raise CopiedBytesMismatch(
                f"the bytes copied for {version!r} differ from the signed ones in {names(wrong)};"
                f" the model mixes {from_version!r} and {version!r}",
                from_version=from_version,
                to_version=version,
            )

    def mismatches(self) -> list[str]:
        """Every tensor is in: hash what is left, wait for every span's hash, and name the spans
        that differ from their digests. Raises what hashing raised (RunnerError, OSError)."""
        self.advance(self._planned + 1)
        return [
            f"{unit.file.name}[{unit.span.start}:{unit.span.end}]"
            for unit, future in self._hashed
            if future.result() != unit.span.digest
        ]

    def close(self) -> None:
        """No hashing thread outlives the reload (spans not started are dropped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def whole_file_spans(
    ckpt: OpenCheckpoint, sha256: Mapping[str, str]
) -> dict[Path, tuple[Span, ...]]:
    """The data files' expected sha256 from a command's manifest, as one span per file (a file
    the manifest does not list is left to ``verify_sha256``, which refuses it)."""
    base = ckpt.files.base_dir
    wanted = {
        relative_member(base, name, "sha256 manifest entry"): hexd.lower()
        for name, hexd in sha256.items()
    }
    return {
        file: (Span(0, os.fstat(ckpt.fds[file]).st_size, wanted[file], "sha256"),)
        for file in ckpt.files.files
        if file in wanted
    }
