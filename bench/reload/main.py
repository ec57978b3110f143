"""Arguments, the checkpoint, and each section in its own subprocess (``--section``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import bench.reload as package
from bench.common import REPO_ROOT, conclude, envelope, mode_of
from bench.reload import SIZES
from bench.reload.report import derive, report
from bench.reload.sections import SECTIONS


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
    name: str,
    path: Path,
    kwargs: dict[str, Any],
    args: argparse.Namespace,
    peer_settings: dict[str, Any] | None = None,
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
    cmd += ["--sweep", args.mode]
    if args.mode == "quick":  # keeps --quick short: XLA's cold runs are the full mode's
        cmd.append("--no-xla-cold")
    if peer_settings:  # the torch section's choice of the peers' best settings, reused
        cmd += ["--peer-settings", json.dumps(peer_settings)]
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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python -m {package.__name__}", description=(package.__doc__ or "").splitlines()[0]
    )
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
    p.add_argument("--sweep", default="full", help=argparse.SUPPRESS)
    p.add_argument("--peer-settings", help=argparse.SUPPRESS)
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
            # XLA reuses the peers' settings the torch section chose (the same host reads); CUDA
            # sweeps its own (its peers read to the GPU).
            torch_section = result["sections"].get("torch", {})
            chosen = torch_section.get("peer_settings") if name == "xla" else None
            result["sections"][name] = run_section(name, path, kwargs, args, chosen)
    derive(result)
    return conclude(result, report(result), args.out_dir, started)
