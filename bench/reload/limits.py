"""The machine's limits, which the loader's "ours / limit" ratios use (issue 16):

* cached: memcpy of the model's bytes from resident memory into the model's own tensors, at the
  best degree of parallelism: torch's ``copy_`` with ``torch.set_num_threads(k)``, and k Python
  threads each copying a contiguous slice of the bytes (``copy_`` releases the GIL), for k up to
  the cores (powers of two, and the core count);
* cold: reading the file's bytes with ``os.preadv`` from k threads (k = queue depth 1..16), each
  taking the next 8 MiB range into a reused buffer of its own, after dropping the page cache;
  buffered, and with O_DIRECT (which the loader and both tunable peers use for cold reads).

Each k is timed once (its sweep is stored); the best is then measured as a row like the others.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.reload import MB
from bench.reload.measure import drop_cache

READ_CHUNK = 8 * MB
QUEUE_DEPTHS = (1, 2, 4, 8, 16)


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    return sorted({*(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= cores), cores})


def _run_threads(k: int, work: Callable[[int], None]) -> None:
    """``work(i)`` on k threads (the calling thread is one of them); errors propagate."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(1, k)]
    for t in threads:
        t.start()
    guarded(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def memcpy_slices(views: list[tuple[Any, Any]], k: int) -> list[list[tuple[Any, Any]]]:
    """Split (dst, src) byte views into k lists of about equal bytes (cutting tensors)."""
    total = sum(int(d.numel()) for d, _ in views)
    share = -(-total // k)
    out: list[list[tuple[Any, Any]]] = [[] for _ in range(k)]
    i, room = 0, share
    for dst, src in views:
        start, n = 0, int(dst.numel())
        while start < n:
            take = min(n - start, room)
            out[i].append((dst[start : start + take], src[start : start + take]))
            start += take
            room -= take
            if room == 0 and i < k - 1:
                i, room = i + 1, share
    return out


def memcpy_loaders(targets: dict[str, Any], src: Any, cores: int) -> list[tuple[str, Loader]]:
    """(label, copy) for each way and degree of parallel memcpy into the model's tensors."""
    import torch

    views = []
    offset = 0
    for t in targets.values():
        n = t.numel() * t.element_size()
        views.append((t.view(-1).view(torch.uint8), src[offset : offset + n]))
        offset += n
    out: list[tuple[str, Loader]] = []
    for k in thread_counts(cores):
        out.append((f"torch copy_, set_num_threads({k})", _intra_op(views, k)))
    for k in thread_counts(cores):
        if k > 1:
            out.append((f"{k} threads, one slice each", _sliced(memcpy_slices(views, k))))
    return out


Loader = Callable[[], None]


def _intra_op(views: list[tuple[Any, Any]], k: int) -> Loader:
    import torch

    def run() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(k)
        try:
            with torch.no_grad():
                for dst, src in views:
                    dst.copy_(src)
        finally:
            torch.set_num_threads(before)

    return run


def _sliced(slices: list[list[tuple[Any, Any]]]) -> Loader:
    import torch

    def work(i: int) -> None:
        with torch.no_grad():
            for dst, src in slices[i]:
                dst.copy_(src)

    def run() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread per slice, no intra-op pool on top
        try:
            _run_threads(len(slices), work)
        finally:
            torch.set_num_threads(before)

    return run


def parallel_pread(path: Path, k: int, direct: bool = False) -> Loader:
    """The whole file read with ``preadv`` from k threads, 8 MiB ranges taken in file order;
    with ``direct``, through O_DIRECT (page-aligned buffers; the last range rounded up to the
    buffer and cut short by the end of the file), which skips filling the page cache."""
    size = path.stat().st_size
    ranges = [(off, min(READ_CHUNK, size - off)) for off in range(0, size, READ_CHUNK)]
    if direct:
        ranges = [(off, READ_CHUNK) for off, _ in ranges]
    buffers = [mmap.mmap(-1, READ_CHUNK) for _ in range(k)]  # page-aligned, as O_DIRECT needs
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def run() -> None:
        fd = os.open(path, flags)
        counter = itertools.count()  # next() on a count is atomic under the GIL

        def work(i: int) -> None:
            view = memoryview(buffers[i])
            while (j := next(counter)) < len(ranges):
                off, n = ranges[j]
                got = 0
                while got < n:
                    r = os.preadv(fd, [view[got:n]], off + got)
                    if r <= 0:
                        if off + got >= size:
                            break  # O_DIRECT's rounded-up last range
                        raise OSError(f"short read at {off + got} of {path}")
                    got += r

        try:
            _run_threads(k, work)
        finally:
            os.close(fd)

    return run


def sweep(
    candidates: list[tuple[str, Loader]],
    nbytes: int,
    path: Path | None = None,
    cold: bool = False,
) -> list[dict[str, Any]]:
    """Each candidate timed once (cold: the page cache dropped first; cached: after one
    untimed run of the first, to fault in what every candidate shares). Best first."""
    if not cold and candidates:
        candidates[0][1]()
    points: list[dict[str, Any]] = []
    for label, fn in candidates:
        if cold:
            assert path is not None
            drop_cache(path)
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # one failing candidate is a point, not a crash
            points.append({"setting": label, "error": repr(exc)})
            continue
        took = time.perf_counter() - start
        points.append({"setting": label, "s": took, "gbps": nbytes / took / 1e9})
    points.sort(key=lambda p: -p.get("gbps", -1.0))
    for p in points:
        shown = f"{p['gbps']:6.2f} GB/s" if "gbps" in p else f"error {p['error']}"
        print(f"    sweep {'cold' if cold else 'cached'}: {p['setting']:<44} {shown}", flush=True)
    return points
