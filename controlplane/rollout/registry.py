"""Workers and their liveness, folded from heartbeats (the latest per worker, as on the compacted topic).

Pure: no I/O, no asyncio, no clock; every answer that depends on time takes ``now``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Final

from pydantic import AwareDatetime, BaseModel, ConfigDict

from controlplane.wire.protocol import Degraded, Heartbeat, InFlight, Selector, WorkerStatus

#: A worker silent for more than this many heartbeat periods is considered lost.
LIVENESS_PERIODS: Final = 3

#: The longest heartbeat period the fold believes: a longer (or non-finite) ``interval_s``,
#: whatever the decoder let through, counts as this, so no arithmetic on it can overflow.
MAX_INTERVAL_S: Final = 86400.0

#: The clock's resolution: the first instant past a limit.
TICK: Final = timedelta(microseconds=1)

_FIRST: Final = datetime.min.replace(tzinfo=UTC)
_LAST: Final = datetime.max.replace(tzinfo=UTC)


def shift(when: datetime, by: timedelta) -> datetime:
    """``when + by``, saturated at the first and last representable instants (never raises)."""
    try:
        return when + by
    except OverflowError:
        return _LAST if by > timedelta(0) else _FIRST


def seconds(value: float, *, limit: float = MAX_INTERVAL_S) -> timedelta:
    """A non-negative duration of ``value`` seconds, at most ``limit`` (NaN counts as ``limit``)."""
    if not value >= 0:  # negative, or NaN
        value = 0.0 if value < 0 else limit
    return timedelta(seconds=min(value, limit) if math.isfinite(value) else limit)


def silence_limit(hb: Heartbeat) -> timedelta:
    """How long after ``hb`` its worker still counts as alive without another heartbeat: the
    lease it asked for, else ``LIVENESS_PERIODS`` periods (docs/rollouts.md, Liveness)."""
    return _silence_limit(hb.lease_s, hb.interval_s)


@functools.lru_cache(maxsize=256)
def _silence_limit(lease_s: float | None, interval_s: float) -> timedelta:
    """:func:`silence_limit` of a heartbeat's two numbers (a fleet uses a few pairs: cached)."""
    limit = LIVENESS_PERIODS * MAX_INTERVAL_S
    if lease_s is not None:
        return seconds(lease_s, limit=limit)
    return seconds(LIVENESS_PERIODS * interval_s, limit=limit)


def seen_at(hb: Heartbeat, received_at: datetime | None = None) -> datetime:
    """When the reader got ``hb``: ``received_at``, or (not known) the worker's own ``sent_at``."""
    return hb.sent_at if received_at is None else received_at


def _elapsed(later: datetime, earlier: datetime) -> timedelta:
    """``later - earlier`` on the worker's own clock, never negative."""
    return max(later - earlier, timedelta(0))


def started_seen(hb: Heartbeat, received_at: datetime | None = None) -> datetime:
    """When the incarnation that sent ``hb`` started, on the reader's clock.

    The worker's own clock measures how long it had been running (``sent_at - started_at``, a
    difference on one clock, so skew cancels); that is taken back from when the reader got it.
    """
    if received_at is None:
        return hb.started_at
    return shift(received_at, -_elapsed(hb.sent_at, hb.started_at))


def lost_at(hb: Heartbeat, received_at: datetime | None = None) -> datetime:
    """The first instant at which ``hb`` no longer proves its worker alive (at once if stopped).

    ``is_alive(hb, t, received_at)`` is false from this instant on, and true before it for a
    running worker. Times are the reader's: ``received_at`` (None: the worker's ``sent_at``).
    """
    seen = seen_at(hb, received_at)
    if hb.status is WorkerStatus.STOPPED:
        return seen
    return shift(shift(seen, silence_limit(hb)), TICK)


def is_alive(hb: Heartbeat, now: datetime, received_at: datetime | None = None) -> bool:
    """Alive: not stopped, and received within its silence limit (lease) of ``now``.

    Judged on the reader's clock (``received_at``; None: the worker's own ``sent_at``), so a
    worker whose clock is behind is not judged lost for it.
    """
    return hb.status is not WorkerStatus.STOPPED and now < lost_at(hb, received_at)


def was_alive_at(hb: Heartbeat, when: datetime, received_at: datetime | None = None) -> bool:
    """Whether the incarnation that sent ``hb`` (a worker's latest known) was alive at ``when``.

    It had started by then (``started_seen <= when``), had been heard from recently enough
    (received at most its lease, :func:`silence_limit`, before ``when``; a later heartbeat of
    the same incarnation proves it was running at ``when`` too), and had not already stopped.
    """
    seen = seen_at(hb, received_at)
    if started_seen(hb, received_at) > when or shift(seen, silence_limit(hb)) < when:
        return False
    return not (hb.status is WorkerStatus.STOPPED and seen <= when)


