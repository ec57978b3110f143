"""Check the bytes a reload copied against the digests a trusted signature gives (oms.py).

Every signed span (a shard, or a whole file) is hashed once the copy is done, by several threads
(hashlib releases the GIL): tensor bytes are hashed from where they were copied to (host memory:
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from workers.weights.checks import OpenCheckpoint, TensorEntry, failure_reason, names
from workers.weights.copy import byte_view
from workers.weights.oms import SignedDigests, Span

_SCRATCH_BYTES = 8 * 1024 * 1024


class CopiedBytesMismatch(WeightsCorrupted):
    """The bytes copied are not the signed ones: the model now mixes two checkpoints.

    A runner that knows the checkpoint in force before restores it and NACKs CHECKSUM_MISMATCH.
    """


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
    scratch = memoryview(bytearray(min(_SCRATCH_BYTES, max(1, span.end - span.start))))

    def from_file(start: int, end: int) -> None:
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


def check_copied(
    ckpt: OpenCheckpoint,
    plan: list[tuple[TensorEntry, torch.Tensor]],
    signed: SignedDigests,
    *,
    threads: int,
    version: str,
    from_version: str | None,
    cancel: threading.Event | None = None,
) -> None:
    """Hash every signed span of the data files as copied; CopiedBytesMismatch if one differs."""
    regions = _regions(ckpt, plan)
    units = [
        (file, span, ckpt.fds[file]) for file in ckpt.files.files for span in signed.files[file]
    ]
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="reload-sha256") as pool:
            hashed = list(
                pool.map(lambda u: _hash_span(u[2], u[1], regions.get(u[2], []), cancel), units)
            )
    except (RunnerError, OSError) as exc:
        raise CopiedBytesMismatch(
            f"the bytes copied for {version!r} could not be checked ({failure_reason(exc)});"
            f" the model may mix {from_version!r} and {version!r}",
            from_version=from_version,
            to_version=version,
        ) from exc
    wrong = [
        f"{file.name}[{span.start}:{span.end}]"
        for (file, span, _), got in zip(units, hashed, strict=True)
        if got != span.sha256
    ]
    if wrong:
        raise CopiedBytesMismatch(
            f"the bytes copied for {version!r} differ from the signed ones in {names(wrong)};"
            f" the model mixes {from_version!r} and {version!r}",
            from_version=from_version,
            to_version=version,
        )
