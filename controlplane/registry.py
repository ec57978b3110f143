"""Workers and their liveness, folded from heartbeats (the latest per worker, as on the compacted topic).

Pure: no I/O, no asyncio, no clock; every answer that depends on time takes ``now``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Final

from pydantic import AwareDatetime, BaseModel, ConfigDict

from controlplane.protocol import Degraded, Heartbeat, InFlight, Selector, WorkerStatus

#: A worker silent for more than this many heartbeat periods is considered lost.
LIVENESS_PERIODS: Final = 3


def silence_limit(hb: Heartbeat) -> timedelta:
    """How long after ``hb`` its worker still counts as alive without another heartbeat."""
    return timedelta(seconds=LIVENESS_PERIODS * hb.interval_s)


#: The clock's resolution: the first instant past a limit.
TICK: Final = timedelta(microseconds=1)


def lost_at(hb: Heartbeat) -> datetime:
    """The first instant at which ``hb`` no longer proves its worker alive (at once if stopped).

    ``is_alive(hb, t)`` is false from this instant on, and true before it for a running worker.
    """
    if hb.status is WorkerStatus.STOPPED:
        return hb.sent_at
    return hb.sent_at + silence_limit(hb) + TICK


def is_alive(hb: Heartbeat, now: datetime) -> bool:
    """Alive: not stopped, and heard from within ``LIVENESS_PERIODS`` periods of ``now``."""
    return hb.status is not WorkerStatus.STOPPED and now - hb.sent_at <= silence_limit(hb)


def was_alive_at(hb: Heartbeat, when: datetime) -> bool:
    """Whether the incarnation that sent ``hb`` (a worker's latest known) was alive at ``when``.

    It had started by then (``started_at <= when``), had been heard from recently enough
    (``sent_at >= when - 3 periods``; a later heartbeat of the same incarnation proves it was
    running at ``when`` too), and had not already stopped.
    """
    if hb.started_at > when or hb.sent_at < when - silence_limit(hb):
        return False
    return not (hb.status is WorkerStatus.STOPPED and hb.sent_at <= when)


class WorkerView(BaseModel):
    """One worker as the API and dashboard show it: its latest heartbeat and whether it is alive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str
    labels: dict[str, str]
    runner: str
    device: str
    status: WorkerStatus
    weights_version: str | None
    config_digest: str | None
    in_flight: InFlight | None
    degraded: Degraded | None
    last_seen: AwareDatetime
    started_at: AwareDatetime
    seq: int
    interval_s: float
    agent_version: str
    alive: bool

    @classmethod
    def of(cls, hb: Heartbeat, now: datetime) -> WorkerView:
        return cls(
            worker_id=hb.worker_id,
            labels=dict(hb.labels),
            runner=hb.runner,
            device=hb.device,
            status=hb.status,
            weights_version=hb.weights_version,
            config_digest=hb.config_digest,
            in_flight=hb.in_flight,
            degraded=hb.degraded,
            last_seen=hb.sent_at,
            started_at=hb.started_at,
            seq=hb.seq,
            interval_s=hb.interval_s,
            agent_version=hb.agent_version,
            alive=is_alive(hb, now),
        )


class Registry:
    """The latest heartbeat of every worker, whatever order heartbeats arrive in.

    A heartbeat replaces the one held when it belongs to a later incarnation (later
    ``started_at``) or to the same incarnation with a higher ``seq``; anything else is stale
    (reordered or redelivered) and ignored. O(1) per heartbeat.
    """

    def __init__(self) -> None:
        self._latest: dict[str, Heartbeat] = {}

    def observe(self, hb: Heartbeat, received_at: datetime | None = None) -> bool:
        """Fold in one heartbeat; True when it became the worker's latest.

        ``received_at`` (not used yet): when the reader got it; None means ``hb.sent_at``.
        """
        held = self._latest.get(hb.worker_id)
        if held is not None and (hb.started_at, hb.seq) <= (held.started_at, held.seq):
            return False
        self._latest[hb.worker_id] = hb
        return True

    def forget(self, worker_id: str) -> bool:
        """Drop a worker (a tombstone on the compacted topic); True when it was known."""
        return self._latest.pop(worker_id, None) is not None

    def latest(self, worker_id: str) -> Heartbeat | None:
        """The worker's latest heartbeat, or None when it was never seen."""
        return self._latest.get(worker_id)

    def heartbeats(self) -> Iterator[Heartbeat]:
        """Every worker's latest heartbeat, in no particular order."""
        return iter(self._latest.values())

    def get(self, worker_id: str, now: datetime) -> WorkerView | None:
        hb = self._latest.get(worker_id)
        return None if hb is None else WorkerView.of(hb, now)

    def is_alive(self, worker_id: str, now: datetime) -> bool:
        hb = self._latest.get(worker_id)
        return hb is not None and is_alive(hb, now)

    def workers(self, now: datetime) -> list[WorkerView]:
        """Every known worker, alive or not, sorted by worker id."""
        return [WorkerView.of(self._latest[w], now) for w in sorted(self._latest)]

    def matching(
        self, selector: Selector, now: datetime, *, alive_only: bool = True
    ) -> list[WorkerView]:
        """Workers ``selector`` matches, sorted by id; only the alive ones unless told otherwise.

        This is how a publisher resolves labels to explicit worker ids before it sends a command.
        """
        out = []
        for worker_id in sorted(self._latest):
            hb = self._latest[worker_id]
            if selector.matches(worker_id, hb.labels) and (not alive_only or is_alive(hb, now)):
                out.append(WorkerView.of(hb, now))
        return out

    def __len__(self) -> int:
        return len(self._latest)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._latest
