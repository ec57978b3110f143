"""Check the bytes a reload copies against the digests a trusted signature gives (oms.py).

Every signed span (a shard, or a whole file) is hashed as soon as every tensor it overlaps has
been copied, while the copy goes on, by threads of its own (hashlib releases the GIL): tensor
bytes are hashed from where they were copied to (host memory:
the model's own parameters, so what is checked is what the model now holds), the header, gaps
and tensors not copied (a tied weight's second name, device destinations) from the open file.
The disk is read once; a byte changed in the file while it was copied is caught, since the
copied byte is what is hashed.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from workers.weights.checks import OpenCheckpoint, TensorEntry, failure_reason, names
from workers.weights.copy import byte_view
from workers.weights.oms import SignedDigests, Span

_SCRATCH_BYTES = 8 * 1024 * 1024


class CopiedBytesMismatch(WeightsCorrupted):
    """The bytes copied are not the signed ones: the model now mixes two checkpoints.

    A runner that knows the checkpoint in force before restores it and NACKs ``nack_code``:
    CHECKSUM_MISMATCH, or COMMAND_TIMEOUT when the reload was cancelled while hashing.
    """

    nack_code: WireCode = WireCode.CHECKSUM_MISMATCH


@dataclass(frozen=True)
class _Region:
    offset: int
    nbytes: int
    memory: memoryview  # where the bytes were copied to, in host memory


def _regions(
    ckpt: OpenCheckpoint, plan: list[tuple[TensorEntry, torch.Tensor]]
) -> dict[int, list[_Region]]:
    by_fd: dict[int, list[_Region]] = {}
    for entry, dst in plan:
        if entry.nbytes == 0 or dst.device.type != "cpu" or not dst.is_contiguous():
            continue
        region = _Region(entry.offset, entry.nbytes, byte_view(dst.detach()))
        by_fd.setdefault(ckpt.fds[entry.file], []).append(region)
    for regions in by_fd.values():
        regions.sort(key=lambda r: r.offset)
    return by_fd


def _hash_span(fd: int, span: Span, regions: list[_Region], cancel: threading.Event | None) -> str:
    digest = hashlib.sha256()
    scratch = memoryview(b"")  # for the bytes hashed from the file; most spans need none

    def from_file(start: int, end: int) -> None:
        nonlocal scratch
        if len(scratch) < min(_SCRATCH_BYTES, end - start):
            scratch = memoryview(bytearray(min(_SCRATCH_BYTES, end - start)))
        while start < end:
            if cancel is not None and cancel.is_set():
                raise RunnerError("cancelled while hashing", code=WireCode.COMMAND_TIMEOUT)
            n = os.preadv(fd, [scratch[: min(len(scratch), end - start)]], start)
            if n == 0:
                raise RunnerError("file ended while hashing", code=WireCode.CHECKSUM_MISMATCH)
            digest.update(scratch[:n])
            start += n

    pos = span.start
    starts = [r.offset for r in regions]
    i = max(0, bisect.bisect_right(starts, pos) - 1)
    while pos < span.end and i < len(regions):
        region = regions[i]
        i += 1
        r_end = region.offset + region.nbytes
        if r_end <= pos:
            continue
        if region.offset >= span.end:
            break
        if region.offset > pos:
            from_file(pos, region.offset)
            pos = region.offset
        stop = min(r_end, span.end)
        digest.update(region.memory[pos - region.offset : stop - region.offset])
        pos = stop
    from_file(pos, span.end)
    return digest.hexdigest()


@dataclass(frozen=True)
class _Unit:
    ready: int  # hashed once this many tensors of the plan are in (0: at once)
    file: Path
    span: Span
    fd: int


class CopyHasher:
    """Hashes the signed spans while the copy goes on: each span as soon as every tensor it
    overlaps is in (``advance``, from the copy's progress), on its own threads, so hashing
    overlaps reading (a cold file); :meth:`finish` waits and compares. Close it in any case."""

    def __init__(
        self,
        ckpt: OpenCheckpoint,
        plan: list[tuple[TensorEntry, torch.Tensor]],
        signed: SignedDigests,
        *,
        threads: int,
        cancel: threading.Event | None = None,
    ) -> None:
        self._regions = _regions(ckpt, plan)
        self._cancel = cancel
        self._planned = len(plan)
        units: list[_Unit] = []
        for file in ckpt.files.files:
            # Plan positions, in file order (the plan is sorted by file, then offset).
            mine = [
                (e.offset, e.offset + e.nbytes, i)
                for i, (e, _) in enumerate(plan)
                if e.file == file
            ]
            offsets = [o for o, _, _ in mine]
            ends = [end for _, end, _ in mine]
            for span in signed.files[file]:
                lo = bisect.bisect_right(ends, span.start)
                hi = bisect.bisect_left(offsets, span.end)
                ready = max((i + 1 for _, _, i in mine[lo:hi]), default=0)
                units.append(_Unit(ready, file, span, ckpt.fds[file]))
        units.sort(key=lambda u: u.ready)
        self._units = units
        self._next = 0
        self._hashed: list[tuple[_Unit, Future[str]]] = []
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="reload-sha256")

    def advance(self, done: int) -> None:
        """``done`` tensors of the plan are in: hash every span that needs no more."""
        while self._next < len(self._units) and self._units[self._next].ready <= done:
            unit = self._units[self._next]
            regions = self._regions.get(unit.fd, [])
            future = self._pool.submit(_hash_span, unit.fd, unit.span, regions, self._cancel)
            self._hashed.append((unit, future))
            self._next += 1

    def finish(self, *, version: str, from_version: str | None) -> None:
        """Every tensor is in: wait for every span's hash; CopiedBytesMismatch if one differs
        from its signed digest (or could not be taken)."""
        self.advance(self._planned)
        wrong: list[str] = []
        try:
            for unit, future in self._hashed:
                if future.result() != unit.span.sha256:
                    wrong.append(f"{unit.file.name}[{unit.span.start}:{unit.span.end}]")
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

    def close(self) -> None:
        """No hashing thread outlives the reload (spans not started are dropped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
