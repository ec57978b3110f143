"""The loader on its own: chunked parallel reads (bit-identical, overlapping, staged through a
bounded ring, truncated mid-tensor) and containment of every file it opens. Header checks,
matching, checksums and the copy are in test_loaders_checks; the shared tensors in
tests/component/conftest.py.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from controlplane.wire.errors import CommandRejected, WeightsCorrupted, WireCode
from tests.component.conftest import load, source, targets
from workers.demo.checkpoints import sha256_manifest, write_safetensors
from workers.weights.loaders import _Copier, open_checkpoint

# --------------------------------------------------------------------------- chunked parallel reads


def odd_sizes(seed: int = 3) -> dict[str, torch.Tensor]:
    """Tensors that are smaller than, a non-multiple of, and many times the test chunk size."""
    g = torch.Generator().manual_seed(seed)
    return {
        "tiny": torch.randn(3, generator=g),  # 12 bytes: one read
        "odd": torch.randn(1001, generator=g),  # 4004 bytes: 5 chunks of 1000, the last of 4
        "big": torch.randn(257, 129, generator=g),  # 132,612 bytes: 133 chunks
        "half": torch.randn(999, generator=g).to(torch.float16),  # 1998 bytes
        "exact": torch.arange(750, dtype=torch.int32),  # 3000 bytes: exactly 3 chunks
    }


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("reload-pread")]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunked_parallel_reads_are_bit_identical(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    dst = {k: torch.full_like(v, 7) for k, v in src.items()}
    pointers = {k: v.data_ptr() for k, v in dst.items()}
    main = threading.get_ident()
    reads: list[tuple[int, int]] = []  # (bytes asked, thread)
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int) -> int:
        reads.append((sum(len(b) for b in buffers), threading.get_ident()))
        return preadv(fd, buffers, offset)

    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        # A tensor is reported only once every one of its chunks is in.
        seen.append(done)
        with open_checkpoint(path) as ckpt:
            order = sorted(ckpt.entries, key=lambda n: ckpt.entries[n].offset)
        for name in order[:done]:
            assert torch.equal(dst[name], src[name]), f"{name} reported before it was read"

    monkeypatch.setattr(os, "preadv", spy)
    load(path, dst, read_threads=threads, read_chunk_bytes=1000, progress=progress)
    monkeypatch.undo()

    for name in src:
        assert torch.equal(dst[name].view(torch.uint8), src[name].view(torch.uint8)), name
    assert {k: v.data_ptr() for k, v in dst.items()} == pointers, "copied in place"
    assert seen == list(range(len(src) + 1))
    if threads == 1:
        assert len(reads) == len(src), "one read per tensor"
        assert all(t == main for _, t in reads), "one reader: the calling thread"
    else:
        # 1 + 5 + 133 + 2 + 3 reads, every one by the pool: the calling thread only submits
        assert len(reads) == 1 + 5 + 133 + 2 + 3
        assert all(t != main for _, t in reads)
        assert len({t for _, t in reads if t != main}) <= threads
    assert reader_threads() == [], "the pool is shut down with the reload"


def test_chunks_of_the_next_tensor_are_read_while_a_tensor_is_still_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readers never idle at a tensor boundary: tensor i+1's chunks go out before i is in."""
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    with open_checkpoint(path) as ckpt:
        odd, big = ckpt.entries["odd"], ckpt.entries["big"]
    last_of_odd = odd.offset + 4000  # its 5th and last chunk
    next_tensor_read = threading.Event()
    overlapped: list[bool] = []
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int) -> int:
        if offset == last_of_odd:
            # Held until a chunk of the next tensor is read: a loader that waits for every chunk
            # of 'odd' before submitting 'big' never gets there, and this times out.
            overlapped.append(next_tensor_read.wait(timeout=10))
        elif big.offset <= offset < big.offset + big.nbytes:
            next_tensor_read.set()
        return preadv(fd, buffers, offset)

    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    monkeypatch.setattr(os, "preadv", spy)
    load(path, dst, read_threads=2, read_chunk_bytes=1000)
    monkeypatch.undo()
    assert overlapped == [True]
    assert all(torch.equal(dst[k], src[k]) for k in src)


def test_truncated_mid_tensor_during_chunked_reads_is_weights_corrupted(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, odd_sizes())
    with open_checkpoint(path) as ckpt:
        big = ckpt.entries["big"]
    cut = big.offset + big.nbytes // 2 + 123  # inside a chunk, half-way through the tensor

    def truncate(done: int, total: int) -> None:
        if done == 0:  # validated, copying about to begin
            os.truncate(path, cut)

    dst = {k: torch.zeros_like(v) for k, v in odd_sizes().items()}
    with pytest.raises(WeightsCorrupted) as info:
        load(path, dst, read_threads=3, read_chunk_bytes=1000, progress=truncate)
    # The first failing chunk in file order names the byte where the file ends.
    assert f"ended inside tensor 'big' ({cut - big.offset} of {big.nbytes} bytes read)" in (
        info.value.message
    )
    assert all(torch.equal(dst[k], odd_sizes()[k]) for k in ("tiny", "odd"))  # before the cut
    assert reader_threads() == [], "no reader outlives a failed reload"


