"""Timing one way of loading the bytes: page-cache control, the timed runs with their memory
peaks, and the readers under test.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import peak_rss
from bench.reload import MB, READ_BUFFER


def drop_cache(path: Path) -> None:
    """Evict ``path`` from the page cache (clean pages of a file nobody maps)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float | None:
    """Fraction of ``path``'s pages in the page cache (mincore), None where it cannot tell."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                return sum(bytes(vec)) / pages if pages else 1.0  # one bit per page, 0 or 1
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None


def measure(
    name: str,
    fn: Callable[[], object],
    nbytes: int,
    *,
    repeats: int,
    path: Path | None = None,
    cold: bool = False,
    warmup: bool = True,
    sync: Callable[[], object] | None = None,
    gpu: bool = False,
) -> dict[str, Any]:
    """Time ``fn`` ``repeats`` times (after one warm-up when cached); GB/s and peak extra memory."""
    import torch

    first = {"anon": 0, "file": 0}
    if warmup and not cold:
        gc.collect()
        with peak_rss() as first:  # the first run allocates what later runs may reuse
            fn()
            if sync is not None:
                sync()
    times: list[float] = []
    anon = file = 0
    gpu_peak = 0
    resident: list[float | None] = []
    for _ in range(repeats):
        gc.collect()
        if cold:
            assert path is not None
            drop_cache(path)
        if path is not None:
            resident.append(resident_fraction(path))
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with peak_rss() as peak:
            start = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            times.append(time.perf_counter() - start)
        anon, file = max(anon, peak["anon"]), max(file, peak["file"])
        if gpu:
            gpu_peak = max(gpu_peak, torch.cuda.max_memory_allocated() - base)
        gc.collect()
    median = statistics.median(times)
    out: dict[str, Any] = {
        "name": name,
        "cold": cold,
        "runs_s": times,
        "median_s": median,
        "gbps": nbytes / median / 1e9,
        "best_gbps": nbytes / min(times) / 1e9,
        "peak_extra_anon_mb": anon / MB,
        "peak_extra_file_mb": file / MB,
        "first_run_extra_anon_mb": first["anon"] / MB,
        "first_run_extra_file_mb": first["file"] / MB,
    }
    if path is not None:
        out["resident_before"] = resident  # page-cache fraction of the file before each run
    if gpu:
        out["peak_extra_gpu_mb"] = gpu_peak / MB
    state = "cold" if cold else "cached"
    if resident and None not in resident:
        state += f"/{100 * min(r for r in resident if r is not None):.0f}%"
    print(
        f"  {name:<34} {state:<11} {out['gbps']:6.2f} GB/s (best {out['best_gbps']:5.2f}, "
        f"{median:.3f} s)  extra anon {out['peak_extra_anon_mb']:7.1f} MiB, "
        f"file {out['peak_extra_file_mb']:7.1f} MiB (first run: anon "
        f"{out['first_run_extra_anon_mb']:.1f})"
        + (f", GPU {out['peak_extra_gpu_mb']:.1f} MiB" if gpu else ""),
        flush=True,
    )
    return out


def sequential_read(path: Path) -> Callable[[], int]:
    buf = bytearray(READ_BUFFER)

    def read() -> int:
        n = 0
        with open(path, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
        return n

    return read


def naive_loop(
    path: Path, targets: dict[str, Any], sync: Callable[[], object]
) -> Callable[[], None]:
    """What serving engines do: safe_open (mmap), get_tensor (a CPU copy), param.copy_."""
    import torch
    from safetensors import safe_open

    def run() -> None:
        with torch.no_grad(), safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                targets[name].copy_(fh.get_tensor(name))
        sync()

    return run


def load_file_state_dict(
    path: Path, model: Any, sync: Callable[[], object], device: str = "cpu"
) -> Callable[[], None]:
    import torch
    from safetensors.torch import load_file

    def run() -> None:
        with torch.no_grad():
            state = load_file(str(path), device=device)
            model.load_state_dict(state, strict=True)
            del state
        sync()

    return run


def runner_reload(runner: Any, path: Path) -> Callable[[], None]:
    from controlplane.wire.protocol import ReloadWeightsSpec

    counter = iter(range(10**9))

    def run() -> None:
        runner.reload_weights(ReloadWeightsSpec(path=str(path), version=f"v{next(counter)}"), path)

    return run


def model_facts(runner: Any) -> tuple[dict[str, Any], int, int]:
    from workers.weights.loaders import module_targets

    targets, _ = module_targets(runner._model)  # a benchmark-only peek at the runner's model
    nbytes = sum(t.numel() * t.element_size() for t in targets.values())
    largest = max(t.numel() * t.element_size() for t in targets.values())
    return targets, nbytes, largest
