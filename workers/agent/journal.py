"""The worker's durable local state: terminal acks by command id, its position, what is applied.

Kafka's committed offsets can expire on a quiet topic; this journal makes application
idempotent by command id across restarts regardless. Append-only JSON lines, a torn last line is
ignored, and the file is compacted when it grows. No Kafka, no asyncio.

Mutations change the state in memory at once and are *staged*; :meth:`WorkerState.sync` makes
everything staged durable with one write and one ``fsync``. The agent groups a phase's mutations
(what a command applied and its outcome; then "published" and the next offset) into one sync and
runs it off its event loop. The memory may be ahead of the disk until then, never behind.

One agent at a time: :meth:`WorkerState.open` takes an exclusive ``flock`` on ``lock`` in the
directory (held until :meth:`WorkerState.close`), so a second agent with the same id and state
directory stops with STATE_DIR_LOCKED instead of applying commands twice. A write or ``fsync``
that fails is JOURNAL_WRITE_FAILED (the lines stay staged for a retry); the directory is
fsynced whenever a journal file is created or renamed into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.wire.errors import ControlPlaneError, LocalCode, ProtocolError, WireCode
from controlplane.wire.protocol import Ack, ReloadWeightsSpec, decode_ack, encode

log = logging.getLogger(__name__)

#: Terminal outcomes remembered per worker (oldest forgotten first).
MAX_REMEMBERED = 10_000

JOURNAL_NAME = "state.jsonl"
#: Locked (``flock``) by the agent that has the directory open; holds its pid, for the error.
LOCK_NAME = "lock"


@dataclass
class Outcome:
    """The terminal ack a command ended with, and whether it is known to have reached Kafka."""

    ack: Ack
    published: bool


class WorkerState:
    """Open with :meth:`open`; a mutation is durable once a later :meth:`sync` has returned.

    Mutations come from one thread (the agent's event loop); :meth:`sync` may run in another
    (``asyncio.to_thread``), and concurrent syncs write in the order the lines were staged.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outcomes: OrderedDict[str, Outcome] = OrderedDict()
        #: Offset of the next command to read, as last committed by this worker.
        self.next_offset: int | None = None
        #: The last successfully applied reload, re-applied after a restart.
        self.weights: ReloadWeightsSpec | None = None
        #: The trust store key that admitted :attr:`weights` (None: admitted without a store).
        self.weights_key: str | None = None
        #: All config overrides applied so far, re-applied after a restart.
        self.config_overrides: dict[str, Any] = {}
        #: For each override, the trust store key that admitted the command that last set it.
        self.config_keys: dict[str, str | None] = {}
        #: How many times this state has been opened, this time included (durable before
        #: :meth:`open` returns): orders a worker's incarnations whatever its clock says.
        self.incarnation = 0
        self._lines = 0
        #: The journal, opened O_APPEND; None when closed (guarded by _io_lock).
        self._fd: int | None = None
        #: The locked lock file, held from open() to close().
        self._lock_fd: int | None = None
        #: Journal lines staged by mutations, not yet written (guarded by ``_lock``).
        self._pending: list[str] = []
        #: Guards the in-memory state and ``_pending`` (a sync may snapshot them from a thread).
        self._lock = threading.Lock()
        #: Held while writing: syncs and compaction reach the file one at a time, in order.
        self._io_lock = threading.Lock()
        #: A write failed part-way: the next one starts on a fresh line (guarded by _io_lock).
        self._torn = False

    @classmethod
    def open(cls, directory: Path) -> WorkerState:
        """Lock ``directory``, replay its journal and count this incarnation (durably).

        Raises :class:`ControlPlaneError` with STATE_DIR_LOCKED when another process (or another
        open state) holds the directory, JOURNAL_WRITE_FAILED when it cannot be created, read or
        written.
        """
        state = cls(directory / JOURNAL_NAME)
        try:
            _make_dir(directory)
            state._lock_fd = _lock(directory)
            _LOCKED.add(state)
            state._replay()
            with state._io_lock:
                if state._lines > 2 * MAX_REMEMBERED + 100:
                    state._compact()  # leaves the new journal open
                if state._fd is None:
                    created = not state.path.exists()
                    state._fd = os.open(state.path, _APPEND_FLAGS, 0o644)
                    if created:
                        _fsync_dir(directory)
                with state._lock:
                    state.incarnation += 1
                    state._stage({"t": "incarnation", "n": state.incarnation})
                state._write_pending()
        except BaseException as exc:
            state._release()
            if isinstance(exc, OSError):
                raise _write_failed(f"cannot open the worker journal in {directory}", exc) from exc
            raise
        return state

    def close(self) -> ControlPlaneError | None:
        """Sync what is staged (it happened: the memory says so), close the journal, unlock.

        Never raises, so it cannot hide the error that made its caller close: what could not
        be written is logged and returned (JOURNAL_WRITE_FAILED), and the directory is
        unlocked whatever happened. Closing a closed state does nothing.
        """
        with self._io_lock:
            error: ControlPlaneError | None = None
            try:
                if self._fd is not None:
                    self._write_pending()
            except Exception as exc:
                error = (
                    exc
                    if isinstance(exc, ControlPlaneError)
                    else _write_failed(f"cannot write the worker journal {self.path}", exc)
                )
                with self._lock:
                    lost = list(self._pending)
                log.error(
                    "worker state %s closed with %d journal line(s) not written (%s): %s",
                    self.path,
                    len(lost),
                    error,
                    _preview(lost),
                )
            finally:
                self._release()
            return error

    @property
    def dirty(self) -> bool:
        """Whether mutations are staged that a :meth:`sync` would make durable."""
        return bool(self._pending)

    def sync(self) -> None:
        """Make every staged mutation durable: one write, one ``fsync`` (none if nothing staged).

        Blocking; safe to call from a worker thread while the owner thread stages more.
        """
        with self._io_lock:
            if self._fd is None:
                raise RuntimeError("worker state is closed")
            self._write_pending()

    # ------------------------------------------------------------------ queries

    def outcome(self, command_id: str) -> Outcome | None:
        return self.outcomes.get(command_id)

    # ------------------------------------------------------------------ mutations

    # All staged: durable at the next sync().

    def record(self, ack: Ack, *, published: bool) -> None:
        # The ack's own wire JSON is spliced in: no parse and re-dump of what encode() wrote.
        line = (
            '{"t":"outcome","ack":'
            + encode(ack).decode("utf-8")
            + (',"published":true}' if published else ',"published":false}')
        )
        with self._lock:
            self._apply_outcome(ack, published)
            self._pending.append(line)

    def mark_published(self, command_id: str) -> None:
        with self._lock:
            item = self.outcomes.get(command_id)
            if item is not None and not item.published:
                item.published = True
                self._stage({"t": "published", "id": command_id})

    def set_offset(self, next_offset: int) -> None:
        with self._lock:
            if next_offset != self.next_offset:
                self.next_offset = next_offset
                self._stage({"t": "offset", "next": next_offset})

    def set_weights(self, spec: ReloadWeightsSpec, key_id: str | None = None) -> None:
        """The weights applied, and the trust store key that admitted their command."""
        with self._lock:
            self.weights, self.weights_key = spec, key_id
            self._stage(_keyed({"t": "weights", "spec": spec.model_dump(mode="json")}, key_id))

    def add_config(self, overrides: dict[str, Any], key_id: str | None = None) -> None:
        """Config overrides applied, and the trust store key that admitted their command."""
        with self._lock:
            self._set_config(overrides, key_id)
            self._stage(_keyed({"t": "config", "overrides": overrides}, key_id))

    def compact(self) -> None:
        """Rewrite the journal as the current state (atomically: temp file, fsync, rename,
        fsync of the directory).

        What is staged is part of the current state, so it is durable afterwards too.
        """
        with self._io_lock:
            if self._fd is None:
                raise RuntimeError("worker state is closed")
            self._compact()

    # ------------------------------------------------------------------ internals

    def _stage(self, entry: dict[str, Any]) -> None:  # under _lock
        self._pending.append(json.dumps(entry, separators=(",", ":")))

    def _write_pending(self) -> None:  # under _io_lock
        fd = self._fd
        if fd is None:
            raise RuntimeError("worker state is closed")
        with self._lock:
            lines, self._pending = self._pending, []
        if not lines:
            return
        try:
            data = ("\n" if self._torn else "") + "\n".join(lines) + "\n"
            _write_all(fd, data.encode("utf-8"))
            os.fsync(fd)
        except BaseException as exc:
            # Not durable: staged again, ahead of anything staged since (a line written twice
            # replays to the same state; a torn one is skipped).
            self._torn = True
            with self._lock:
                self._pending[:0] = lines
            if isinstance(exc, OSError):
                raise _write_failed(f"cannot write the worker journal {self.path}", exc) from exc
            raise
        self._torn = False
        self._lines += len(lines)
        if self._lines > 2 * MAX_REMEMBERED + 100:
            self._compact()

    def _compact(self) -> None:  # under _io_lock
        """Write the snapshot to a temp file and rename it over the journal; the temp file's
        descriptor (O_APPEND) becomes the journal's, so nothing is reopened by name."""
        with self._lock:  # the snapshot includes everything staged so far, so drop that
            entries = self._snapshot()
            taken, self._pending = self._pending, []
        tmp = self.path.with_suffix(".tmp")
        fd: int | None = None
        renamed = False
        try:
            data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries)
            fd = os.open(tmp, _APPEND_FLAGS | os.O_TRUNC, 0o644)
            _write_all(fd, data.encode("utf-8"))
            os.fsync(fd)
            os.replace(tmp, self.path)
            renamed = True
            old, self._fd, fd = self._fd, fd, None
            if old is not None:
                os.close(old)
            self._torn = False
            self._lines = len(entries)
            _fsync_dir(self.path.parent)
        except BaseException as exc:
            # Staged again: written to whichever journal is current at the next sync (a line
            # that is also in the snapshot replays to the same state).
            with self._lock:
                self._pending[:0] = taken
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if not renamed:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            if isinstance(exc, OSError):
                raise _write_failed(f"cannot compact the worker journal {self.path}", exc) from exc
            raise

    def _release(self) -> None:  # under _io_lock, or before the state is shared
        """Close the journal and unlock the directory, whatever fails."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                log.error("worker state %s: closing the journal failed: %s", self.path, exc)
        lock_fd, self._lock_fd = self._lock_fd, None
        _LOCKED.discard(self)
        if lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock_fd)  # releases the flock

    def _snapshot(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"t": "outcome", "ack": json.loads(encode(o.ack)), "published": o.published}
            for o in self.outcomes.values()
        ]
        if self.next_offset is not None:
            out.append({"t": "offset", "next": self.next_offset})
        if self.weights is not None:
            spec = self.weights.model_dump(mode="json")
            out.append(_keyed({"t": "weights", "spec": spec}, self.weights_key))
        by_key: dict[str | None, dict[str, Any]] = {}
        for name, value in self.config_overrides.items():
            by_key.setdefault(self.config_keys.get(name), {})[name] = value
        out.extend(_keyed({"t": "config", "overrides": o}, k) for k, o in by_key.items())
        if self.incarnation:
            out.append({"t": "incarnation", "n": self.incarnation})
        return out

    def _set_config(self, overrides: dict[str, Any], key_id: str | None) -> None:
        self.config_overrides.update(overrides)
        self.config_keys.update(dict.fromkeys(overrides, key_id))

    def _apply_outcome(self, ack: Ack, published: bool) -> None:
        self.outcomes[ack.command_id] = Outcome(ack=ack, published=published)
        self.outcomes.move_to_end(ack.command_id)
        while len(self.outcomes) > MAX_REMEMBERED:
            self.outcomes.popitem(last=False)

    def _replay(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        text = raw.decode("utf-8", errors="replace")  # a line with bad bytes fails to parse
        # A torn last line (a crash mid-write): the next write must not extend it.
        self._torn = bool(text) and not text.endswith("\n")
        for number, line in enumerate(text.splitlines(), 1):
            self._lines += 1
            if not line:
                continue  # after a failed write (see _write_pending)
            try:
                entry = json.loads(line)
                self._replay_entry(entry)
            except (ValueError, KeyError, TypeError, ProtocolError) as exc:
                # A torn last line after a crash is expected; anything else is worth a warning.
                log.warning("worker state %s line %d ignored: %s", self.path, number, exc)

    def _replay_entry(self, entry: dict[str, Any]) -> None:
        kind = entry["t"]
        if kind == "outcome":
            ack = decode_ack(json.dumps(entry["ack"]).encode())
            self._apply_outcome(ack, bool(entry["published"]))
        elif kind == "published":
            item = self.outcomes.get(entry["id"])
            if item is not None:
                item.published = True
        elif kind == "offset":
            self.next_offset = int(entry["next"])
        elif kind == "weights":
            self.weights = ReloadWeightsSpec.model_validate(entry["spec"])
            self.weights_key = _key_of(entry)
        elif kind == "config":
            self._set_config(dict(entry["overrides"]), _key_of(entry))
        elif kind == "incarnation":
            self.incarnation = max(self.incarnation, int(entry["n"]))


def _keyed(entry: dict[str, Any], key_id: str | None) -> dict[str, Any]:
    """``entry`` with the key that admitted its command (none written when there was none:
    lines of a worker without a trust store are as before)."""
    return entry if key_id is None else {**entry, "key": key_id}


def _key_of(entry: dict[str, Any]) -> str | None:
    key = entry.get("key")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key {key!r} is not a string")
    return key


# ---------------------------------------------------------------------- files

#: States holding their directory's lock in this process.
_LOCKED: weakref.WeakSet[WorkerState] = weakref.WeakSet()


def _drop_locks_in_child() -> None:
    """A forked child (a runner's worker process) shares the parent's locked file description:
    left open, it would keep the directory locked after the agent died. It lets go at once."""
    for state in list(_LOCKED):
        fd, state._lock_fd = state._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _LOCKED.clear()


os.register_at_fork(after_in_child=_drop_locks_in_child)

_APPEND_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC


def _write_failed(what: str, exc: Exception) -> ControlPlaneError:
    reason = (exc.strerror if isinstance(exc, OSError) else None) or f"{type(exc).__name__}: {exc}"
    return ControlPlaneError(f"{what}: {reason}", code=WireCode.JOURNAL_WRITE_FAILED)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: Path) -> None:
    """Make a new or renamed entry in ``directory`` durable (its own fsync, on Linux)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    directory.mkdir(parents=True, exist_ok=True)
    _fsync_dir(directory.parent)


def _lock(directory: Path) -> int:
    """Lock ``directory`` for this process (exclusive, non-blocking ``flock``) and return the
    lock file's descriptor; closing it unlocks (so does the process's death)."""
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = f" (pid {int(os.pread(fd, 32, 0).decode().strip())})"
        os.close(fd)
        raise ControlPlaneError(
            f"worker state directory {directory} is in use by another agent{holder}: run one"
            " agent per worker id and state directory",
            code=LocalCode.STATE_DIR_LOCKED,
        ) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # only to name the holder in the error above
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _preview(lines: list[str], limit: int = 2000) -> str:
    text = " | ".join(lines)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