def same_incarnation(a: Heartbeat, b: Heartbeat) -> bool:
    return a.started_at == b.started_at and a.incarnation == b.incarnation


def supersedes(new: Heartbeat, held: Heartbeat) -> bool:
    """Whether ``new`` is a later heartbeat of its worker than ``held``.

    Incarnations are ordered by the counter the worker persists (``incarnation``) when both
    carry one, whatever the worker's clock says; otherwise by ``started_at``. Within one, by ``seq``.
    """
    if new.incarnation > 0 and held.incarnation > 0:
        return (new.incarnation, new.started_at, new.seq) > (
            held.incarnation,
            held.started_at,
            held.seq,
        )
    return (new.started_at, new.seq) > (held.started_at, held.seq)


class WorkerView(BaseModel):
    """One worker as the API and dashboard show it: its latest heartbeat and whether it is alive.

    ``last_seen`` is when the reader received it (the reader's clock, which judges liveness);
    ``sent_at`` is the worker's own clock, shown to spot skew.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str
    labels: dict[str, str]
    runner: str
    device: str
    status: WorkerStatus
    weights_version: str | None
    config_digest: str | None
    #: The digest of the weights it holds, as of its latest heartbeat (None: not reported).
    weights_digest: str | None = None
    in_flight: InFlight | None
    degraded: Degraded | None
    last_seen: AwareDatetime
    sent_at: AwareDatetime | None = None
    started_at: AwareDatetime
    seq: int
    incarnation: int = 0
    interval_s: float
    #: How long the latest heartbeat vouches for the worker (its lease, else 3 periods).
    lease_s: float = 0.0
    #: Acks the worker journaled that Kafka had not confirmed, and since when its publishes
    #: went unconfirmed (None: they went through), as of its latest heartbeat.
    acks_unpublished: int = 0
    publish_failing_since: AwareDatetime | None = None
    agent_version: str
    alive: bool

    @classmethod
    def of(cls, hb: Heartbeat, now: datetime, received_at: datetime | None = None) -> WorkerView:
        return cls.model_construct(
            worker_id=hb.worker_id,
            labels=dict(hb.labels),
            runner=hb.runner,
            device=hb.device,
            status=hb.status,
            weights_version=hb.weights_version,
            config_digest=hb.config_digest,
            weights_digest=hb.weights_digest,
            in_flight=hb.in_flight,
            degraded=hb.degraded,
            last_seen=seen_at(hb, received_at),
            sent_at=hb.sent_at,
            started_at=hb.started_at,
            seq=hb.seq,
            incarnation=hb.incarnation,
            interval_s=hb.interval_s,
            lease_s=silence_limit(hb).total_seconds(),
            acks_unpublished=hb.acks_unpublished,
            publish_failing_since=hb.publish_failing_since,
            agent_version=hb.agent_version,
            alive=is_alive(hb, now, received_at),
        )


class Registry:
    """The latest heartbeat of every worker, whatever order heartbeats arrive in, with when the
    reader received it (liveness is judged on the reader's clock, not the worker's).

    A heartbeat replaces the one held when it is later by :func:`supersedes` (a later
    incarnation, or the same one with a higher ``seq``); anything else is stale (reordered or
    redelivered) and ignored. O(1) per heartbeat.
    """

    def __init__(self) -> None:
        self._latest: dict[str, Heartbeat] = {}
        #: worker id -> when the reader received its latest heartbeat (absent: its ``sent_at``).
        self._received: dict[str, datetime] = {}
        #: worker id -> the latest heartbeat (and receive time) of its incarnation before the
        #: latest one: whether the worker was alive at an instant before it restarted.
        self._previous: dict[str, tuple[Heartbeat, datetime | None]] = {}
        #: worker id -> :meth:`lost_times` of its latest heartbeat, computed when first asked.
        self._lost: dict[str, tuple[datetime, datetime]] = {}

    def observe(self, hb: Heartbeat, received_at: datetime | None = None) -> bool:
        """Fold in one heartbeat; True when it became the worker's latest.

        ``received_at``: when the reader got it (the record's broker timestamp, or the reader's
        clock at the fetch); None means ``hb.sent_at`` (the worker's clock).
        """
        worker_id = hb.worker_id
        held = self._latest.get(worker_id)
        if held is not None and not supersedes(hb, held):
            if not same_incarnation(hb, held):
                self._keep_previous(hb, received_at)
            return False
        if held is not None and not same_incarnation(hb, held):
            self._keep_previous(held, self._received.get(worker_id))
        self._latest[worker_id] = hb
        self._lost.pop(worker_id, None)
        if received_at is None:
            self._received.pop(worker_id, None)
        else:
            self._received[worker_id] = received_at
        return True

    def _keep_previous(self, hb: Heartbeat, received_at: datetime | None) -> None:
        held = self._previous.get(hb.worker_id)
        if held is None or supersedes(hb, held[0]):
            self._previous[hb.worker_id] = (hb, received_at)

    def was_alive_at(self, worker_id: str, when: datetime, *, own_clock: bool = False) -> bool:
        """Whether the worker's latest incarnation, or the one before it, was alive at ``when``.

        ``own_clock``: judged on the worker's own timestamps (``sent_at``, ``started_at``), not
        on when this reader received them: an answer that is a function of the log alone, the
        same for every reader (what a verdict may depend on)."""
        hb = self._latest.get(worker_id)
        if hb is None:
            return False
        if was_alive_at(hb, when, None if own_clock else self._received.get(worker_id)):
            return True
        previous = self._previous.get(worker_id)
        return previous is not None and was_alive_at(
            previous[0], when, None if own_clock else previous[1]
        )

    def forget(self, worker_id: str) -> bool:
        """Drop a worker (a tombstone on the compacted topic); True when it was known."""
        self._received.pop(worker_id, None)
        self._previous.pop(worker_id, None)
        self._lost.pop(worker_id, None)
        return self._latest.pop(worker_id, None) is not None

    def latest(self, worker_id: str) -> Heartbeat | None:
        """The worker's latest heartbeat, or None when it was never seen."""
        return self._latest.get(worker_id)

    def received_at(self, worker_id: str) -> datetime | None:
        """When the reader received the worker's latest heartbeat; None: not given (or unknown
        worker), use its ``sent_at``."""
        return self._received.get(worker_id)

    def entry(self, worker_id: str) -> tuple[Heartbeat, datetime | None] | None:
        """The latest heartbeat and its receive time (None: not given), or None when never seen."""
        hb = self._latest.get(worker_id)
        return None if hb is None else (hb, self._received.get(worker_id))

    def lost_times(self, worker_id: str) -> tuple[datetime, datetime] | None:
        """When the worker's latest heartbeat stops proving it alive (:func:`lost_at`): on the
        reader's clock, and on the worker's own; None when never seen. Cached per heartbeat
        (judging a rollout asks it of every worker)."""
        held = self._lost.get(worker_id)
        if held is not None:
            return held
        hb = self._latest.get(worker_id)
        if hb is None:
            return None
        held = self._lost[worker_id] = (lost_at(hb, self._received.get(worker_id)), lost_at(hb))
        return held

    def heartbeats(self) -> Iterator[Heartbeat]:
        """Every worker's latest heartbeat, in no particular order."""
        return iter(self._latest.values())

    def entries(self) -> Iterator[tuple[Heartbeat, datetime | None]]:
        """Every worker's latest heartbeat with its receive time, in no particular order."""
        received = self._received
        return ((hb, received.get(w)) for w, hb in self._latest.items())

    def get(self, worker_id: str, now: datetime) -> WorkerView | None:
        hb = self._latest.get(worker_id)
        return None if hb is None else WorkerView.of(hb, now, self._received.get(worker_id))

    def is_alive(self, worker_id: str, now: datetime) -> bool:
        hb = self._latest.get(worker_id)
        return hb is not None and is_alive(hb, now, self._received.get(worker_id))

    def workers(self, now: datetime) -> list[WorkerView]:
        """Every known worker, alive or not, sorted by worker id."""
        received = self._received
        return [WorkerView.of(self._latest[w], now, received.get(w)) for w in sorted(self._latest)]

    def matching(
        self, selector: Selector, now: datetime, *, alive_only: bool = True
    ) -> list[WorkerView]:
        """Workers ``selector`` matches, sorted by id; only the alive ones unless told otherwise.

        This is how a publisher resolves labels to explicit worker ids before it sends a command.
        """
        out = []
        received = self._received
        for worker_id in sorted(self._latest):
            hb = self._latest[worker_id]
            r = received.get(worker_id)
            if selector.matches(worker_id, hb.labels) and (not alive_only or is_alive(hb, now, r)):
                out.append(WorkerView.of(hb, now, r))
        return out

    def __len__(self) -> int:
        return len(self._latest)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._latest
