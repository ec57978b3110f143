"""Where a reload's time goes: one way of loading, repeated, in a process of its own, for
``perf`` to sample (issue 16: "where a target is missed, a profile that says where the time
goes"). Writes the checkpoint first unless ``--ckpt`` names one; prints each run's GB/s and the
process's user and system CPU seconds per GB, so that the split between copying in the kernel
(``pread`` from the page cache) and in user space (``copy_``, ``memcpy``) shows without perf too.

    .venv/bin/python -m bench.reload.profile --what ours --runs 10
    perf record -g -o perf.data -- .venv/bin/python -m bench.reload.profile --ckpt F --what ours
    perf report -i perf.data --no-children --sort symbol | head -40
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.reload import SIZES


def loaders(path: Path, targets: dict[str, Any], runner: Any) -> dict[str, Callable[[], None]]:
    """The ways of loading that can be profiled, by name."""
    import torch

    from bench.reload.limits import memcpy_loaders
    from bench.reload.measure import naive_loop, runner_reload, sequential_read
    from bench.reload.peers import Setting, fastsafetensors_loader, load_file_copy, runai_loader

    nothing: Callable[[], None] = lambda: None  # noqa: E731
    nbytes = sum(t.numel() * t.element_size() for t in targets.values())
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    limits = dict(memcpy_loaders(targets, src, len(os.sched_getaffinity(0))))
    read = sequential_read(path)

    def read_all() -> None:
        read()

    return {
        "ours": runner_reload(runner, path),
        "load_file": load_file_copy(path, targets, nothing),
        "naive": naive_loop(path, targets, nothing),
        "runai": runai_loader(path, targets, nothing, Setting("defaults")),
        "fastsafetensors": fastsafetensors_loader(path, targets, nothing, Setting("defaults")),
        "read": read_all,
        **{f"limit: {k}": v for k, v in limits.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reload.profile", description=__doc__)
    p.add_argument("--what", default="ours", help="ours, load_file, naive, runai, ... or 'list'")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--ckpt", type=Path, help="A checkpoint of tiny_lm with --size's kwargs.")
    p.add_argument("--size", default="quick", choices=sorted(SIZES))
    args = p.parse_args(argv)
    from workers.demo.checkpoints import write_checkpoint
    from workers.runners.torch_runner import TorchRunner
    from workers.weights.loaders import module_targets

    kwargs = SIZES[args.size]
    with tempfile.TemporaryDirectory(prefix="bench-reload-profile-") as tmp:
        path = args.ckpt or write_checkpoint(Path(tmp) / "ckpt", model_kwargs=kwargs, seed=1)
        runner = TorchRunner({"model_kwargs": kwargs, "seed": 0})
        runner.load()
        assert runner._model is not None
        targets, _ = module_targets(runner._model)
        nbytes = sum(t.numel() * t.element_size() for t in targets.values())
        table = loaders(path, targets, runner)
        if args.what == "list":
            print("\n".join(table))
            return 0
        fn = table[args.what]
        table["read"]()  # the page cache: a loader reading with O_DIRECT would not fill it
        fn()  # warm: what the first run allocates
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        for _ in range(args.runs):
            fn()
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        gb = nbytes * args.runs / 1e9
        out = {
            "what": args.what,
            "gbps": gb / wall,
            "user_s_per_gb": (after.ru_utime - before.ru_utime) / gb,
            "sys_s_per_gb": (after.ru_stime - before.ru_stime) / gb,
            "wall_s_per_gb": wall / gb,
            "minor_faults_per_gb": (after.ru_minflt - before.ru_minflt) / gb,
        }
        print(json.dumps(out), flush=True)
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
