"""Reload bandwidth and memory: in-place reloads into the torch (CPU), XLA (CPU) and CUDA runners.

Writes one fp32 checkpoint of the built-in ``workers.runners.tiny_lm:tiny_lm`` (~1 GB quick, ~4 GB full),
then runs each section in its own subprocess (clean memory, clean RSS baseline):

* **torch** (CPU): baselines, then the runner. Baselines: memcpy (``copy_`` from one preallocated
  flat buffer into the model's own tensors: the same bytes into the same places, the limit when
  the file is cached; also one flat buffer into another), a sequential read of the file
  (``readinto`` a reused 64 MiB buffer: the limit when it is not), the naive per-tensor loop
  serving engines use (``safe_open`` + ``get_tensor`` + ``param.copy_``) and ``load_file`` +
  ``load_state_dict``. Each page-cached, and cold (``posix_fadvise(DONTNEED)`` first; the
  resident fraction before each cold run is checked with ``mincore`` and reported).
* **xla**: the XLA runner on PJRT's CPU device, with the naive loop on the same device and a
  breakdown of where its time goes (read, ``copy_`` to the device, ``torch_xla.sync``).
* **cuda** (skipped without a GPU): pinned and pageable host-to-device bandwidth, the naive loop,
  ``load_file(device="cuda")`` + ``load_state_dict``, and the runner (pinned, double-buffered
  staging); GPU memory peaks from ``torch.cuda.max_memory_allocated``.

Peak extra memory is sampled from /proc/self/status every millisecond during each run: anonymous
(really extra) and file-backed (page cache mapped by mmap readers) separately.

    .venv/bin/python -m bench.reload --quick            # ~1 GB checkpoint
    .venv/bin/python -m bench.reload                    # ~4 GB checkpoint
    .venv/bin/python -m bench.reload --quick --sections cuda --cold-repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, conclude, envelope, fmt, mode_of, peak_rss, ratio, table

MB = 2**20
READ_BUFFER = 64 * MB
SIZES = {  # mode -> tiny_lm kwargs
    "tiny": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq": 128},
    "quick": {"d_model": 1024, "n_layers": 20, "n_heads": 8, "max_seq": 128},
    "full": {"d_model": 2048, "n_layers": 20, "n_heads": 8, "max_seq": 128},
}


# =========================================================================== page cache


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


# =========================================================================== measuring


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
            while k := fh.readinto(buf):  # type: ignore[attr-defined]
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


# =========================================================================== sections


def memcpy_baselines(targets: dict[str, Any], nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """The limit when cached: the same bytes copied from resident memory into the same tensors
    (and, for reference, one flat buffer into another). The buffers are freed on return."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    views = []
    offset = 0
    for t in targets.values():
        n = t.numel() * t.element_size()
        views.append((t.view(-1).view(torch.uint8), src[offset : offset + n]))
        offset += n

    def memcpy_params() -> None:
        with torch.no_grad():
            for dst, s in views:
                dst.copy_(s)

    one = min(nbytes, 1024 * MB)
    dst_flat = torch.empty(one, dtype=torch.uint8).fill_(2)
    return [
        measure(
            "memcpy: torch copy_, one buffer",
            lambda: dst_flat.copy_(src[:one]),
            one,
            repeats=repeats,
        ),
        measure(
            "memcpy: glibc memmove, one buffer",
            lambda: ctypes.memmove(dst_flat.data_ptr(), src.data_ptr(), one),
            one,
            repeats=repeats,
        ),
        measure("memcpy: torch copy_ into the model", memcpy_params, nbytes, repeats=repeats),
    ]


