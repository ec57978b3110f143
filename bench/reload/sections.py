"""One section per device (each run in its own subprocess): torch on the CPU, XLA, CUDA."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.reload import MB
from bench.reload.floors import h2d_baselines, memcpy_baselines, one_reader
from bench.reload.limits import QUEUE_DEPTHS, memcpy_loaders, parallel_pread, sweep
from bench.reload.measure import (
    load_file_state_dict,
    measure,
    model_facts,
    naive_loop,
    runner_reload,
    sequential_read,
)
from bench.reload.peers import TUNABLE, Setting, load_file_copy, peer_label, unavailable

Loader = Callable[[], None]


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
    out["limits"] = {"cores": cores()}
    runs.append(memcpy_limit(targets, nbytes, r, out["limits"]))
    threads = torch.get_num_threads()
    readers = [  # (label, reload), page-cached and then cold, in this order
        ("sequential read (64 MiB buffer)", sequential_read(path)),
        (f"ours: TorchRunner.reload_weights ({threads} readers)", runner_reload(runner, path)),
        ("one reader: the same loader, read_threads=1", one_reader(path, targets)),
        ("naive: safe_open+get_tensor+copy_", naive_loop(path, targets, nothing)),
        ("load_file + load_state_dict", load_file_state_dict(path, runner._model, nothing)),
        ("peer: safetensors load_file + copy_", load_file_copy(path, targets, nothing)),
    ]
    verified = verified_reloads(runner, path)
    if not verified:
        out["verified"] = "skipped: model-signing (the [verify] extra) is not installed"
    readers[2:2] = verified
    peers = tuned_peers(path, targets, nothing, nbytes, args, out, cold=bool(c))
    for label, fn in [*readers, *peers.cached]:
        runs.append(timed(label, fn, nbytes, repeats=r, path=path))
    if c:
        runs.append(pread_limit(path, nbytes, c, out["limits"]))
    for label, fn in [*readers, *peers.cold] if c else []:
        runs.append(timed(label, fn, nbytes, repeats=c, path=path, cold=True))
    runs.extend(peers.missing)
    out["peer_settings"] = peers.best
    out["last_reload"] = runner.describe().extra.get("last_reload")
    runner.close()
    return out


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def timed(label: str, fn: Callable[[], object], nbytes: int, **kw: Any) -> dict[str, Any]:
    """``measure``, but a failure (a peer's) is a row that says why, not a crashed section."""
    try:
        return measure(label, fn, nbytes, **kw)
    except Exception as exc:
        print(f"  {label:<34} failed: {exc!r}", flush=True)
        return {"name": label, "cold": bool(kw.get("cold")), "gbps": None, "error": repr(exc)}


def memcpy_limit(
    targets: dict[str, Any], nbytes: int, repeats: int, limits: dict[str, Any]
) -> dict[str, Any]:
    """The cached limit: the model's bytes copied from resident memory into its tensors at the
    best parallelism (limits.py), swept, then the best measured as a row."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    candidates = memcpy_loaders(targets, src, limits["cores"])
    points = sweep(candidates, nbytes)
    limits["memcpy_sweep"] = points
    best = points[0]["setting"]
    limits["memcpy_best"] = best
    row = timed(
        f"limit: parallel memcpy into the model ({best})",
        dict(candidates)[best],
        nbytes,
        repeats=repeats,
    )
    del src, candidates
    gc.collect()
    return row


def pread_limit(path: Path, nbytes: int, repeats: int, limits: dict[str, Any]) -> dict[str, Any]:
    """The cold limit: the file read by k threads with preadv (queue depth k), swept, the best
    measured as a row (page cache dropped before every run)."""
    size = path.stat().st_size
    candidates = [
        (f"preadv{' O_DIRECT' if direct else ''} from {k} threads", parallel_pread(path, k, direct))
        for direct in (False, True)
        for k in QUEUE_DEPTHS
    ]
    points = sweep(candidates, size, path=path, cold=True)
    limits["pread_sweep"] = points
    best = points[0]["setting"]
    limits["pread_best"] = best
    return timed(
        f"limit: parallel read ({best}, 8 MiB ranges)",
        dict(candidates)[best],
        nbytes,
        repeats=repeats,
        path=path,
        cold=True,
    )


class Peers:
    """The tunable peers' rows: (label, loader) cached and cold, rows for the missing ones, and
    the settings chosen (for the XLA section, which reuses them instead of sweeping again)."""

    def __init__(self) -> None:
        self.cached: list[tuple[str, Loader]] = []
        self.cold: list[tuple[str, Loader]] = []
        self.missing: list[dict[str, Any]] = []
        self.best: dict[str, dict[str, Any]] = {}


def tuned_peers(
    path: Path,
    targets: dict[str, Any],
    sync: Callable[[], object],
    nbytes: int,
    args: argparse.Namespace,
    out: dict[str, Any],
    *,
    cold: bool,
    device: str = "cpu",
    how: str = "",
) -> Peers:
    """runai-model-streamer and fastsafetensors at their defaults and at the best of their
    documented settings: swept here (cached, and cold when ``cold``), or taken from
    ``args.peer_settings`` (what the torch section chose) when given."""
    peers = Peers()
    chosen = json.loads(args.peer_settings) if getattr(args, "peer_settings", None) else None
    sweeps = out.setdefault("peer_sweeps", {})
    for dist, (module, settings_of, loader_of) in TUNABLE.items():
        why = unavailable(dist, module)
        if why is not None:
            print(f"  peer {dist}: {why}", flush=True)
            for is_cold in [False, True] if cold else [False]:
                label = peer_label(dist, "defaults", how)
                peers.missing.append({"name": label, "cold": is_cold, "gbps": None, "error": why})
            continue

        def make(s: Setting, _l: Callable[..., Loader] = loader_of) -> Loader:
            return _l(path, targets, sync, s, device=device)

        settings = settings_of(cores(), args.sweep != "full")
        if chosen is not None:
            best = {k: Setting.from_json(v) for k, v in chosen.get(dist, {}).items()}
        else:
            best = {}
            candidates = [(s.label, make(s)) for s in settings]
            by_label = {s.label: s for s in settings}
            sweeps[dist] = {"cached": sweep(candidates, nbytes)}
            best["cached"] = by_label[sweeps[dist]["cached"][0]["setting"]]
            if cold:
                sweeps[dist]["cold"] = sweep(candidates, nbytes, path=path, cold=True)
                best["cold"] = by_label[sweeps[dist]["cold"][0]["setting"]]
        peers.best[dist] = {k: v.as_json() for k, v in best.items()}
        for state, rows in [("cached", peers.cached), ("cold", peers.cold if cold else None)]:
            if rows is None:
                continue
            top = best.get(state)
            if top is None or top.label == settings[0].label:  # the defaults won: one row
                shown = "defaults" if top is None else "defaults, the best of the sweep"
                rows.append((peer_label(dist, shown, how), make(settings[0])))
            else:
                rows.append((peer_label(dist, "defaults", how), make(settings[0])))
                rows.append((peer_label(dist, f"best: {top.label}", how), make(top)))
    return peers


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

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from workers.weights.oms import SIGN_SHARD_BYTES, load_model_trust, sign_checkpoint

    keys = path.parent.parent / "signing-keys"  # in the run's temporary folder, removed with it
    keys.mkdir(exist_ok=True)
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
    xla_cold = bool(c and args.xla_cold)
    peers = tuned_peers(
        path, targets, sync, nbytes, args, out, cold=xla_cold, how=" to host, copy_ to XLA"
    )
    host_then_device = [
        ("peer: safetensors load_file + copy_ to XLA", load_file_copy(path, targets, sync)),
        *peers.cached,
    ]
    for label, fn in host_then_device:
        runs.append(timed(label, fn, nbytes, repeats=r, path=path))
    out["breakdown"] = xla_breakdown(path, targets, sync)
    dlpack = xla_dlpack_reader(path, targets)
    if dlpack is not None:
        runs.append(
            measure(
                "what-if: pread into PJRT buffers (DLPack)", dlpack, nbytes, repeats=r, path=path
            )
        )
        out["dlpack_matches_checkpoint"] = _matches(path, targets)
    if xla_cold:
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
        cold_peers = [
            ("naive: safe_open+get_tensor+copy_", naive_loop(path, targets, sync)),
            (host_then_device[0][0], host_then_device[0][1]),
            *peers.cold,
        ]
        for label, fn in cold_peers:
            runs.append(timed(label, fn, nbytes, repeats=c, path=path, cold=True))
    runs.extend(peers.missing)
    out["peer_settings"] = peers.best
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
    peers = tuned_peers(
        path, targets, sync, nbytes, args, out, cold=bool(c), device="cuda", how=" to cuda"
    )
    readers += [
        ("load_file(cuda) + load_state_dict", state_dict, on_gpu),
        (
            "peer: safetensors load_file(cuda) + copy_",
            load_file_copy(path, targets, sync, device="cuda"),
            on_gpu,
        ),
    ]
    for label, fn, kw in [*readers, *((lb, f, on_gpu) for lb, f in peers.cached)]:
        runs.append(timed(label, fn, nbytes, repeats=r, path=path, **kw))
    for label, fn, kw in [*readers, *((lb, f, on_gpu) for lb, f in peers.cold)] if c else []:
        runs.append(timed(label, fn, nbytes, repeats=c, path=path, cold=True, **kw))
    runs.extend(peers.missing)
    out["peer_settings"] = peers.best
    out["last_reload"] = runner.describe().extra.get("last_reload")
    runner.close()
    return out


SECTIONS: dict[str, Callable[[Path, dict[str, Any], argparse.Namespace], dict[str, Any]]] = {
    "torch": section_torch,
    "xla": section_xla,
    "cuda": section_cuda,
}
