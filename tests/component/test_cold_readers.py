"""A reload of a checkpoint that is mostly not in the page cache gets more readers than cores
(``COLD_READ_THREADS``: a disk wants several reads in flight); a cached one keeps one reader per
core; a caller's own ``read_threads`` always wins (workers/weights/copy.py, ``readers_for``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import workers.weights.copy as copy_engine
import workers.weights.loaders as loaders
from tests.component.conftest import load
from tests.component.test_loaders import odd_sizes
from workers.demo.checkpoints import write_safetensors


def _file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    return path, src


def _residency(monkeypatch: pytest.MonkeyPatch, fraction: float | None) -> None:
    """cachestat(2) says this fraction of every file's pages is cached (None: it cannot say)."""

    def cached(fd: int, offset: int, nbytes: int) -> int | None:
        if fraction is None:
            return None
        return int(fraction * -(-nbytes // os.sysconf("SC_PAGE_SIZE")))

    monkeypatch.setattr(copy_engine, "_cached_pages", cached)


@pytest.mark.parametrize(
    ("fraction", "readers", "expected"),
    [
        (0.0, 2, copy_engine.COLD_READ_THREADS),
        (0.4, 1, copy_engine.COLD_READ_THREADS),
        (0.6, 2, 2),  # mostly cached: one reader per core
        (1.0, 2, 2),
        (0.0, 8, 8),  # never fewer than asked
        (None, 2, 2),  # the kernel cannot say: as before
    ],
)
def test_readers_for_gives_cold_checkpoints_more_readers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fraction: float | None,
    readers: int,
    expected: int,
) -> None:
    path, _ = _file(tmp_path)
    _residency(monkeypatch, fraction)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert copy_engine.readers_for([fd], readers) == expected
    finally:
        os.close(fd)


def test_a_file_just_read_counts_as_cached(tmp_path: Path) -> None:
    """The real cachestat(2) (where the kernel has it): a file read whole is cached."""
    path, _ = _file(tmp_path)
    path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert copy_engine.readers_for([fd], 2) == 2
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("fraction", "read_threads", "copiers"),
    [
        (0.0, None, copy_engine.COLD_READ_THREADS),
        (1.0, None, None),  # default_read_threads()
        (0.0, 1, 1),  # the caller's choice
    ],
)
def test_a_cold_reload_copies_with_the_cold_readers_and_loads_the_same_bytes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fraction: float,
    read_threads: int | None,
    copiers: int | None,
) -> None:
    path, src = _file(tmp_path)
    _residency(monkeypatch, fraction)
    made: list[int] = []
    real = copy_engine.Copier

    def spy(*args: Any, **kw: Any) -> Any:
        made.append(kw["threads"])
        return real(*args, **kw)

    monkeypatch.setattr(loaders, "Copier", spy)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    load(path, dst, read_threads=read_threads, read_chunk_bytes=1000)
    assert all(torch.equal(dst[k].view(torch.uint8), src[k].view(torch.uint8)) for k in src)
    assert made == [copy_engine.default_read_threads() if copiers is None else copiers]
