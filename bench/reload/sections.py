"""One section per device (each run in its own subprocess): torch on the CPU, XLA, CUDA."""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.reload import MB
from bench.reload.floors import h2d_baselines, memcpy_baselines, one_reader
from bench.reload.measure import (
    load_file_state_dict,
    measure,
    model_facts,
    naive_loop,
    runner_reload,
    sequential_read,
)


def section_out(
    name: str, device: str, targets: dict[str, Any], nbytes: int, largest: int
) -> dict[str, Any]:
    """A device section's result, its runs still to come; says what is measured."""
    print(f"{name}: {device}, {len(targets)} tensors, {nbytes / 1e9:.3f} GB", flush=True)
    return {
        "device": device,
        "tensors": len(targets),
        "bytes": nbytes,
        "largest_tensor_bytes": largest,
        "runs": [],
    }


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
    verified = verified_reloads(runner, path)
    if not verified:
        out["verified"] = "skipped: model-signing (the [verify] extra) is not installed"
    readers[2:2] = verified
    for label, fn in readers:
        runs.append(measure(label, fn, nbytes, repeats=r, path=path))
    for label, fn in readers if c else []:
        runs.append(measure(label, fn, nbytes, repeats=c, path=path, cold=True))
    out["last_reload"] = runner.describe().extra.get("last_reload")
    runner.close()
    return out


#: The verified reloads' rows: the same runner, the checkpoint signed, every copied byte hashed;
#: by hash (what ``checkpoint write --sign-hash`` chooses), BLAKE3 (the default) first.
VERIFIED = {
    "blake3": "verified blake3: the same reload, OMS-signed (whole-file BLAKE3 hashed as copied)",
    "sha256": "verified sha256: the same reload, OMS-signed (8 MiB sha256 shards hashed as copied)",
}


def verified_reloads(runner: Any, path: Path) -> list[tuple[str, Callable[[], None]]]:
    """The runner's reload of ``path`` with its signature checked and the copied bytes hashed
    against it (workers/weights/oms.py, verify.py), one row per hash; none without model-signing.

    Each hash signs a directory of its own (the checkpoint hard-linked: the same inode, so the
    same page cache) with a throwaway ECDSA key first (timed, printed: the cost of
    ``fleet-worker checkpoint write --sign``). The runner trusts that key only while the row
    runs (a benchmark-only swap of its trust), so every other row stays unverified.
    """
    try:
        import model_signing  # noqa: F401
    except ImportError:
        return []
    import tempfile

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from workers.weights.oms import SIGN_SHARD_BYTES, load_model_trust, sign_checkpoint

    keys = Path(tempfile.mkdtemp(prefix="bench-reload-keys-"))
    key = ec.generate_private_key(ec.SECP256R1())
    (keys / "k.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (keys / "k.pub.pem").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    trust = load_model_trust([keys / "k.pub.pem"], required=True)
    rows = []
    for algorithm, label in VERIFIED.items():
        signed = path.parent.parent / f"signed-{algorithm}"
        signed.mkdir(exist_ok=True)
        if not (signed / path.name).exists():
            os.link(path, signed / path.name)
        shards = SIGN_SHARD_BYTES if algorithm == "sha256" else None
        started = time.perf_counter()
        sign_checkpoint(signed, keys / "k.pem", shard_bytes=shards, algorithm=algorithm)
        print(f"signed {signed} ({algorithm}) in {time.perf_counter() - started:.2f} s", flush=True)
        rows.append((label, _trusting(runner, trust, runner_reload(runner, signed / path.name))))
    return rows


def _trusting(runner: Any, trust: Any, plain: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        runner._trust = trust  # a benchmark-only swap: this row verifies, the others do not
        try:
            plain()
        finally:
            runner._trust = None

    return run


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
    out = section_out("xla", runner.describe().device, targets, nbytes, largest)
    runs = out["runs"]
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
    out = section_out("cuda", torch.cuda.get_device_name(0), targets, nbytes, largest)
    runs = out["runs"]
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
