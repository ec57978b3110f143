"""The worker's durable local state: terminal acks by command id, its position, what is applied.

Kafka's committed offsets can expire on a quiet topic; this journal makes application
idempotent by command id across restarts regardless. Append-only JSON lines with fsync, a torn
last line is ignored, and the file is compacted when it grows. No Kafka, no asyncio.
"""

from __future__ import annotations

import json
import logging
import os
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
    """Open with :meth:`open`; every mutation is durable when the method returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outcomes: OrderedDict[str, Outcome] = OrderedDict()
        #: Offset of the next command to read, as last committed by this worker.
        self.next_offset: int | None = None
        #: The last successfully applied reload, re-applied after a restart.
        self.weights: ReloadWeightsSpec | None = None
        #: All config overrides applied so far, re-applied after a restart.
        self.config_overrides: dict[str, Any] = {}
        self._lines = 0
        self._fh: IO[str] | None = None

    @classmethod
    def open(cls, directory: Path) -> WorkerState:
        directory.mkdir(parents=True, exist_ok=True)
        state = cls(directory / "state.jsonl")
        state._replay()
        if state._lines > 2 * MAX_REMEMBERED + 100:
            state.compact()
        state._fh = open(state.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the state
        return state

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # ------------------------------------------------------------------ queries

    def outcome(self, command_id: str) -> Outcome | None:
        return self.outcomes.get(command_id)

    # ------------------------------------------------------------------ mutations

    def record(self, ack: Ack, *, published: bool) -> None:
        self._apply_outcome(ack, published)
        self._append({"t": "outcome", "ack": json.loads(encode(ack)), "published": published})

    def mark_published(self, command_id: str) -> None:
        item = self.outcomes.get(command_id)
        if item is not None and not item.published:
            item.published = True
            self._append({"t": "published", "id": command_id})

    def set_offset(self, next_offset: int) -> None:
        if next_offset != self.next_offset:
            self.next_offset = next_offset
            self._append({"t": "offset", "next": next_offset})

    def set_weights(self, spec: ReloadWeightsSpec) -> None:
        self.weights = spec
        self._append({"t": "weights", "spec": spec.model_dump(mode="json")})

    def add_config(self, overrides: dict[str, Any]) -> None:
        self.config_overrides.update(overrides)
        self._append({"t": "config", "overrides": overrides})

    def compact(self) -> None:
        """Rewrite the journal as the current state (atomically: temp file, fsync, rename)."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for entry in self._snapshot():
                fh.write(json.dumps(entry, separators=(",", ":")) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self.outcomes) + 3
        if self._fh is not None:
            self._fh.close()
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    # ------------------------------------------------------------------ internals

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
        return out

    def _apply_outcome(self, ack: Ack, published: bool) -> None:
        self.outcomes[ack.command_id] = Outcome(ack=ack, published=published)
        self.outcomes.move_to_end(ack.command_id)
        while len(self.outcomes) > MAX_REMEMBERED:
            self.outcomes.popitem(last=False)

    def _append(self, entry: dict[str, Any]) -> None:
        if self._fh is None:
            raise RuntimeError("worker state is closed")
        self._fh.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._lines += 1
        if self._lines > 2 * MAX_REMEMBERED + 100:
            self.compact()

    def _replay(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        for number, line in enumerate(text.splitlines(), 1):
            self._lines += 1
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