@pytest.mark.parametrize("threads", [1, 2])
def test_staged_reads_through_a_bounded_ring_of_slots(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path's staging (read into a slot, copy out, reuse the slot), on CPU targets:
    every byte lands, at most ``staging_bytes`` of slots exist, reads are off the calling thread."""
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    dst = {k: torch.full_like(v, 7) for k, v in src.items()}
    copier = _Copier(4000, threads=threads, read_chunk=1000)  # 4 slots of 1000 bytes
    readers: set[int] = set()
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int) -> int:
        readers.add(threading.get_ident())
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    try:
        with open_checkpoint(path) as ckpt:
            for name, entry in sorted(ckpt.entries.items(), key=lambda kv: kv[1].offset):
                copier.copy_staged(ckpt.fds[entry.file], entry, dst[name])
            copier.finish()
    finally:
        copier.close()
    monkeypatch.undo()
    assert copier.done == len(src)
    for name in src:
        assert torch.equal(dst[name].view(torch.uint8), src[name].view(torch.uint8)), name
    assert copier._slots_made == 4, "a ring of staging_bytes / slot size slots, reused"
    assert threading.get_ident() not in readers and len(readers) <= threads


def test_staged_reads_of_a_truncated_file_fail_and_stop_every_reader(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    src = odd_sizes()
    write_safetensors(path, src)
    with open_checkpoint(path) as ckpt:
        big = ckpt.entries["big"]
        os.truncate(path, big.offset + 5500)  # inside big's 6th chunk
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        copier = _Copier(4000, threads=2, read_chunk=1000)
        with pytest.raises(OSError, match=r"ended inside tensor 'big' \(5500 of 132612"):
            try:
                for name, entry in sorted(ckpt.entries.items(), key=lambda kv: kv[1].offset):
                    copier.copy_staged(ckpt.fds[entry.file], entry, dst[name])
                copier.finish()
            except OSError:
                copier.abandon()
                raise
            finally:
                copier.close()
    assert reader_threads() == []
    big_bytes = dst["big"].view(torch.uint8).reshape(-1)
    assert torch.equal(big_bytes[:5000], src["big"].view(torch.uint8).reshape(-1)[:5000])


def test_read_threads_and_chunk_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_safetensors(path, source())
    for kw in ({"read_threads": 0}, {"read_chunk_bytes": 0}):
        dst = targets()
        with pytest.raises(ValueError):
            load(path, dst, **kw)
        assert all(torch.equal(v, targets()[k]) for k, v in dst.items())


# --------------------------------------------------------------------------- containment of every file


def _not_allowed(path: Path, dst: dict[str, torch.Tensor], **kw: Any) -> CommandRejected:
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(CommandRejected) as info:
        load(path, dst, **kw)
    assert info.value.code is WireCode.PATH_NOT_ALLOWED, info.value
    assert all(torch.equal(before[k], dst[k]) for k in dst), "a refused reload touched a tensor"
    return info.value


def _sharded(directory: Path) -> Path:
    """``source()`` in two shards with an index; returns the index."""
    tensors = source()
    parts = {"a.safetensors": ["w", "b"], "b.safetensors": ["steps", "empty"]}
    for name, keys in parts.items():
        write_safetensors(directory / name, {k: tensors[k] for k in keys})
    index = directory / "model.safetensors.index.json"
    weight_map = {k: name for name, keys in parts.items() for k in keys}
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


def test_symlinked_shard_outside_the_root_is_never_read(tmp_path: Path) -> None:
    from workers.weights.paths import resolve_weights_path

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ckpt").mkdir(parents=True)
    outside.mkdir()
    write_safetensors(outside / "model.safetensors", source(2))
    (root / "ckpt" / "model.safetensors").symlink_to(outside / "model.safetensors")
    checked = resolve_weights_path(str(root / "ckpt"), [root])
    _not_allowed(checked, targets())  # found by listing the directory
    # Named by an index: the index is inside, one shard links outside.
    sharded = root / "sharded"
    sharded.mkdir()
    index = _sharded(sharded)
    os.replace(sharded / "b.safetensors", outside / "b.safetensors")
    (sharded / "b.safetensors").symlink_to(outside / "b.safetensors")
    _not_allowed(resolve_weights_path(str(index), [root]), targets())
    _not_allowed(resolve_weights_path(str(sharded), [root]), targets())
    # A sha256 manifest naming another file (a link out of the root) is contained as well.
    (sharded / "b.safetensors").unlink()
    os.replace(outside / "b.safetensors", sharded / "b.safetensors")
    manifest = sha256_manifest(index)
    (sharded / "notes.txt").symlink_to(outside / "model.safetensors")
    manifest["notes.txt"] = "0" * 64
    _not_allowed(resolve_weights_path(str(index), [root]), targets(), sha256=manifest)


@pytest.mark.parametrize("swap", ["replaced", "symlink"])
def test_a_file_swapped_between_check_and_open_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    import workers.weights.loaders as loaders
    from workers.weights.paths import resolve_weights_path

    root = tmp_path / "root"
    root.mkdir()
    index = _sharded(root)
    outside = tmp_path / "outside.safetensors"
    write_safetensors(outside, {k: v for k, v in source(3).items() if k in ("steps", "empty")})
    listed = loaders.checkpoint_files

    def then_swap(path: Path, roots: Any = None) -> Any:
        files = listed(path, *([] if roots is None else [roots]))
        # Every file was checked: now swap one before it is opened.
        victim = root / "b.safetensors"
        if swap == "replaced":  # another inode at the same (contained) name
            write_safetensors(
                tmp_path / "new.safetensors",
                {k: v for k, v in source(4).items() if k in ("steps", "empty")},
            )
            os.replace(tmp_path / "new.safetensors", victim)
        else:  # the name now links out of the root
            victim.unlink()
            victim.symlink_to(outside)
        return files

    monkeypatch.setattr(loaders, "checkpoint_files", then_swap)
    message = _not_allowed(resolve_weights_path(str(index), [root]), targets()).message
    assert "changed between check and open" in message
