"""The copy engine's cold path (opt-in): chunks the page cache does not hold are read with
O_DIRECT into a reader's staging slot and copied into place (workers/weights/copy.py,
``_DirectReads``).

Where the file system has no O_DIRECT (tmpfs on older kernels) the same loads must come out the
same through the buffered path; the assertions about direct reads are made only where it has.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import workers.weights.copy as copy_engine
from controlplane.wire.errors import WeightsCorrupted
from tests.component.conftest import load
from tests.component.test_loaders import odd_sizes, reader_threads
from workers.demo.checkpoints import write_safetensors
from workers.weights.loaders import open_checkpoint


@pytest.fixture(autouse=True)
def direct_cold_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path is opt-in (``FLEET_WORKER_DIRECT_COLD_READS=1``): on for these tests."""
    monkeypatch.setenv(copy_engine.DIRECT_COLD_READS_ENV, "1")


def test_cold_chunks_are_read_through_the_page_cache_unless_the_worker_opts_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default every chunk is a buffered read, cold or not: workers of one host share what
    one of them read. Opted in, the same cold chunks are read directly."""
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    spy = DirectSpy(monkeypatch, all_cold=True)
    monkeypatch.delenv(copy_engine.DIRECT_COLD_READS_ENV)
    load(path, {k: torch.zeros_like(v) for k, v in src.items()}, read_threads=2)
    assert spy.reads == []
    monkeypatch.setenv(copy_engine.DIRECT_COLD_READS_ENV, "1")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    load(path, dst, read_threads=2)
    if direct_supported(path):
        assert spy.reads
    assert all(torch.equal(dst[k].view(torch.uint8), src[k].view(torch.uint8)) for k in src)


def direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


def evict(path: Path) -> bool:
    """Drop ``path`` from the page cache; whether all of it is out (tmpfs keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        file = copy_engine._DirectFile.open(fd)
        if file is None:
            return False
        try:
            return copy_engine._cached_pages(fd, 0, os.fstat(fd).st_size) == 0
        finally:
            file.close()
    finally:
        os.close(fd)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class DirectSpy:
    """Counts direct reads (and the threads that made them); optionally calls every chunk cold."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, all_cold: bool) -> None:
        self.reads: list[int] = []
        self.lock = threading.Lock()
        read_into = copy_engine._DirectFile.read_into

        def spy(file: Any, slot: Any, buf: memoryview, offset: int) -> int:
            with self.lock:
                self.reads.append(threading.get_ident())
            return read_into(file, slot, buf, offset)

        monkeypatch.setattr(copy_engine._DirectFile, "read_into", spy)
        if all_cold:
            monkeypatch.setattr(copy_engine._DirectFile, "resident", lambda *_: False)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cold_chunks_read_around_the_page_cache_are_bit_identical(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 1000 bytes at unaligned offsets: each direct read spans whole 4 KiB blocks
    around its chunk and only the chunk lands in the tensor, in place."""
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    dst = {k: torch.full_like(v, 7) for k, v in src.items()}
    pointers = {k: v.data_ptr() for k, v in dst.items()}
    spy = DirectSpy(monkeypatch, all_cold=True)
    before = open_fds()
    load(path, dst, read_threads=threads, read_chunk_bytes=1000)
    for name in src:
        assert torch.equal(dst[name].view(torch.uint8), src[name].view(torch.uint8)), name
    assert {k: v.data_ptr() for k, v in dst.items()} == pointers, "copied in place"
    if direct_supported(path):
        assert len(spy.reads) == 1 + 5 + 133 + 2 + 3, "one direct read per 1000 bytes"
        assert len(set(spy.reads)) <= threads
    assert open_fds() == before, "the O_DIRECT descriptors are closed with the reload"
    assert reader_threads() == []


def test_a_dropped_file_is_read_directly_and_a_cached_one_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Residency decides: a reload of a file in the page cache makes no direct read; once the
    file is evicted, a tensor the header's read-ahead did not bring back is read directly.
    (Small tensors next to the header may be back in the cache, and a buffered read's own
    read-ahead may bring back what follows it: those are read from the cache.)"""
    path = tmp_path / "m.safetensors"
    src = {**odd_sizes(), "large": torch.randn(4 * 1024 * 1024 // 4)}  # 4 MiB, last in file
    write_safetensors(path, src)
    spy = DirectSpy(monkeypatch, all_cold=False)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    load(path, dst, read_threads=2, read_chunk_bytes=64 * 1024)  # just written: in the cache
    assert spy.reads == []
    if not (direct_supported(path) and evict(path)):
        pytest.skip("this file system keeps the file cached or has no O_DIRECT")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    load(path, dst, read_threads=1)  # one residency check per tensor: 'large' is cold
    assert len(spy.reads) >= 1
    assert all(torch.equal(dst[k].view(torch.uint8), src[k].view(torch.uint8)) for k in src)


@pytest.mark.parametrize("forced", [True, False])
def test_a_file_truncated_mid_copy_is_weights_corrupted_not_sigbus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forced: bool
) -> None:
    """Cut after the direct descriptor is open: the cut shows as a short direct read (nothing is
    mapped, so nothing can raise SIGBUS), finished by the buffered read that names the byte
    where the file ends."""
    path = tmp_path / "m.safetensors"
    write_safetensors(path, odd_sizes())
    with open_checkpoint(path) as ckpt:
        big = ckpt.entries["big"]
    cut = big.offset + big.nbytes // 2 + 123

    def truncate(done: int, total: int) -> None:
        if done == 2:  # tiny and odd are in (the direct descriptor open); big is next
            os.truncate(path, cut)

    if forced:
        DirectSpy(monkeypatch, all_cold=True)
    else:
        evict(path)  # cold where the file system lets it go, cached elsewhere: both must hold
    dst = {k: torch.zeros_like(v) for k, v in odd_sizes().items()}
    with pytest.raises(WeightsCorrupted) as info:
        load(path, dst, read_threads=1, read_chunk_bytes=1000, progress=truncate)
    assert f"ended inside tensor 'big' ({cut - big.offset} of {big.nbytes} bytes read)" in (
        info.value.message
    )
    got = dst["big"].view(torch.uint8).reshape(-1)[: cut - big.offset]
    assert torch.equal(got, odd_sizes()["big"].view(torch.uint8).reshape(-1)[: cut - big.offset])


def test_a_refused_direct_read_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL (a device or file system that refuses the alignment): buffered reads, once."""
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    monkeypatch.setattr(copy_engine._DirectFile, "resident", lambda *_: False)
    refused: list[int] = []

    def refuse(*_: Any) -> int:
        refused.append(1)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(copy_engine._DirectFile, "read_into", refuse)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    load(path, dst, read_threads=1, read_chunk_bytes=1000)
    assert all(torch.equal(dst[k].view(torch.uint8), src[k].view(torch.uint8)) for k in src)
    assert len(refused) == (1 if direct_supported(path) else 0), "the file is then read buffered"


def test_staging_is_one_slot_per_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No second copy of the model: at most one chunk-sized slot per reader, freed at the end."""
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    monkeypatch.setattr(copy_engine._DirectFile, "resident", lambda *_: False)
    copier = copy_engine.Copier(0, threads=3, read_chunk=1000)
    try:
        with open_checkpoint(path) as ckpt:
            for name, entry in sorted(ckpt.entries.items(), key=lambda kv: kv[1].offset):
                copier.copy(ckpt.fds[entry.file], entry, torch.zeros_like(src[name]))
            copier.finish()
            direct = copier._direct
            assert direct is not None
            slots = list(direct._all_slots)
            assert len(slots) <= 3
            if direct_supported(path):
                assert slots and all(len(s) == 1000 + 2 * copy_engine.DIRECT_ALIGN for s in slots)
    finally:
        copier.close()
    assert all(s.closed for s in slots)