def h2d_baselines(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """Host-to-device bandwidth from pinned and from pageable memory (freed on return)."""
    import torch

    sync = torch.cuda.synchronize
    one = min(nbytes, 1024 * MB)
    device_buf = torch.empty(one, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(one, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(one, dtype=torch.uint8).fill_(1)
    runs = [
        measure(
            "H2D pinned (one buffer)",
            lambda: device_buf.copy_(pinned, non_blocking=True),
            one,
            repeats=repeats,
            sync=sync,
            gpu=True,
        ),
        measure(
            "H2D pageable (one buffer)",
            lambda: device_buf.copy_(pageable),
            one,
            repeats=repeats,
            sync=sync,
            gpu=True,
        ),
    ]
    torch.cuda.empty_cache()
    return runs


def one_reader(path: Path, targets: dict[str, Any]) -> Callable[[], None]:
    """The runner's loader with a single reader: what ``read_threads=1`` (cold disks) gives."""
    from workers.weights.loaders import load_checkpoint

    def run() -> None:
        load_checkpoint(path, targets, version="bench", from_version=None, read_threads=1)

    return run


def section_torch(path: Path, kwargs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from workers.runners.torch_runner import TorchRunner

    runner = TorchRunner({"model_kwargs": kwargs, "seed": 0})
    runner.load()
    targets, nbytes, largest = model_facts(runner)
    nothing: Callable[[], None] = lambda: None  # noqa: E731
    r, c = args.repeats, args.cold_repeats
    out: dict[str, Any] = {
        "device": "cpu",
        "tensors": len(targets),
        "bytes": nbytes,
        "largest_tensor_bytes": largest,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "runs": [],
    }
    runs = out["runs"]
    print(f"torch/cpu: {len(targets)} tensors, {nbytes / 1e9:.3f} GB", flush=True)

    runs.extend(memcpy_baselines(targets, nbytes, r))
    threads = torch.get_num_threads()
    readers = [  # (label, reload), page-cached and then cold, in this order
        ("sequential read (64 MiB buffer)", sequential_read(path)),
        (f"ours: TorchRunner.reload_weights ({threads} readers)", runner_reload(runner, path)),
        ("one reader: the same loader, read_threads=1", one_reader(path, targets)),
        ("naive: safe_open+get_tensor+copy_", naive_loop(path, targets, nothing)),
        ("load_file + load_state_dict", load_file_state_dict(path, runner._model, nothing)),
    ]
    for label, fn in readers:
        runs.append(measure(label, fn, nbytes, repeats=r, path=path))
    for label, fn in readers if c else []:
        runs.append(measure(label, fn, nbytes, repeats=c, path=path, cold=True))
    out["last_reload"] = runner.describe().extra.get("last_reload")
    runner.close()
    return out


def section_xla(path: Path, kwargs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torch
        import torch_xla
    except ImportError as exc:
        return {"skipped": f"torch_xla is not importable: {exc}"}
    from workers.runners.xla_runner import XlaRunner

    runner = XlaRunner({"model_kwargs": kwargs, "seed": 0})
    runner.load()
    targets, nbytes, largest = model_facts(runner)
    sync = torch_xla.sync
    r, c = args.repeats, args.cold_repeats
    out: dict[str, Any] = {
        "device": runner.describe().device,
        "tensors": len(targets),
        "bytes": nbytes,
        "largest_tensor_bytes": largest,
        "runs": [],
    }
    runs = out["runs"]
    print(f"xla: {out['device']}, {len(targets)} tensors, {nbytes / 1e9:.3f} GB", flush=True)
    runs.append(
        measure(
            "ours: XlaRunner.reload_weights",
            runner_reload(runner, path),
            nbytes,
            repeats=r,
            path=path,
        )
    )
    runs.append(
        measure(
            "naive: safe_open+get_tensor+copy_",
            naive_loop(path, targets, sync),
            nbytes,
            repeats=r,
            path=path,
        )
    )
    out["breakdown"] = xla_breakdown(path, targets, sync)
    dlpack = xla_dlpack_reader(path, targets)
    if dlpack is not None:
        runs.append(
            measure(
                "what-if: pread into PJRT buffers (DLPack)", dlpack, nbytes, repeats=r, path=path
            )
        )
        out["dlpack_matches_checkpoint"] = _matches(path, targets)
    if c and args.xla_cold:
        runs.append(
            measure(
                "ours: XlaRunner.reload_weights",
                runner_reload(runner, path),
                nbytes,
                repeats=c,
                path=path,
                cold=True,
            )
        )
    del torch
    runner.close()
    return out


def xla_breakdown(
    path: Path, targets: dict[str, Any], sync: Callable[[], object]
) -> dict[str, Any]:
    """The loader's XLA path by hand: pread into a host tensor, copy_ to the device, sync."""
    import torch

    from workers.weights.loaders import _byte_view, _read_exact, open_checkpoint

    t_read = t_copy = t_sync = 0.0
    pending = 0
    with open_checkpoint(path) as ckpt, torch.no_grad():
        start = time.perf_counter()
        for name, entry in ckpt.entries.items():
            dst = targets[name]
            t0 = time.perf_counter()
            host = torch.empty(entry.shape, dtype=dst.dtype)
            _read_exact(ckpt.fds[entry.file], _byte_view(host), entry)
            t1 = time.perf_counter()
            dst.copy_(host)
            t2 = time.perf_counter()
            pending += entry.nbytes
            if pending >= 64 * MB:
                sync()
                pending = 0
            t3 = time.perf_counter()
            t_read, t_copy, t_sync = t_read + t1 - t0, t_copy + t2 - t1, t_sync + t3 - t2
        t0 = time.perf_counter()
        sync()
        t_sync += time.perf_counter() - t0
        total = time.perf_counter() - start
    result = {"total_s": total, "read_s": t_read, "copy_to_device_s": t_copy, "sync_s": t_sync}
    print(
        "  xla breakdown: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()),
        flush=True,
    )
    return result


def xla_dlpack_reader(path: Path, targets: dict[str, Any]) -> Callable[[], None] | None:
    """A what-if for the loader: on PJRT's CPU device a parameter's buffer is host memory, so
    DLPack exposes it as a CPU tensor and the file can be read straight into it (one copy, as on
    the torch CPU path), instead of host tensor -> new device buffer -> swap. None if refused."""
    import torch
    import torch_xla.core.xla_model as xm
    import torch_xla.utils.dlpack as xdl

    from workers.weights.loaders import _byte_view, _read_exact, open_checkpoint

    try:
        first = next(iter(targets.values()))
        torch.utils.dlpack.from_dlpack(xdl.to_dlpack(first))
    except Exception as exc:
        print(f"  DLPack what-if not applicable: {exc!r}", flush=True)
        return None

    def run() -> None:
        xm.wait_device_ops()  # nothing may still read the buffers being overwritten
        with open_checkpoint(path) as ckpt, torch.no_grad():
            for name, entry in ckpt.entries.items():
                host = torch.utils.dlpack.from_dlpack(xdl.to_dlpack(targets[name]))
                _read_exact(ckpt.fds[entry.file], _byte_view(host), entry)

    return run


def _matches(path: Path, targets: dict[str, Any]) -> bool:
    """Whether every device tensor now equals the checkpoint's (proof the what-if is a reload)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return all(torch.equal(fh.get_tensor(n), targets[n].cpu()) for n in fh.keys())  # noqa: SIM118


def section_cuda(path: Path, kwargs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device (torch.cuda.is_available() is False)"}
    from workers.runners.torch_runner import TorchRunner

    runner = TorchRunner({"model_kwargs": kwargs, "seed": 0, "device": "cuda"})
    runner.load()
    targets, nbytes, largest = model_facts(runner)
    sync = torch.cuda.synchronize
    r, c = args.repeats, args.cold_repeats
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "tensors": len(targets),
        "bytes": nbytes,
        "largest_tensor_bytes": largest,
        "runs": [],
    }
    runs = out["runs"]
    print(f"cuda: {out['device']}, {len(targets)} tensors, {nbytes / 1e9:.3f} GB", flush=True)
    runs.extend(h2d_baselines(nbytes, r))
    gc.collect()
    on_gpu: dict[str, Any] = {"gpu": True}
    readers: list[tuple[str, Callable[[], object], dict[str, Any]]] = [
        ("sequential read (64 MiB buffer)", sequential_read(path), {}),
        ("ours: TorchRunner.reload_weights", runner_reload(runner, path), {"sync": sync, **on_gpu}),
        ("naive: safe_open+get_tensor+copy_", naive_loop(path, targets, sync), on_gpu),
    ]
    state_dict = load_file_state_dict(path, runner._model, sync, device="cuda")
    for label, fn, kw in [*readers, ("load_file(cuda) + load_state_dict", state_dict, on_gpu)]:
        runs.append(measure(label, fn, nbytes, repeats=r, path=path, **kw))
    for label, fn, kw in readers if c else []:
        runs.append(measure(label, fn, nbytes, repeats=c, path=path, cold=True, **kw))
    out["last_reload"] = runner.describe().extra.get("last_reload")
    runner.close()
    return out


SECTIONS: dict[str, Callable[[Path, dict[str, Any], argparse.Namespace], dict[str, Any]]] = {
    "torch": section_torch,
    "xla": section_xla,
    "cuda": section_cuda,
}


# =========================================================================== orchestration


def write_ckpt(directory: Path, kwargs: dict[str, Any]) -> tuple[Path, float]:
    from workers.demo.checkpoints import write_checkpoint

    started = time.perf_counter()
    path = write_checkpoint(directory / "ckpt", model_kwargs=kwargs, seed=1)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, so that DONTNEED can drop them later
    finally:
        os.close(fd)
    return path, time.perf_counter() - started


def run_section(
    name: str, path: Path, kwargs: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    cmd = [
        sys.executable,
        "-m",
        "bench.reload",
        "--section",
        name,
        "--ckpt",
        str(path),
        "--kwargs",
        json.dumps(kwargs),
        "--repeats",
        str(args.repeats),
        "--cold-repeats",
        str(args.cold_repeats),
        "--section-out",
        str(out),
    ]
    if args.mode == "quick":  # keeps --quick under 2 minutes: XLA's cold run is the full mode's
        cmd.append("--no-xla-cold")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, check=False, timeout=args.section_timeout
        )
        if proc.returncode != 0:
            return {"error": f"section {name} exited with status {proc.returncode}"}
        data: dict[str, Any] = json.loads(out.read_text())
    except subprocess.TimeoutExpired:
        return {"error": f"section {name} ran over {args.section_timeout} s"}
    finally:
        out.unlink(missing_ok=True)
    data["elapsed_s"] = time.perf_counter() - started
    return data


def _find(section: dict[str, Any], prefix: str, cold: bool = False) -> dict[str, Any] | None:
    for run in section.get("runs", []):
        if run["name"].startswith(prefix) and run["cold"] == cold:
            return run  # type: ignore[no-any-return]
    return None


def _gbps(run: dict[str, Any] | None) -> float | None:
    return None if run is None else float(run["gbps"])


def derive(result: dict[str, Any]) -> None:
    """Ratios to each baseline, and the issue's targets."""
    sections = result["sections"]
    cpu = sections.get("torch", {})
    memcpy = _gbps(_find(cpu, "memcpy: torch copy_, one"))
    read_cold = _gbps(_find(cpu, "sequential read", cold=True))
    ratios: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, limit: float, why: str = "") -> None:
        verdict = "n/a" if value is None else "met" if value >= limit else "missed"
        targets.append(
            {"name": name, "value": value, "limit": limit, "verdict": verdict, "detail": why}
        )

    def memory_target(name: str, section: dict[str, Any], prefix: str, cold: bool = False) -> None:
        run = _find(section, prefix, cold)
        if run is None:
            return
        allowed = section["largest_tensor_bytes"] / MB + 64
        extra = max(run["peak_extra_anon_mb"], run["first_run_extra_anon_mb"])
        targets.append(
            {
                "name": name,
                "value": extra,
                "limit": allowed,
                "verdict": "met" if extra <= allowed else "missed",
                "detail": f"{extra:.0f} MiB anon vs {allowed:.0f} MiB allowed",
            }
        )

    if cpu.get("runs"):
        ours_c = _gbps(_find(cpu, "ours"))
        ours_cold = _gbps(_find(cpu, "ours", cold=True))
        ratios["cpu"] = {
            "cached_over_memcpy": ratio(ours_c, memcpy),
            "one_reader_over_memcpy": ratio(_gbps(_find(cpu, "one reader")), memcpy),
            "one_reader_cold_over_read_cold": ratio(
                _gbps(_find(cpu, "one reader", cold=True)), read_cold
            ),
            "cached_over_memmove": ratio(ours_c, _gbps(_find(cpu, "memcpy: glibc"))),
            "cached_over_memcpy_into_model": ratio(
                ours_c, _gbps(_find(cpu, "memcpy: torch copy_ into"))
            ),
            "cached_over_read_cached": ratio(ours_c, _gbps(_find(cpu, "sequential read"))),
            "cached_over_naive": ratio(ours_c, _gbps(_find(cpu, "naive"))),
            "cached_over_load_file": ratio(ours_c, _gbps(_find(cpu, "load_file"))),
            "cold_over_read_cold": ratio(ours_cold, read_cold),
            "cold_over_naive_cold": ratio(ours_cold, _gbps(_find(cpu, "naive", cold=True))),
            "cold_over_load_file_cold": ratio(ours_cold, _gbps(_find(cpu, "load_file", cold=True))),
        }
        target("CPU cached >= 0.9x memcpy", ratios["cpu"]["cached_over_memcpy"], 0.9)
        target("CPU cold >= 0.9x sequential read", ratios["cpu"]["cold_over_read_cold"], 0.9)
        memory_target("CPU peak extra <= largest tensor + 64 MiB", cpu, "ours")
    xla = sections.get("xla", {})
    if xla.get("runs"):
        ours_x = _gbps(_find(xla, "ours"))
        ratios["xla"] = {
            "cached_over_memcpy": ratio(ours_x, memcpy),
            "dlpack_whatif_over_memcpy": ratio(_gbps(_find(xla, "what-if")), memcpy),
            "cached_over_memmove": ratio(ours_x, _gbps(_find(cpu, "memcpy: glibc"))),
            "cached_over_naive": ratio(ours_x, _gbps(_find(xla, "naive"))),
            "cold_over_read_cold": ratio(_gbps(_find(xla, "ours", cold=True)), read_cold),
        }
        target("XLA CPU >= 0.5x memcpy", ratios["xla"]["cached_over_memcpy"], 0.5)
        memory_target("XLA peak extra <= largest tensor + 64 MiB", xla, "ours")
    cuda = sections.get("cuda", {})
    if cuda.get("runs"):
        ours_g = _gbps(_find(cuda, "ours"))
        ratios["cuda"] = {
            "cached_over_h2d_pinned": ratio(ours_g, _gbps(_find(cuda, "H2D pinned"))),
            "cached_over_h2d_pageable": ratio(ours_g, _gbps(_find(cuda, "H2D pageable"))),
            "cached_over_naive": ratio(ours_g, _gbps(_find(cuda, "naive"))),
            "cached_over_load_file": ratio(ours_g, _gbps(_find(cuda, "load_file"))),
            "cold_over_read_cold": ratio(
                _gbps(_find(cuda, "ours", cold=True)),
                _gbps(_find(cuda, "sequential read", cold=True)),
            ),
        }
        target("CUDA >= 0.8x pinned H2D", ratios["cuda"]["cached_over_h2d_pinned"], 0.8)
        target("CUDA >= 1.5x naive loop", ratios["cuda"]["cached_over_naive"], 1.5)
        memory_target("CUDA host peak extra <= largest tensor + 64 MiB", cuda, "ours")
    result["ratios"] = ratios
    result["targets"] = targets


def report(result: dict[str, Any]) -> str:
    lines = []
    for name, section in result["sections"].items():
        if "runs" not in section:
            lines.append(f"{name}: {section.get('skipped') or section.get('error')}")
            continue
        rows = [
            [
                run["name"],
                "cold" if run["cold"] else "cached",
                run["gbps"],
                run["median_s"],
                run["peak_extra_anon_mb"],
                run["first_run_extra_anon_mb"],
                run["peak_extra_file_mb"],
                run.get("peak_extra_gpu_mb"),
            ]
            for run in section["runs"]
        ]
        lines.append(
            f"{name} ({section['device']}, {section['bytes'] / 1e9:.2f} GB in {section['tensors']} "
            f"tensors, largest {section['largest_tensor_bytes'] / MB:.0f} MiB)"
        )
        lines.append(
            table(
                rows,
                [
                    "method",
                    "cache",
                    "GB/s",
                    "median s",
                    "extra anon MiB",
                    "1st-run anon MiB",
                    "extra file MiB",
                    "extra GPU MiB",
                ],
            )
        )
        if "breakdown" in section:
            b = section["breakdown"]
            lines.append(
                "  XLA path by hand: "
                + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in b.items())
            )
        lines.append("")
    for sec, values in result["ratios"].items():
        lines.append(f"{sec}: " + ", ".join(f"{k} {fmt(v)}x" for k, v in values.items()))
    for t in result["targets"]:
        lines.append(
            f"target {t['name']}: {t['verdict']} ({fmt(t['value'])}"
            + (f"; {t['detail']})" if t["detail"] else ")")
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~1 GB checkpoint.")
    p.add_argument("--tiny", action="store_true", help="~2 MB checkpoint; for the CI smoke test.")
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-layers", type=int)
    p.add_argument("--repeats", type=int, help="Timed runs per cached measurement.")
    p.add_argument("--cold-repeats", type=int, help="Timed runs per cold measurement (0: none).")
    p.add_argument(
        "--sections",
        default="torch,xla,cuda",
        help="Comma-separated: torch, xla, cuda (cuda is skipped without a GPU).",
    )
    p.add_argument("--dir", type=Path, default=None, help="Where to write the checkpoint (a disk).")
    p.add_argument("--section-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--kwargs", help=argparse.SUPPRESS)
    p.add_argument("--section-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--no-xla-cold", dest="xla_cold", action="store_false", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mode = mode_of(args.quick, args.tiny)
    repeats, cold = {"tiny": (1, 1), "quick": (2, 1), "full": (3, 2)}[args.mode]
    args.repeats = args.repeats or repeats
    args.cold_repeats = cold if args.cold_repeats is None else args.cold_repeats
    return args


@contextlib.contextmanager
def _checkpoint_dir(parent: Path | None) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-reload-", dir=parent) as name:
        yield Path(name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.section:  # a child: one section, JSON to --section-out
        kwargs = json.loads(args.kwargs)
        data = SECTIONS[args.section](args.ckpt, kwargs, args)
        args.section_out.write_text(json.dumps(data, default=str))
        return 0
    kwargs = dict(SIZES[args.mode])
    if args.d_model:
        kwargs["d_model"] = args.d_model
    if args.n_layers:
        kwargs["n_layers"] = args.n_layers
    result = envelope("reload", args.mode, argv)
    result["parameters"] = {
        "model_kwargs": kwargs,
        "repeats": args.repeats,
        "cold_repeats": args.cold_repeats,
        "sections": args.sections,
    }
    started = time.perf_counter()
    with _checkpoint_dir(args.dir) as directory:
        path, write_s = write_ckpt(directory, kwargs)
        size = path.stat().st_size
        result["checkpoint"] = {"bytes": size, "write_s": write_s, "dir": str(directory.parent)}
        print(f"checkpoint: {size / 1e9:.3f} GB written in {write_s:.1f} s to {path}", flush=True)
        result["sections"] = {}
        for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
            if name not in SECTIONS:
                raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
            if (
                name == "cuda"
                and result["sections"].get("torch", {}).get("cuda_available") is False
            ):
                # The torch section already looked: spare a subprocess that only imports torch.
                result["sections"][name] = {
                    "skipped": "no CUDA device (torch.cuda.is_available() is False)"
                }
                continue
            result["sections"][name] = run_section(name, path, kwargs, args)
    derive(result)
    return conclude(result, report(result), args.out_dir, started)


if __name__ == "__main__":
    sys.exit(main())
