"""Quick reload benchmark: in-place reload of a ~1 GB fp32 checkpoint into the torch CPU runner
(or, with ``--runner xla``, the XLA runner on PJRT's CPU device).

Compares, on a page-cached file, our validate-then-copy reload against a plain memory copy of the
same bytes (the limit) and the naive ``safe_open`` + ``get_tensor`` + ``copy_`` loop; reports GB/s
and peak extra RSS of each. A measurement, not a test: it asserts nothing.

    .venv/bin/python bench/reload_quick.py [--d-model 1024 --n-layers 20 --repeats 3 --runner torch]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from controlplane.protocol import ReloadWeightsSpec
from workers.checkpoints import write_checkpoint
from workers.loaders import module_targets
from workers.torch_runner import TorchRunner


def _rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process."""
    anon = file = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    return anon, file


@contextmanager
def peak_rss() -> Iterator[dict[str, int]]:
    """Sample RSS every millisecond; yields a dict filled with the peak deltas on exit."""
    base_anon, base_file = _rss()
    out = {"anon": 0, "file": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            anon, file = _rss()
            out["anon"] = max(out["anon"], anon - base_anon)
            out["file"] = max(out["file"], file - base_file)
            stop.wait(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        anon, file = _rss()
        out["anon"] = max(out["anon"], anon - base_anon)
        out["file"] = max(out["file"], file - base_file)


def measure(name: str, fn: Callable[[], object], nbytes: int, repeats: int) -> dict[str, float]:
    """One warm-up run (its RSS peak reported as "first"), then ``repeats`` timed runs."""
    with peak_rss() as first:
        fn()
    times: list[float] = []
    peaks: list[dict[str, int]] = []
    for _ in range(repeats):
        with peak_rss() as peak:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        peaks.append(peak)
    best, median = min(times), statistics.median(times)
    anon = max(p["anon"] for p in peaks) / 2**20
    file = max(p["file"] for p in peaks) / 2**20
    print(
        f"{name:<38} best {nbytes / best / 1e9:5.2f} GB/s  median {nbytes / median / 1e9:5.2f} GB/s "
        f"({median:.3f} s)  peak extra RSS MiB: anon {anon:6.1f}, file {file:6.1f} "
        f"(first run: anon {first['anon'] / 2**20:6.1f}, file {first['file'] / 2**20:6.1f})"
    )
    return {"best_gbps": nbytes / best / 1e9, "median_gbps": nbytes / median / 1e9}


def baselines(
    tensors: list[torch.Tensor], nbytes: int, repeats: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The limit: copies of the same bytes between resident buffers (freed on return)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    one = measure("memcpy (torch copy_, one buffer)", lambda: dst.copy_(src), nbytes, repeats)
    libc = measure(
        "memcpy (glibc memmove, one buffer)",
        lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
        nbytes,
        repeats,
    )
    pairs = [
        (torch.ones(t.shape, dtype=t.dtype), torch.zeros(t.shape, dtype=t.dtype)) for t in tensors
    ]
    per_tensor = measure(
        "memcpy (torch copy_, per tensor)",
        lambda: [d.copy_(s) for d, s in pairs],
        nbytes,
        repeats,
    )
    return one, libc, per_tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="Where to write the checkpoint.")
    parser.add_argument("--runner", choices=["torch", "xla"], default="torch")
    args = parser.parse_args()
    sync: Callable[[], object] = lambda: None  # noqa: E731
    runner_cls: type[TorchRunner] = TorchRunner
    if args.runner == "xla":
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla

        from workers.xla_runner import XlaRunner

        runner_cls, sync = XlaRunner, torch_xla.sync
    torch.set_num_threads(max(1, torch.get_num_threads()))
    kwargs = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": 8, "max_seq": 128}

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        path = write_checkpoint(Path(tmp) / "ckpt", model_kwargs=kwargs, seed=1)
        size = path.stat().st_size
        print(f"checkpoint: {size / 1e9:.3f} GB, written in {time.perf_counter() - t0:.1f} s")
        path.read_bytes()  # make sure it is page-cached (and drop the copy right away)

        runner = runner_cls({"model_kwargs": kwargs, "seed": 0})
        runner.load()
        model = runner._model  # a benchmark-only peek at the runner's model
        assert model is not None
        targets, _ = module_targets(model)
        nbytes = sum(t.numel() * t.element_size() for t in targets.values())
        print(
            f"model on {runner.describe().device}: {len(targets)} tensors, {nbytes / 1e9:.3f} GB fp32, "
            f"{torch.get_num_threads()} threads"
        )

        memcpy, memmove, per_tensor = baselines(list(targets.values()), nbytes, args.repeats)

        counter = iter(range(1_000_000))

        def ours() -> None:
            spec = ReloadWeightsSpec(path=str(path), version=f"v{next(counter)}")
            runner.reload_weights(spec, path)

        ours_stats = measure("ours (validate, then read in place)", ours, nbytes, args.repeats)
        last = runner.describe().extra["last_reload"]
        print(f"  last reload: {last}")

        def naive() -> None:
            with torch.no_grad(), safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                    targets[name].copy_(fh.get_tensor(name))
            sync()

        naive_stats = measure("naive (safe_open+get_tensor+copy_)", naive, nbytes, args.repeats)
        runner.close()

    print()
    print(f"ours / glibc memmove:        {ours_stats['median_gbps'] / memmove['median_gbps']:.2f}x")
    print(f"ours / torch copy_ (1 buf):  {ours_stats['median_gbps'] / memcpy['median_gbps']:.2f}x")
    print(
        f"ours / torch copy_ (tensors):{ours_stats['median_gbps'] / per_tensor['median_gbps']:.2f}x"
    )
    print(
        f"ours / naive safe_open loop: {ours_stats['median_gbps'] / naive_stats['median_gbps']:.2f}x"
    )


if __name__ == "__main__":
    main()
