"""The agent's journal as two durable phases, over :class:`~workers.agent.journal.WorkerState`.

Phase 1 (:meth:`Journal.commit_outcome`): what a command applied and its terminal ack, durable
before anyone can see the ack. Phase 2 (:meth:`Journal.commit_published`): which acks reached
Kafka and the next offset to read. Each is at most one ``fsync``, off the event loop (heartbeats
go on meanwhile); the state in memory changes on the loop. No Kafka here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.protocol import Ack, ReloadWeightsSpec
from workers.agent import failpoints
from workers.agent.journal import Outcome, WorkerState


@dataclass(frozen=True)
class ConfigApplied:
    """Config overrides a command applied (re-applied after a restart)."""

    overrides: Mapping[str, Any]


#: What a command applied, for the journal to re-apply after a restart.
Applied = ReloadWeightsSpec | ConfigApplied


class Journal:
    """The journal the agent writes; every write is one of the two phases."""

    def __init__(
        self,
        state: WorkerState,
        directory: Path,
        *,
        on_failure: Callable[[ControlPlaneError], ControlPlaneError],
    ) -> None:
        self._state = state
        self._directory = directory
        #: Told when a sync fails (with the error as JOURNAL_WRITE_FAILED); returns what to raise.
        self._on_failure = on_failure

    @property
    def incarnation(self) -> int:
        return self._state.incarnation

    @property
    def next_offset(self) -> int | None:
        return self._state.next_offset

    @property
    def weights(self) -> ReloadWeightsSpec | None:
        return self._state.weights

    @property
    def weights_key(self) -> str | None:
        """The trust store key that admitted :attr:`weights` (None: admitted without one)."""
        return self._state.weights_key

    @property
    def config_overrides(self) -> dict[str, Any]:
        return self._state.config_overrides

    @property
    def config_keys(self) -> dict[str, str | None]:
        """Per override, the trust store key that admitted the command that last set it."""
        return self._state.config_keys

    def outcome(self, command_id: str) -> Outcome | None:
        return self._state.outcome(command_id)

    def unpublished(self) -> list[Ack]:
        """Terminal acks recorded and not known to have reached Kafka, oldest first."""
        return [o.ack for o in self._state.outcomes.values() if not o.published]

    async def commit_outcome(
        self, ack: Ack, applied: Applied | None, key_id: str | None = None
    ) -> None:
        """Phase 1: what the command applied (and the trust store key that admitted it, checked
        again before a restart re-applies it), then its terminal ack (not published yet)."""
        if isinstance(applied, ReloadWeightsSpec):
            self._state.set_weights(applied, key_id)
        elif isinstance(applied, ConfigApplied):
            self._state.add_config(dict(applied.overrides), key_id)
        self._state.record(ack, published=False)
        await self._sync()

    async def commit_published(
        self, ids: Collection[str] = (), next_offset: int | None = None
    ) -> None:
        """Phase 2: the acks of ``ids`` reached Kafka, and where to read next (when given).
        No ``fsync`` when that changes nothing."""
        for command_id in ids:
            self._state.mark_published(command_id)
        if next_offset is not None:
            self._state.set_offset(next_offset)
        await self._sync()

    def close(self) -> ControlPlaneError | None:
        """Sync what is staged and unlock; never raises (returns what could not be written)."""
        return self._state.close()

    async def _sync(self) -> None:
        """Make the staged mutations durable: one fsync, off the loop (heartbeats go on)."""
        if not self._state.dirty:
            return
        try:
            failpoints.hit("journal_sync")
            await asyncio.to_thread(self._state.sync)
        except Exception as exc:
            raise self._on_failure(journal_error(exc, self._directory)) from exc


def journal_error(exc: Exception, directory: Path) -> ControlPlaneError:
    """``exc`` as JOURNAL_WRITE_FAILED (WorkerState raises it so; anything else is wrapped)."""
    if isinstance(exc, ControlPlaneError) and exc.code is WireCode.JOURNAL_WRITE_FAILED:
        return exc
    return ControlPlaneError(
        f"cannot write the journal in {directory}: {type(exc).__name__}: {exc}",
        code=WireCode.JOURNAL_WRITE_FAILED,
    )
