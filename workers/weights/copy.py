"""The copy engine: a checked plan of tensors, read from open files into their destinations.

No second copy of the model is ever held: host-memory destinations are read straight into
(where the worker opts in, chunks the page cache does not hold through one small staging slot
per reader, see ``_DirectReads``), device ones through a bounded ring of staging slots or one
host tensor at a time.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import mmap
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Final, cast

import torch

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from workers.weights.checks import OpenCheckpoint, TensorEntry, failure_reason

#: Host-memory destinations are read in chunks of this size, from ``read_threads`` threads.
DEFAULT_READ_CHUNK_BYTES = 8 * 1024 * 1024
MAX_READ_THREADS = 4
#: Chunks each reader may have queued ahead: enough that none idles between tensors.
READ_WINDOW_CHUNKS_PER_THREAD = 4

#: Called with (tensors copied, tensors to copy): once when copying begins, then after each tensor.
Progress = Callable[[int, int], None]


#: Readers of a reload whose checkpoint is mostly not in the page cache, when the caller did not
#: choose: a disk wants several reads in flight (kernel readahead gives each reader a few).
#: Measured on the 2-core VM, 1 GB cold, medians of 3: 1.31 GB/s with 2 readers, 1.88 with 4,
#: 1.71 with 8; from the page cache 4 readers cost ~6% against 2, so cached reloads keep
#: :func:`default_read_threads` (docs/benchmarks.md, section 3c).
COLD_READ_THREADS = 4


def readers_for(fds: Iterable[int], readers: int) -> int:
    """``readers``, or at least :data:`COLD_READ_THREADS` when less than half of the files'
    pages are in the page cache (cachestat(2), one call per file; where the kernel does not say,
    ``readers``)."""
    pages = cached = 0
    for fd in fds:
        size = os.fstat(fd).st_size
        resident = _cached_pages(fd, 0, size)
        if resident is None:
            return readers
        pages += -(-size // mmap.PAGESIZE)
        cached += resident
    return max(readers, COLD_READ_THREADS) if 2 * cached < pages else readers


def default_read_threads() -> int:
    """Readers per reload: torch's intra-op threads, at most ``MAX_READ_THREADS``.

    From the page cache, one ``preadv`` copies on one core; chunks read from several threads
    (``preadv`` releases the GIL) use every core, as torch's own ``copy_`` does. From a disk that
    must seek, concurrent readers can cost throughput (docs/benchmarks.md, section 3, "CPU
    cold"): pass ``read_threads=1`` where checkpoints are usually read cold.
    """
    return max(1, min(torch.get_num_threads(), MAX_READ_THREADS))


class _ShortRead(OSError):
    pass


def _completed() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


#: Stands in the window for a tensor copied synchronously behind chunks still in flight.
_DONE: Final = _completed()
#: A read in the copier's window: the read, tensors it completes, what to do once it is in.
_Read = tuple[Future[None], int, Callable[[], None] | None]
#: The smallest staging slot (a smaller ``staging_bytes`` still gets two slots of this size).
_MIN_SLOT_BYTES: Final = 512 * 1024


def copy_plan(
    ckpt: OpenCheckpoint,
    plan: list[tuple[TensorEntry, torch.Tensor]],
    copier: Copier,
    version: str,
    from_version: str | None,
    cancel: threading.Event | None,
    progress: Progress | None,
    sync: Callable[[], None] | None,
    copied: Callable[[int], None] | None = None,
) -> None:
    """Copy ``plan``; ``copied(n)`` is told each time more of its first ``n`` tensors are in
    (the hashing of a signed checkpoint follows it), ``progress`` once per tensor."""
    reported = 0

    def report() -> None:
        # One call per tensor, in plan order, once every byte of it is in.
        nonlocal reported
        if copied is not None and reported < copier.done:
            copied(copier.done)
        if progress is None:
            reported = copier.done
            return
        while reported < copier.done:
            reported += 1
            progress(reported, len(plan))

    try:
        if progress is not None:
            progress(0, len(plan))
        with torch.no_grad():
            for entry, dst in plan:
                if cancel is not None and cancel.is_set():
                    raise RunnerError("cancelled", code=WireCode.COMMAND_TIMEOUT)
                copier.copy(ckpt.fds[entry.file], entry, dst)
                report()
            copier.finish()
            report()
            if sync is not None:
                sync()
    except Exception as exc:
        copier.abandon()  # every reader has stopped before the failure is reported
        reason = failure_reason(exc)
        raise WeightsCorrupted(
            f"reload to {version!r} failed after {copier.done} of {len(plan)} tensors were "
            f"written ({reason}); the model mixes {from_version!r} and {version!r}",
            from_version=from_version,
            to_version=version,
        ) from exc
    finally:
        copier.close()  # no reader thread outlives the reload, nor writes after it returns


class Copier:
    """Moves tensors' bytes from a file into their destinations without a second model copy.

    Reads go to a pool of readers, chunk by chunk, with a window of chunks in flight across
    tensor boundaries, so that no reader idles at the end of a tensor waiting for the next one:

    * host-memory destinations (CPU tensors, host aliases of device buffers) are read straight
      into, in ``read_chunk`` chunks; opted in, a chunk the page cache does not hold is read
      around it (``direct_cold_reads``, see ``_DirectReads``);
    * CUDA destinations are read into a ring of pinned staging slots (``staging_bytes`` in all),
      and each slot is copied to the device asynchronously as soon as its read is in, then reused
      once that copy has finished: reads overlap each other and the host-to-device copies;
    * anything else (XLA's own path, strided tensors) goes through one host tensor at a time.

    ``done`` counts the tensors, in plan order, whose every byte has been read (and, for CUDA,
    whose copies have been issued; :meth:`finish` waits for those).
    """

    def __init__(
        self,
        staging_bytes: int,
        flush: Callable[[], None] | None = None,
        *,
        threads: int = 1,
        read_chunk: int = DEFAULT_READ_CHUNK_BYTES,
        direct_cold_reads: bool | None = None,
    ) -> None:
        self._threads = threads
        if direct_cold_reads is None:
            direct_cold_reads = direct_cold_reads_enabled()
        self._direct = _DirectReads(read_chunk) if direct_cold_reads else None
        self._read_chunk = read_chunk
        self._pool: ThreadPoolExecutor | None = None  # started by the first pooled read
        #: Reads submitted and not yet collected, in submission order: the read, the number of
        #: tensors complete once it is in (1 for a tensor's last chunk, else 0), and what the
        #: calling thread does with it then (issue a staged chunk's device copy), if anything.
        self._in_flight: collections.deque[_Read] = collections.deque()
        self._window = READ_WINDOW_CHUNKS_PER_THREAD * threads
        self.done = 0
        self._budget = staging_bytes
        self._flush = flush
        self._pending = 0
        self._slot_bytes = min(read_chunk, max(_MIN_SLOT_BYTES, staging_bytes // 2))
        self._slot_count = max(2, staging_bytes // self._slot_bytes)
        self._slots: list[torch.Tensor] = []  # free staging slots
        self._slots_made = 0
        #: Slots whose device copy was issued, oldest first, with the event that marks its end.
        self._copying: collections.deque[tuple[torch.Tensor, torch.cuda.Event | None]] = (
            collections.deque()
        )

    def copy(self, fd: int, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Copy one tensor, or submit its chunks to the readers and return."""
        if entry.nbytes == 0:
            pass
        elif dst.device.type == "cpu" and dst.is_contiguous():
            # Page cache -> parameter memory: no mmap, no temporary; chunks from several threads.
            if self._threads > 1:
                self._submit_direct(fd, byte_view(dst.detach()), entry)
                return
            self._read_host(fd, byte_view(dst.detach()), entry)
        elif dst.device.type == "cuda" and dst.is_contiguous():
            self.copy_staged(fd, entry, dst)
            return
        else:
            # XLA and other devices (or strided tensors): one host tensor at a time.
            host = torch.empty(entry.shape, dtype=dst.dtype)
            read_exact(fd, byte_view(host), entry)
            dst.copy_(host)
            # A lazy device (XLA) may hold each host tensor until it syncs: flush every
            # staging budget so host memory stays bounded, not a second copy of the model.
            self._pending += entry.nbytes
            if self._flush is not None and self._pending >= self._budget:
                self._flush()
                self._pending = 0
        self._count_done()

    def copy_staged(self, fd: int, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Read ``entry`` through the staging slots into ``dst`` (CUDA; any contiguous tensor)."""
        if entry.nbytes == 0:
            self._count_done()
            return
        pool = self._readers()
        dst_bytes = dst.detach().reshape(-1).view(torch.uint8)
        size = self._slot_bytes
        for start in range(0, entry.nbytes, size):
            n = min(size, entry.nbytes - start)
            slot = self._free_slot(pinned=dst.device.type == "cuda")
            read = pool.submit(read_exact, fd, slot.numpy().data[:n], entry, start)
            target = dst_bytes[start : start + n]
            self._in_flight.append(
                (read, 1 if start + n >= entry.nbytes else 0, self._device_copy(slot, target))
            )

    def _count_done(self) -> None:
        """A tensor copied synchronously: counted after those still in flight, in plan order."""
        if not self._in_flight:
            self.done += 1
        else:
            self._in_flight.append((_DONE, 1, None))

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="reload-pread")
        return self._pool

    def _submit_direct(self, fd: int, buf: memoryview, entry: TensorEntry) -> None:
        pool = self._readers()
        chunk = self._read_chunk
        for start in range(0, entry.nbytes, chunk):
            while len(self._in_flight) >= self._window:
                self._collect_oldest()
            read = pool.submit(self._read_host, fd, buf[start : start + chunk], entry, start)
            self._in_flight.append((read, 1 if start + chunk >= entry.nbytes else 0, None))
        while self._in_flight and self._in_flight[0][0].done():
            self._collect_oldest()

    def _read_host(self, fd: int, buf: memoryview, entry: TensorEntry, start: int = 0) -> None:
        """One chunk into host memory: from the page cache, or around it when it is not there."""
        if self._direct is None or not self._direct.read(fd, buf, entry, start):
            read_exact(fd, buf, entry, start)

    def _collect_oldest(self) -> None:
        read, completes, then = self._in_flight.popleft()
        read.result()  # the first error in plan (= file) order; the caller abandons the rest
        if then is not None:
            then()
        self.done += completes

    def _free_slot(self, *, pinned: bool) -> torch.Tensor:
        """A staging slot nobody reads into or copies from, waiting for one if need be."""
        while not self._slots:
            if self._slots_made < self._slot_count:
                self._slots_made += 1
                return torch.empty(self._slot_bytes, dtype=torch.uint8, pin_memory=pinned)
            if self._copying:
                slot, event = self._copying.popleft()
                if event is not None:
                    event.synchronize()  # its device copy has finished: the slot is free
                self._slots.append(slot)
            else:
                self._collect_oldest()  # a read into a slot is in: its copy is issued
        return self._slots.pop()

    def _device_copy(self, slot: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
        def issue() -> None:
            n = target.numel()
            if target.device.type != "cuda":  # a synchronous copy: the slot is free again
                target.copy_(slot[:n])
                self._slots.append(slot)
                return
            target.copy_(slot[:n], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(target.device))  # type: ignore[no-untyped-call]
            self._copying.append((slot, event))

        return issue

    def finish(self) -> None:
        """Wait until every byte is in place (raising the first read error)."""
        while self._in_flight:
            self._collect_oldest()
        self._wait_for_copies()

    def abandon(self) -> None:
        """After a failure: wait for every read and device copy still in flight, so that none
        writes after the failure is reported."""
        wait_futures([read for read, _, _ in self._in_flight])
        self._in_flight.clear()
        self._wait_for_copies()

    def _wait_for_copies(self) -> None:
        while self._copying:
            slot, event = self._copying.popleft()
            if event is not None:
                event.synchronize()
            self._slots.append(slot)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._wait_for_copies()  # no device copy may still read a slot that is freed
        self._slots.clear()
        if self._direct is not None:
            self._direct.close()  # after the readers: none is still using a slot or descriptor


def byte_view(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def read_exact(fd: int, buf: memoryview, entry: TensorEntry, start: int = 0) -> None:
    done = 0
    size = len(buf)
    while done < size:
        n = os.preadv(fd, [buf[done:]], entry.offset + start + done)
        if n == 0:
            raise _ShortRead(
                f"{entry.file.name!r} ended inside tensor {entry.name!r} "
                f"({start + done} of {entry.nbytes} bytes read)"
            )
        done += n


#: Set to "1" to read chunks the page cache does not hold with O_DIRECT (``_DirectReads``).
DIRECT_COLD_READS_ENV: Final = "FLEET_WORKER_DIRECT_COLD_READS"


def direct_cold_reads_enabled() -> bool:
    """Whether cold chunks are read around the page cache: off unless the worker's environment
    says ``FLEET_WORKER_DIRECT_COLD_READS=1``. Off by default because a chunk read directly
    never enters the page cache: several workers of one host (one per GPU) reloading the same
    checkpoint would each read it from the disk, where buffered reads fetch it once and share
    it; so would a worker rolled back to a checkpoint it read before. On a host with one
    worker, and checkpoints read once, it saves 2-4x the CPU of a cold reload
    (docs/benchmarks.md, section 3c)."""
    return os.environ.get(DIRECT_COLD_READS_ENV, "") == "1"


#: O_DIRECT reads start, end and land at multiples of this (the page size: a superset of the
#: logical block sizes and DMA alignments of the disks a worker reads, 512 or 4096).
DIRECT_ALIGN: Final = 4096


class _DirectReads:
    """Chunks that are not in the page cache, read from the disk around it (O_DIRECT).

    Why: a buffered read of a cold chunk fills fresh page-cache pages and copies out of them,
    and on the VM measured that cost 3-17x the CPU of the same copy from cached pages (0.5-3.4
    against 0.19 core-s per GiB: fresh pages, which a ballooned guest's host faults in on
    first touch; docs/benchmarks.md, section 3, "Where the loader's time goes"). An O_DIRECT read lands the chunk in the reader's own staging
    slot (at most one per reader, ``read_chunk`` + 8 KiB, reused), which is then copied into
    place: the same one copy, minus the page cache. Chunks the page cache holds are read from
    it as before: a re-read checkpoint stays a memcpy.

    Whether a chunk is resident: cachestat(2) on the descriptor (no mapping: nothing that a
    truncated file could turn into a SIGBUS; a truncation shows as a short read, as before).
    Where the kernel does not say (before Linux 6.5, or a file the worker neither owns nor may
    write: EPERM), every read stays buffered, as before; so does a file system without
    O_DIRECT, and any file whose direct read the kernel refuses (EINVAL).
    O_DIRECT reads are coherent with the page cache (dirty pages are written back first), and
    the descriptor is the checked file's own, reopened through /proc (same device and inode).
    """

    def __init__(self, piece: int) -> None:
        self._piece = piece  # the most one direct read copies (a reader's whole tensor, in pieces)
        self._files: dict[int, _DirectFile | None] = {}
        self._slots = threading.local()
        self._lock = threading.Lock()
        self._all_slots: list[mmap.mmap] = []

    def read(self, fd: int, buf: memoryview, entry: TensorEntry, start: int) -> bool:
        """Read ``buf`` from ``fd`` at the entry's ``start`` if its pages are not resident; False
        (nothing read) where the page cache holds them, or direct reads are not possible."""
        with self._lock:
            if fd not in self._files:
                self._files[fd] = _DirectFile.open(fd)
            file = self._files[fd]
        if file is None or file.refused or file.resident(entry.offset + start, len(buf)):
            return False
        slot = self._slot()
        done = 0
        while done < len(buf):
            piece = buf[done : done + self._piece]
            try:
                got = file.read_into(slot, piece, entry.offset + start + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                file.refused = True  # the kernel refuses this file's direct reads: buffered ones
                got = 0
            done += got
            if got < len(piece):  # refused, or the file ends inside: the buffered read names it
                read_exact(fd, buf[done:], entry, start + done)
                break
        return True

    def _slot(self) -> _Slot:
        """This reader's staging slot: one piece and its alignment, made at its first use."""
        slot: _Slot | None = getattr(self._slots, "slot", None)
        if slot is None:
            memory = mmap.mmap(-1, self._piece + 2 * DIRECT_ALIGN)  # page-aligned, as O_DIRECT
            with self._lock:
                self._all_slots.append(memory)
            slot = self._slots.slot = _Slot(memory)
        return slot

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                if file is not None:
                    file.close()
            self._files.clear()
            for memory in self._all_slots:
                memory.close()
            self._all_slots.clear()
        self._slots = threading.local()


class _Slot:
    def __init__(self, memory: mmap.mmap) -> None:
        self.memory = memory
        anchor = ctypes.c_char.from_buffer(memory)
        self.address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while ``memory`` is open; the export does not


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    )


#: cachestat(2), Linux 6.5: the same number on every architecture (the generic syscall table).
_SYS_CACHESTAT: Final = 451


class _DirectFile:
    """An O_DIRECT descriptor of a checked file, and the page cache's residency of its ranges."""

    def __init__(self, fd: int, direct_fd: int) -> None:
        self.fd = fd
        self.direct_fd = direct_fd
        self.refused = False

    @staticmethod
    def open(fd: int) -> _DirectFile | None:
        """None where the platform, the kernel, the file system or the file does not allow it
        (cachestat(2) missing or refused, no O_DIRECT)."""
        flag = getattr(os, "O_DIRECT", None)
        was = os.fstat(fd)
        if flag is None or not stat.S_ISREG(was.st_mode) or _cached_pages(fd, 0, 1) is None:
            return None
        try:
            direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | os.O_CLOEXEC)
        except OSError:
            return None  # no /proc, or no O_DIRECT on this file system
        now = os.fstat(direct_fd)
        if (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino):
            os.close(direct_fd)
            return None
        return _DirectFile(fd, direct_fd)

    def resident(self, offset: int, nbytes: int) -> bool:
        """Whether every page of the range is in the page cache (True where it cannot tell)."""
        cached = _cached_pages(self.fd, offset, nbytes)
        pages = (offset + nbytes - 1) // mmap.PAGESIZE - offset // mmap.PAGESIZE + 1
        return cached is None or cached >= pages

    def read_into(self, slot: _Slot, buf: memoryview, offset: int) -> int:
        """Read the aligned span around ``offset`` into ``slot``, copy ``buf``'s part of it into
        ``buf``; the bytes of ``buf`` filled (fewer where the file ends first)."""
        first = offset - offset % DIRECT_ALIGN
        end = -(-(offset + len(buf)) // DIRECT_ALIGN) * DIRECT_ALIGN
        with memoryview(slot.memory) as view:
            got = os.preadv(self.direct_fd, [view[: end - first]], first)
        filled = max(0, min(got - (offset - first), len(buf)))
        if filled:
            anchor = ctypes.c_char.from_buffer(buf)
            ctypes.memmove(ctypes.addressof(anchor), slot.address + offset - first, filled)
            del anchor
        return filled

    def close(self) -> None:
        os.close(self.direct_fd)


def _cached_pages(fd: int, offset: int, nbytes: int) -> int | None:
    """How many pages of the range the page cache holds (cachestat(2): one step per folio, a
    sixth of mincore's cost per GiB here); None where the kernel does not say (before 6.5,
    or a file the caller neither owns nor may write: EPERM)."""
    syscall = _syscall()
    if syscall is None:
        return None
    span, out = _CachestatRange(offset, nbytes), _Cachestat()
    if syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(out), 0) != 0:
        return None
    return int(out.nr_cache)


@functools.cache
def _syscall() -> Callable[..., int] | None:
    """libc's syscall(2), on Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    call = libc.syscall
    call.restype = ctypes.c_long
    call.argtypes = [
        ctypes.c_long,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint,
    ]
    return cast(Callable[..., int], call)
