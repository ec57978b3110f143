"""The worker's durable local state: terminal acks by command id, its position, what is applied.

Kafka's committed offsets can expire on a quiet topic; this journal makes application
idempotent by command id across restarts regardless. Append-only JSON lines, a torn last line is
ignored, and the file is compacted when it grows. No Kafka, no asyncio.

Mutations change the state in memory at once and are *staged*; :meth:`WorkerState.sync` makes
everything staged durable with one write and one ``fsync``. The agent groups a phase's mutations
(what a command applied and its outcome; then "published" and the next offset) into one sync and
runs it off its event loop. The memory may be ahead of the disk until then, never behind.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from controlplane.errors import ProtocolError
from controlplane.protocol import Ack, ReloadWeightsSpec, decode_ack, encode

log = logging.getLogger(__name__)

#: Terminal outcomes remembered per worker (oldest forgotten first).
MAX_REMEMBERED = 10_000


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
        #: All config overrides applied so far, re-applied after a restart.
        self.config_overrides: dict[str, Any] = {}
        #: How many times this state has been opened, this time included (durable before
        #: :meth:`open` returns): orders a worker's incarnations whatever its clock says.
        self.incarnation = 0
        self._lines = 0
        self._fh: IO[str] | None = None
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
        directory.mkdir(parents=True, exist_ok=True)
        state = cls(directory / "state.jsonl")
        state._replay()
        if state._lines > 2 * MAX_REMEMBERED + 100:
            state.compact()
        state._fh = open(state.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the state
        with state._lock:
            state.incarnation += 1
            state._stage({"t": "incarnation", "n": state.incarnation})
        state.sync()
        return state

    def close(self) -> None:
        """Sync what is staged (it happened: the memory says so) and close the file."""
        with self._io_lock:
            if self._fh is not None:
                self._write_pending()
                self._fh.close()
                self._fh = None

    @property
    def dirty(self) -> bool:
        """Whether mutations are staged that a :meth:`sync` would make durable."""
        return bool(self._pending)

    def sync(self) -> None:
        """Make every staged mutation durable: one write, one ``fsync`` (none if nothing staged).

        Blocking; safe to call from a worker thread while the owner thread stages more.
        """
        with self._io_lock:
            if self._fh is None:
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

    def set_weights(self, spec: ReloadWeightsSpec) -> None:
        with self._lock:
            self.weights = spec
            self._stage({"t": "weights", "spec": spec.model_dump(mode="json")})

    def add_config(self, overrides: dict[str, Any]) -> None:
        with self._lock:
            self.config_overrides.update(overrides)
            self._stage({"t": "config", "overrides": overrides})

    def compact(self) -> None:
        """Rewrite the journal as the current state (atomically: temp file, fsync, rename).

        What is staged is part of the current state, so it is durable afterwards too.
        """
        with self._io_lock:
            self._compact()

    # ------------------------------------------------------------------ internals

    def _stage(self, entry: dict[str, Any]) -> None:  # under _lock
        self._pending.append(json.dumps(entry, separators=(",", ":")))

    def _write_pending(self) -> None:  # under _io_lock
        assert self._fh is not None
        with self._lock:
            lines, self._pending = self._pending, []
        if not lines:
            return
        try:
            self._fh.write(("\n" if self._torn else "") + "\n".join(lines) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except BaseException:
            # Not durable: staged again, ahead of anything staged since (a line written twice
            # replays to the same state; a torn one is skipped).
            self._torn = True
            with self._lock:
                self._pending[:0] = lines
            raise
        self._torn = False
        self._lines += len(lines)
        if self._lines > 2 * MAX_REMEMBERED + 100:
            self._compact()

    def _compact(self) -> None:  # under _io_lock
        with self._lock:  # the snapshot includes everything staged so far, so drop that
            entries = self._snapshot()
            self._pending = []
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for entry in entries:
                fh.write(json.dumps(entry, separators=(",", ":")) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._lines = len(entries)
        if self._fh is not None:
            self._fh.close()
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _snapshot(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"t": "outcome", "ack": json.loads(encode(o.ack)), "published": o.published}
            for o in self.outcomes.values()
        ]
        if self.next_offset is not None:
            out.append({"t": "offset", "next": self.next_offset})
        if self.weights is not None:
            out.append({"t": "weights", "spec": self.weights.model_dump(mode="json")})
        if self.config_overrides:
            out.append({"t": "config", "overrides": self.config_overrides})
        if self.incarnation:
            out.append({"t": "incarnation", "n": self.incarnation})
        return out

    def _apply_outcome(self, ack: Ack, published: bool) -> None:
        self.outcomes[ack.command_id] = Outcome(ack=ack, published=published)
        self.outcomes.move_to_end(ack.command_id)
        while len(self.outcomes) > MAX_REMEMBERED:
            self.outcomes.popitem(last=False)

    def _replay(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
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
        elif kind == "config":
            self.config_overrides.update(entry["overrides"])
        elif kind == "incarnation":
            self.incarnation = max(self.incarnation, int(entry["n"]))
