"""The baselines: memcpy into the model's tensors, host-to-device copies, one reader."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.reload import MB
from bench.reload.measure import measure


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
