"""Fleet and rollout summaries that cost O(rollouts + versions) to read, not O(workers x rollouts).

What the API's summary and list endpoints, the dashboard and ``/metrics`` read (issue 18). Two parts:

- :class:`WorkerIndex`: per worker, the facts of its latest heartbeat (status, weights version,
  config digest, degraded, and the instant it stops proving the worker alive), kept from the
  follower's batches in O(1) per heartbeat. Counts by status, version and digest are kept as
  they change; each group keeps its workers' deadlines sorted, so how many of them are alive at
  any instant is one bisection. Worker ids are kept sorted for keyset pagination.
- :class:`Summaries`: each rollout judged in counts (``Fleet.tally``, O(its workers) but no
  detail per worker made; one pinned to workers that all reported a terminal state is judged
  from its acks alone) at most once per change, cached as a :class:`RolloutOverview` (counts, no
  per-worker list) with the status it counted; a page of a rollout pinned to worker ids
  (:meth:`Summaries.workers_page`, :meth:`Summaries.status` with ``workers_limit``) is judged
  against it for the page's workers only (``judge.details``); the full status (``Fleet.status``)
  is made only for the few rollouts chosen by labels whose workers are being read. A judgment that finds a rollout ended, at an instant the coordinator knows to be
  current, tells the fleet (``Fleet.note_ended``): compaction does not judge it again. A judgment is reused while it is *fresh*:
  nothing was folded for the rollout since, and it is settled (ended, every worker terminal:
  only acks can change it) or younger than ``max_age_s``. A stale one is served as it is (its
  ``as_of`` says when it was judged) while a background task judges it again, unless it is
  older than ``max_stale_s`` and nobody read it lately: then the reader waits for the new one.
  The background task also judges again, as they age, the entries read within KEEP_WARM_S, so
  their readers (a dashboard, a Prometheus scrape) do not wait; it takes at most a quarter of
  the event loop. Judgments run on the loop (the fold's state is not thread-safe), one rollout
  at a time with the loop free between two: the loop never waits for more than one rollout's
  judgment. A judgment cheaper than the reader's :class:`Budget` is made for the request, so a
  small fleet is always answered as the fold says now.

The desired versions of workers (targets, and ``Fleet.worker_levels`` or, when every reload
rollout is pinned to worker ids, the same found from their acks and ended judgments without a
Track per worker) are cached the same way. Nothing here changes the fold.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, JsonValue, computed_field

from controlplane.coordinator.follower import Batch
from controlplane.kafka.client import collector_paused
from controlplane.rollout.desired import Alignment, targets_status
from controlplane.rollout.judge import Tally, details, settled_end, unended_by_acks
from controlplane.rollout.ledger import CommandLedger
from controlplane.rollout.models import (
    Anomaly,
    RolloutPhase,
    RolloutReason,
    RolloutStatus,
    StateCounts,
    WorkerDetail,
    WorkerState,
)
from controlplane.rollout.registry import Registry, lost_at
from controlplane.wire.protocol import (
    Command,
    CommandKind,
    Heartbeat,
    ReloadWeightsSpec,
    Selector,
    WorkerStatus,
)

if TYPE_CHECKING:
    from controlplane.coordinator.service import Coordinator
    from controlplane.rollout.fleet import Fleet

#: A judgment younger than this (in judge time) is served as is, if nothing changed since.
MAX_AGE_S: Final = 1.0
#: A judgment older than this is never served: the reader waits for a new one.
MAX_STALE_S: Final = 3.0
#: Full statuses (every worker's detail: about 10 MB at 10,000 workers) kept for the rollouts
#: whose workers were read last.
KEEP_FULL: Final = 4
#: An entry read within this many seconds is judged again in the background as it ages, so
#: that its readers (a dashboard, a Prometheus scrape) never wait for a judgment.
KEEP_WARM_S: Final = 60.0
#: The background task sleeps this many times what its last judgment cost before the next:
#: it takes at most a quarter of the event loop.
IDLE_PER_COST: Final = 3.0
#: Anomalies an overview lists (``anomalies_total`` counts them all).
MAX_ANOMALIES: Final = 20
#: A page of a rollout's workers read through a filter judges this many of them at a time,
#: the loop free between two (a filter that keeps few of 10,000 workers looks at them all).
PAGE_CHUNK: Final = 250

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_US: Final = timedelta(microseconds=1)
#: A deadline that no instant is before: a stopped worker is never alive.
_NEVER: Final = -(2**62)
#: The phases in which a reload rollout desires its version for its workers (as Fleet's).
_DESIRING: Final = frozenset(
    {RolloutPhase.PENDING, RolloutPhase.PROGRESSING, RolloutPhase.SUCCEEDED}
)
_UNSETTLED: Final = (
    WorkerState.PENDING,
    WorkerState.ACCEPTED,
    WorkerState.RUNNING,
    WorkerState.LOST,
)

T = TypeVar("T")
_LEVELS: Final = "*levels"  # not a rollout id: ids are identifiers (no "*")
log = logging.getLogger(__name__)


def micros(when: datetime) -> int:
    """``when`` as integer microseconds since the epoch (exact, unlike a float timestamp)."""
    return (when - _EPOCH) // _US


# --------------------------------------------------------------------------- models


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class GroupCount(_Out):
    workers: int
    alive: int


class WorkersSummary(_Out):
    known: int = Field(description="Workers with a heartbeat in the log.")
    alive: int = Field(description="Known workers whose latest heartbeat proves them alive.")
    lost: int = Field(description="Known workers not alive: silent past their lease, or stopped.")
    degraded: int = Field(description="Known workers whose weights are a mix of two versions.")
    in_sync: int | None = Field(
        description="Known workers reporting what is desired for them (as GET /workers says "
        "`in_sync`), judged at `in_sync_as_of`; null before it was first judged."
    )
    in_sync_as_of: AwareDatetime | None
    never_seen: int | None = Field(
        description="Workers a rollout expects that never sent a heartbeat (as of `in_sync_as_of`)."
    )
    by_status: dict[str, GroupCount] = Field(description="By the status of the latest heartbeat.")
    by_version: dict[str, GroupCount] = Field(
        description='By reported weights version ("": none reported).'
    )
    by_config_digest: dict[str, GroupCount] = Field(
        description='By reported config digest ("": none reported).'
    )


class RolloutsSummary(_Out):
    total: int
    active: int = Field(description="Pending or progressing.")
    by_phase: dict[RolloutPhase, int]
    summarized: int = Field(description="Ended rollouts kept only as a summary (no details).")
    oldest_as_of: AwareDatetime | None = Field(
        description="The earliest instant a phase counted here was judged at."
    )


class FleetSummary(_Out):
    """The fleet in counts: what the dashboard's header and a fleet-wide check need."""

    as_of: AwareDatetime
    workers: WorkersSummary
    rollouts: RolloutsSummary


class RolloutOverview(_Out):
    """One rollout in counts: its status without the per-worker lists (and without the worker
    ids its selector pinned: ``pinned_workers`` counts them). Judged at ``as_of``."""

    rollout_id: str
    command_id: str
    kind: CommandKind | None
    target_version: str | None = None
    overrides: dict[str, JsonValue] | None = None
    dry_run: bool = Field(
        default=False,
        description="A dry run (`Command.dry_run`): checked on every worker, applied on none; "
        "`succeeded` means validated.",
    )
    issuer: str | None
    selector: Selector
    pinned_workers: int | None = Field(
        default=None, description="How many worker ids the command named (null: labels only)."
    )
    issued_at: AwareDatetime
    expires_at: AwareDatetime | None
    as_of: AwareDatetime
    phase: RolloutPhase
    reason: RolloutReason | None = None
    message: str
    expected: int
    counts: StateCounts
    errors: dict[str, int] = Field(
        default_factory=dict, description="Failed or rejected workers by error code."
    )
    versions: dict[str, int] = Field(
        default_factory=dict,
        description="Workers by the weights version their acks reported (those that reported one).",
    )
    late: int = Field(default=0, description="Workers that reported a state after the end.")
    unexpected_workers: int = 0
    anomalies: tuple[Anomaly, ...] = Field(
        default=(), description=f"The first {MAX_ANOMALIES} anomalies."
    )
    anomalies_total: int = 0
    started_at: AwareDatetime | None = None
    finished_at: AwareDatetime | None = None
    duration_s: float | None = None
    details_dropped: bool = False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def exit_code(self) -> int | None:
        """0 succeeded, 1 failed or aborted, 2 timed out, None while the rollout is running."""
        return self.phase.exit_code

    @property
    def terminal(self) -> bool:
        return self.phase.terminal

    @property
    def settled(self) -> bool:
        """Ended with every worker terminal (or summarized): only acks can change it now."""
        return self.details_dropped or (
            self.terminal and not any(self.counts[s] for s in _UNSETTLED)
        )

    @classmethod
    def of(cls, status: RolloutStatus) -> RolloutOverview:
        return cls.of_tally(Tally.of(status))

    @classmethod
    def of_tally(cls, tally: Tally) -> RolloutOverview:
        """The overview of a rollout judged in counts (``Fleet.tally``: no detail per worker)."""
        status = tally.status
        ids = status.selector.worker_ids
        return cls(
            rollout_id=status.rollout_id,
            command_id=status.command_id,
            kind=status.kind,
            target_version=status.target_version,
            overrides=status.overrides,
            dry_run=status.dry_run,
            issuer=status.issuer,
            selector=status.selector.model_copy(update={"worker_ids": None}),
            pinned_workers=None if ids is None else len(ids),
            issued_at=status.issued_at,
            expires_at=status.expires_at,
            as_of=status.as_of,
            phase=status.phase,
            reason=status.reason,
            message=status.message,
            expected=status.expected,
            counts=status.counts,
            errors=dict(sorted(tally.errors.items())),
            versions=dict(sorted(tally.versions.items())),
            late=tally.late,
            unexpected_workers=tally.unexpected,
            anomalies=status.anomalies[:MAX_ANOMALIES],
            anomalies_total=len(status.anomalies),
            started_at=status.started_at,
            finished_at=status.finished_at,
            duration_s=status.duration_s,
            details_dropped=status.details_dropped,
        )


J = TypeVar("J", RolloutOverview, RolloutStatus)


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True, slots=True)
class _Facts:
    status: str
    version: str
    digest: str
    degraded: bool
    #: Microseconds since the epoch from which the heartbeat no longer proves the worker alive.
    deadline: int

    @classmethod
    def of(cls, hb: Heartbeat, received_at: datetime | None) -> _Facts:
        stopped = hb.status is WorkerStatus.STOPPED
        return cls(
            hb.status.value,
            hb.weights_version or "",  # "" is no version (a version is never empty)
            hb.config_digest or "",
            hb.degraded is not None,
            _NEVER if stopped else micros(lost_at(hb, received_at)),
        )

    def groups(self) -> tuple[tuple[str, str], ...]:
        return (
            ("", ""),
            ("status", self.status),
            ("version", self.version),
            ("digest", self.digest),
        )


class WorkerIndex:
    """The latest heartbeat's facts of every worker the registry knows, kept in O(1) per
    heartbeat (plus a memmove of a sorted list), with counts that answer in O(groups x log n).

    It follows the registry through :meth:`update` (the worker ids of a batch); a registry that
    changed otherwise (a worker forgotten, a snapshot restored) is noticed by its size and the
    index rebuilt (O(workers), rare).
    """

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._facts: dict[str, _Facts] = {}
        self._groups: dict[tuple[str, str], list[int]] = {}
        self._degraded = 0
        #: What each worker should run (as last judged) and the known workers that do.
        self._desired: Mapping[str, Desire] = {}
        self._synced: set[str] = set()
        #: Every known worker id, sorted (read it through :meth:`sorted_ids`).
        self.ids: list[str] = []

    def update(self, worker_ids: Iterable[str]) -> None:
        registry = self._registry
        for worker_id in worker_ids:
            entry = registry.entry(worker_id)
            self._set(worker_id, None if entry is None else _Facts.of(*entry))
        self.sync()

    def sync(self) -> None:
        """Rebuild from the registry if it changed behind the batches (its size differs)."""
        if len(self._facts) != len(self._registry):
            self._facts.clear()
            self._groups.clear()
            self._degraded = 0
            self._synced.clear()
            self.ids.clear()
            for hb, received in self._registry.entries():
                self._set(hb.worker_id, _Facts.of(hb, received))

    def _set(self, worker_id: str, facts: _Facts | None) -> None:
        held = self._facts.get(worker_id)
        if held == facts:
            return
        if held is not None:
            for key in held.groups():
                group = self._groups[key]
                del group[bisect.bisect_left(group, held.deadline)]
                if not group:
                    del self._groups[key]
            self._degraded -= held.degraded
        if facts is None:
            del self._facts[worker_id]
            del self.ids[bisect.bisect_left(self.ids, worker_id)]
            self._synced.discard(worker_id)
            return
        if held is None:
            bisect.insort(self.ids, worker_id)
        self._facts[worker_id] = facts
        for key in facts.groups():
            bisect.insort(self._groups.setdefault(key, []), facts.deadline)
        self._degraded += facts.degraded
        self._judge_sync(worker_id, facts)

    def _judge_sync(self, worker_id: str, facts: _Facts) -> None:
        want = self._desired.get(worker_id, NO_DESIRE)
        if want.in_sync is not None:
            synced = want.in_sync
        else:
            synced = not facts.degraded and (want.version is None or facts.version == want.version)
        if synced:
            self._synced.add(worker_id)
        else:
            self._synced.discard(worker_id)

    def set_desired(self, desired: Mapping[str, Desire]) -> None:
        """What each worker should run, newly judged: which known workers are in sync (O(workers))."""
        self.sync()
        self._desired = desired
        for worker_id, facts in self._facts.items():
            self._judge_sync(worker_id, facts)

    @property
    def in_sync(self) -> int:
        """Known workers that run what is desired for them (as last judged)."""
        self.sync()
        return len(self._synced)

    def __len__(self) -> int:
        self.sync()
        return len(self._facts)

    def sorted_ids(self) -> list[str]:
        """Every known worker id, sorted (the index's own list: do not change it)."""
        self.sync()
        return self.ids

    @property
    def degraded(self) -> int:
        self.sync()
        return self._degraded

    def alive(self, now: datetime) -> int:
        self.sync()
        return self._count(("", ""), micros(now)).alive

    def _count(self, key: tuple[str, str], now_us: int) -> GroupCount:
        group = self._groups.get(key, [])
        return GroupCount(workers=len(group), alive=len(group) - bisect.bisect_right(group, now_us))

    def summary(self, now: datetime, levels: Levels | None) -> WorkersSummary:
        self.sync()
        now_us = micros(now)
        total = self._count(("", ""), now_us)

        def by(kind: str) -> dict[str, GroupCount]:
            keys = sorted(v for k, v in self._groups if k == kind)
            return {v: self._count((kind, v), now_us) for v in keys}

        return WorkersSummary(
            known=total.workers,
            alive=total.alive,
            lost=total.workers - total.alive,
            degraded=self._degraded,
            in_sync=None if levels is None else len(self._synced),
            in_sync_as_of=None if levels is None else levels.as_of,
            never_seen=None if levels is None else len(levels.never_seen),
            by_status=by("status"),
            by_version=by("version"),
            by_config_digest=by("digest"),
        )


# --------------------------------------------------------------------------- cached judgments


@dataclass(slots=True)
class _Entry(Generic[T]):
    value: T
    #: The instant it was judged at (the coordinator's judge time, which ages it).
    as_of: datetime
    #: Seconds judging it took (time.monotonic).
    cost: float
    #: time.monotonic() when it was judged.
    judged: float
    settled: bool = False
    #: Something was folded for it since.
    dirty: bool = False
    #: time.monotonic() when a reader last asked for it: the background task keeps an entry
    #: asked for within KEEP_WARM_S judged.
    read: float = 0.0
    #: A rollout's: the status it was judged to, without its per-worker lists (the counts,
    #: the end, every anomaly): what a page of its workers is judged against.
    bare: RolloutStatus | None = None


class Want(Enum):
    """How current a reader needs a judgment."""

    #: Judged since the last change and within ``max_age_s``.
    FRESH = "fresh"
    #: At most ``max_stale_s`` old (a cheap one is judged again at once).
    BOUNDED = "bounded"
    #: Whatever is cached (a stale one is judged again in the background).
    CACHED = "cached"


@dataclass(slots=True)
class Budget:
    """Seconds a reader may spend judging stale entries again before it takes them stale."""

    left: float = 0.02


@dataclass(frozen=True, slots=True)
class Desire:
    """What a worker should run, as GET /workers says it."""

    version: str | None
    rollout_id: str | None
    target: str | None = None
    #: For a worker of a target: whether it is in sync with it (None: judged from versions).
    in_sync: bool | None = None


NO_DESIRE: Final = Desire(None, None)


@dataclass(frozen=True, slots=True)
class Levels:
    """Desired against reported, for every worker, judged at ``as_of``."""

    as_of: datetime
    desired: dict[str, Desire]
    #: Expected by a rollout, never heard from: sorted ids.
    never_seen: list[str]
    #: Target name -> its members' counts by alignment.
    targets: dict[str, dict[Alignment, int]] = field(default_factory=dict)


class Summaries:
    """Cached judgments of the coordinator's rollouts and workers; see the module docstring.

    Create it before the coordinator folds the log (it listens to the follower's batches);
    :meth:`close` stops its background task. A judgment that cost less than what is left of
    the reader's :class:`Budget` is made again at once rather than served stale, so a small
    fleet is always answered exactly as the fold says now.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        max_age_s: float = MAX_AGE_S,
        max_stale_s: float = MAX_STALE_S,
        keep_full: int = KEEP_FULL,
    ) -> None:
        self._coordinator = coordinator
        self._max_age = timedelta(seconds=max_age_s)
        self._max_stale = timedelta(seconds=max(max_stale_s, max_age_s))
        self._keep_full = max(1, keep_full)
        self.workers = WorkerIndex(coordinator.fleet.registry)
        self._rollouts: dict[str, _Entry[RolloutOverview]] = {}
        #: Full statuses of the rollouts whose workers were read last (least recent first).
        self._full: collections.OrderedDict[str, _Entry[RolloutStatus]] = collections.OrderedDict()
        self._levels: _Entry[Levels] | None = None
        #: What the pinned rollouts desired when the levels were last judged (None: not known).
        self._pinned_desired: dict[str, tuple[str, str, datetime]] | None = None
        self._compacted = 0
        self._wanted: dict[str, None] = {}
        self._task: asyncio.Task[None] | None = None
        self._warmed = False
        #: Judgments made (Fleet.status or worker_levels calls): tests count them.
        self.judgments = 0
        #: Workers' details made (a full status makes one per worker, a page one per row):
        #: tests count them.
        self.judged_workers = 0
        #: (rollout id, command id) -> the worker ids its command pins, sorted and as a set,
        #: for the rollouts whose workers were read last (least recent first).
        self._pinned_ids: collections.OrderedDict[
            tuple[str, str], tuple[list[str], frozenset[str]]
        ] = collections.OrderedDict()
        coordinator.follower.listeners.append(self.on_batch)
        self.workers.sync()

    # ------------------------------------------------------------------ the fold's news

    def on_batch(self, batch: Batch) -> None:
        """A follower listener: what changed, in O(batch)."""
        levels = self._levels
        if batch.heartbeats:
            seen = {hb.worker_id for hb in batch.heartbeats}
            self.workers.update(seen)
            if levels is not None and _any_in(seen, levels.value.never_seen):
                levels.dirty = True  # a worker heard from for the first time: never_seen falls
        changed = batch.rollout_ids
        for rollout_id in changed:
            for cache in (self._rollouts, self._full):
                held = cache.get(rollout_id)
                if held is not None:
                    held.dirty = True
        if (changed or batch.control) and levels is not None:
            levels.dirty = True
        if not self._warmed and not batch.replay and self._coordinator.ready:
            # Caught up: judge every rollout once in the background, so that the first
            # readers find them judged (a restart with a long history pays it here, one
            # rollout at a time, not in one request).
            self._warmed = True
            for rollout_id in self._coordinator.fleet.rollout_ids():
                if rollout_id not in self._rollouts:
                    self._want(rollout_id)
            self._want(_LEVELS)

    def close(self) -> None:
        """Stop judging in the background."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # ------------------------------------------------------------------ reads

    def now(self) -> datetime:
        return self._coordinator.now()

    async def prepare(self, budget: Budget | None = None) -> None:
        """Make every rollout's judgment and the desired levels servable (judging what is
        missing or too stale, one at a time, the loop free between two), so that the
        synchronous reads (:meth:`fleet`, the metrics) judge nothing themselves."""
        budget = Budget() if budget is None else budget
        self.check_compaction()
        for rollout_id in self._coordinator.fleet.rollout_ids():
            await self.overview(rollout_id, budget=budget, checked=True)
        await self.levels(budget)

    def fleet(self) -> FleetSummary:
        """Counts of the fleet: O(rollouts + versions + log workers), from the cached
        judgments as they are (await :meth:`prepare` first)."""
        now = self.now()
        phases: collections.Counter[RolloutPhase] = collections.Counter()
        oldest: datetime | None = None
        summarized = 0
        for rollout_id in self._coordinator.fleet.rollout_ids():
            overview = self.overview_cached(rollout_id)
            phases[overview.phase] += 1
            summarized += overview.details_dropped
            if not overview.settled and (oldest is None or overview.as_of < oldest):
                oldest = overview.as_of
        levels = self._levels.value if self._levels is not None else None
        return FleetSummary(
            as_of=now,
            workers=self.workers.summary(now, levels),
            rollouts=RolloutsSummary(
                total=sum(phases.values()),
                active=phases[RolloutPhase.PENDING] + phases[RolloutPhase.PROGRESSING],
                by_phase={p: phases[p] for p in RolloutPhase},
                summarized=summarized,
                oldest_as_of=oldest,
            ),
        )

    def overview_cached(self, rollout_id: str) -> RolloutOverview:
        """The rollout's overview as cached (judged now if it never was); a stale one is
        judged again in the background. Raises KeyError for an unknown rollout."""
        held = self._pick(self._rollouts, rollout_id, Want.CACHED, Budget(0.0))
        return self._judge(rollout_id)[0] if held is None else self._shown(held)

    async def overview(
        self,
        rollout_id: str,
        *,
        want: Want = Want.BOUNDED,
        budget: Budget | None = None,
        checked: bool = False,
    ) -> RolloutOverview:
        """The rollout's overview, as current as ``want``. Raises KeyError when unknown."""
        if not checked:
            self.check_compaction()
        budget = Budget() if budget is None else budget
        held = self._pick(self._rollouts, rollout_id, want, budget)
        if held is not None:
            return self._shown(held)
        await asyncio.sleep(self._turn(self._rollouts.get(rollout_id)))
        held = self._pick(self._rollouts, rollout_id, want, budget)
        if held is not None:
            return self._shown(held)
        return self._judge(rollout_id, budget=budget)[0]

    async def status(
        self, rollout_id: str, *, want: Want = Want.FRESH, workers_limit: int | None = None
    ) -> RolloutStatus:
        """The rollout's full status (every worker), as current as ``want``; judging it
        again waits for its turn (:meth:`_turn`). Raises KeyError when unknown.

        ``workers_limit``: ``workers`` lists only the first ``workers_limit`` expected workers
        by id, and the next one when there are more (what tells GET /rollouts/{id} to link to
        the rest); ``unexpected`` lists them all. A rollout pinned to worker ids is then judged
        in counts and for those workers only (:meth:`workers_page`); any other in full."""
        self.check_compaction()
        if workers_limit is not None:
            page = await self._page_of(rollout_id, want)
            if page is not None:
                first = page.expected(None, workers_limit + 1)
                return page.status.model_copy(
                    update={
                        "workers": tuple(self._details(page, first, expected=True)),
                        "unexpected": tuple(self._details(page, page.unexpected(), expected=False)),
                    }
                )
        budget = Budget()
        held = self._pick(self._full, rollout_id, want, budget)
        if held is None:
            await asyncio.sleep(self._turn(self._full.get(rollout_id)))
            held = self._pick(self._full, rollout_id, want, budget)
        if held is None:
            return self._judge(rollout_id, full=True)[1]
        self._full.move_to_end(rollout_id)
        return self._shown(held)

    async def workers_page(
        self,
        rollout_id: str,
        *,
        after: str | None = None,
        limit: int,
        states: set[WorkerState] | None = None,
        codes: set[str] | None = None,
        unexpected: bool | None = None,
        want: Want = Want.BOUNDED,
    ) -> tuple[list[tuple[WorkerDetail, bool]], bool]:
        """A page of the rollout's workers as GET /rollouts/{id}/workers lists them: expected
        and unexpected ones (flagged True) by id, those in ``states``, with an error code in
        ``codes`` and flagged ``unexpected`` (None: any), the first ``limit`` after the id
        ``after``; and whether more follow. Raises KeyError when the rollout is unknown.

        A rollout pinned to worker ids is judged for the page only: its judgment in counts (as
        current as ``want``) says when it ended, the instant its workers' states are shown at,
        and each listed worker is judged at that judgment's ``as_of`` (on evidence at least as
        new as the counts'); a filter by state or code judges the workers it passes over too,
        :data:`PAGE_CHUNK` at a time with the loop free between two. Any other rollout is
        paged from its full status."""
        self.check_compaction()

        def keep(detail: WorkerDetail) -> bool:
            return (states is None or detail.state in states) and (
                codes is None or (detail.error is not None and detail.error.code in codes)
            )

        page = await self._page_of(rollout_id, want)
        if page is None:
            status = await self.status(rollout_id, want=want)
            rows = _rows(status)
            start = 0 if after is None else bisect.bisect_right(rows, after, key=_row_id)
            out: list[tuple[WorkerDetail, bool]] = []
            for detail, flagged in itertools.islice(rows, start, None):
                if (unexpected is None or flagged is unexpected) and keep(detail):
                    if len(out) == limit:
                        return out, True
                    out.append((detail, flagged))
            return out, False
        lists: list[Iterator[tuple[str, bool]]] = []
        if unexpected is not True:
            lists.append((w, False) for w in page.expected(after, None))
        if unexpected is not False:
            extra = page.unexpected()
            start = 0 if after is None else bisect.bisect_right(extra, after)
            lists.append((w, True) for w in itertools.islice(extra, start, None))
        filtered = states is not None or codes is not None
        out = []
        for looked, (worker_id, flagged) in enumerate(heapq.merge(*lists), 1):
            if not filtered and len(out) == limit:
                return out, True
            (detail,) = self._details(page, [worker_id], expected=not flagged)
            if keep(detail):
                if len(out) == limit:
                    return out, True
                out.append((detail, flagged))
            if filtered and looked % PAGE_CHUNK == 0:
                await asyncio.sleep(0)  # the loop free between two chunks
        return out, False

    async def _page_of(self, rollout_id: str, want: Want) -> _Pinned | None:
        """What a page of a rollout pinned to worker ids is judged against (its judgment in
        counts, as current as ``want``); None for any other (judge it in full). Raises
        KeyError when the rollout is unknown."""
        await self.overview(rollout_id, want=want, checked=True)
        held = self._rollouts[rollout_id]
        bare = held.bare
        fleet = self._coordinator.fleet
        if bare is None or bare.details_dropped:
            return None
        try:
            command = fleet.command(rollout_id)
        except KeyError:  # summarized since, or known from NACKs only (small)
            return None
        ids = command.selector.worker_ids
        if not ids or command.command_id != bare.command_id:
            return None
        key = (rollout_id, command.command_id)
        pinned = self._pinned_ids.get(key)
        if pinned is None:
            pinned = self._pinned_ids[key] = (sorted(set(ids)), frozenset(ids))
            while len(self._pinned_ids) > 2 * self._keep_full:
                self._pinned_ids.popitem(last=False)
        self._pinned_ids.move_to_end(key)
        shown = self._shown(held)
        status = (
            bare if shown.as_of == bare.as_of else bare.model_copy(update={"as_of": shown.as_of})
        )
        return _Pinned(command, _ledger(fleet, command), *pinned, status, held.as_of)

    def _details(
        self, page: _Pinned, worker_ids: list[str], *, expected: bool
    ) -> list[WorkerDetail]:
        self.judged_workers += len(worker_ids)
        with collector_paused():  # a collection now would scan the whole heap (see _judge)
            return details(
                page.command,
                page.ledger,
                self._coordinator.fleet.registry,
                worker_ids,
                now=page.judged_at,
                cut=page.status.finished_at,
                expected=expected,
            )

    async def levels(self, budget: Budget | None = None) -> Levels:
        """Desired versions of every worker, at most ``max_stale_s`` old."""
        budget = Budget() if budget is None else budget
        held = self._levels
        if held is not None and self._servable(held, _LEVELS, Want.BOUNDED, budget):
            return held.value
        await asyncio.sleep(self._turn(held))
        held = self._levels  # the background task may have judged them meanwhile
        if held is not None and self._servable(held, _LEVELS, Want.BOUNDED, budget):
            return held.value
        return self._judge_levels(budget)

    def levels_cached(self) -> Levels:
        """The desired levels as cached (judged now if they never were)."""
        held = self._levels
        if held is None or not self._servable(held, _LEVELS, Want.CACHED, Budget(0.0)):
            return self._judge_levels(Budget(0.0))
        return held.value

    def check_compaction(self) -> None:
        """Rollouts summarized by ``Fleet.compact`` since last asked: their judgments are dirty."""
        fleet = self._coordinator.fleet
        compacted = fleet.stats().compacted
        if compacted == self._compacted:
            return
        self._compacted = compacted
        for cache in (self._rollouts, self._full):
            for rollout_id, entry in cache.items():
                if entry.value.details_dropped:
                    continue
                try:
                    fleet.command(rollout_id)
                except KeyError:  # summarized (or known only from NACKs: judged again, cheap)
                    entry.dirty = True

    # ------------------------------------------------------------------ internals

    def _fresh(self, entry: _Entry[Any]) -> bool:
        if entry.dirty:
            return False
        return entry.settled or self.now() - entry.as_of < self._max_age

    def _pick(
        self, cache: dict[str, _Entry[J]], rollout_id: str, want: Want, budget: Budget
    ) -> _Entry[J] | None:
        """The cached entry to serve, or None: judge it now."""
        held = cache.get(rollout_id)
        if held is None or not self._servable(held, rollout_id, want, budget):
            return None
        return held

    def _servable(self, held: _Entry[Any], key: str, want: Want, budget: Budget) -> bool:
        """Whether to serve ``held`` as it is (else the reader judges it now). Stale, it is
        served when judging it again costs more than the reader's budget, and it was read
        lately (the background task keeps it judged) or is younger than ``max_stale_s``."""
        clock = time.monotonic()
        hot = clock - held.read < KEEP_WARM_S
        held.read = clock
        if self._fresh(held):
            return True
        if want is Want.FRESH or held.cost <= budget.left:
            return False
        self._want(key)
        return want is Want.CACHED or hot or self.now() - held.as_of < self._max_stale

    def _shown(self, entry: _Entry[J]) -> J:
        """A settled judgment holds at any later instant: shown as of now."""
        if entry.settled and not entry.dirty:
            return entry.value.model_copy(update={"as_of": self.now()})
        return entry.value

    def _judge(
        self,
        rollout_id: str,
        *,
        full: bool = False,
        budget: Budget | None = None,
        reader: bool = True,
    ) -> tuple[RolloutOverview, RolloutStatus]:
        """Judge the rollout now; ``reader``: for a reader (else for the background task).
        The status returned has its per-worker lists only when ``full`` (or when its full status
        is kept): an overview is judged in counts (``Fleet.tally``)."""
        started = time.monotonic()
        current = self._coordinator.judge_time()
        now = self.now() if current is None else current
        fleet = self._coordinator.fleet
        full = full or rollout_id in self._full
        with collector_paused():  # no cycles made; a collection now would scan the whole heap
            if full:
                status = fleet.status(rollout_id, now)
                counted = Tally.of(status)
                self.judged_workers += len(status.workers) + len(status.unexpected)
            else:  # in counts: no detail per worker made
                counted = fleet.tally(rollout_id, now)
                status = counted.status
            overview = RolloutOverview.of_tally(counted)
        if current is not None:  # judged at an instant known current: compaction may trust it
            fleet.note_ended(status)
        judged = time.monotonic()
        self.judgments += 1
        cost = judged - started
        if budget is not None:
            budget.left -= cost
        held = self._rollouts.get(rollout_id)
        read = judged if reader else (0.0 if held is None else held.read)
        self._rollouts[rollout_id] = _Entry(
            overview, now, cost, judged, overview.settled, read=read, bare=counted.status
        )
        if full:
            self._full[rollout_id] = _Entry(status, now, cost, judged, overview.settled, read=read)
            self._full.move_to_end(rollout_id)
            while len(self._full) > self._keep_full:
                self._full.popitem(last=False)
        self._wanted.pop(rollout_id, None)
        return overview, status

    def _judge_levels(self, budget: Budget, *, reader: bool = True) -> Levels:
        coordinator = self._coordinator
        started = time.monotonic()
        now = self.now()
        registry = coordinator.fleet.registry
        desired: dict[str, Desire] = {}
        held = self._levels
        with collector_paused():
            pinned = self._desired_of_pinned(now)
            judged_targets = targets_status(coordinator.control, coordinator.fleet, now)
            if (
                pinned is not None
                and not judged_targets
                and held is not None
                and not held.value.targets
                and pinned == self._pinned_desired
            ):  # what the rollouts desire did not change: as the index already knows it
                desired = held.value.desired
            elif pinned is not None:
                for worker_id, (version, rollout_id, _) in pinned.items():
                    desired[worker_id] = Desire(version, rollout_id)
            else:  # a reload rollout chooses its workers by labels: judged in full
                for level in coordinator.fleet.worker_levels(now):
                    desired[level.worker_id] = Desire(
                        level.desired_version, level.desired_rollout_id
                    )
        self._pinned_desired = pinned
        targets: dict[str, dict[Alignment, int]] = {}
        for target in judged_targets:
            counts = dict.fromkeys(Alignment, 0)
            for member in target.members:
                counts[member.alignment] += 1
                if member.alignment is not Alignment.CONFLICT:
                    desired[member.worker_id] = Desire(
                        member.desired_version,
                        None,
                        target.name,
                        member.alignment is Alignment.IN_SYNC,
                    )
            targets[target.name] = counts
        never_seen = sorted(w for w in desired if w not in registry)
        levels = Levels(now, desired, never_seen, targets)
        if held is None or desired is not held.value.desired:
            self.workers.set_desired(desired)
        # Without targets, what workers should run follows from the rollouts alone: settled
        # once they all are (acks and commands make it dirty again).
        fleet = coordinator.fleet
        rollouts = fleet.rollout_ids()
        settled = not targets and all(
            (e := self._rollouts.get(r)) is not None and e.settled and not e.dirty for r in rollouts
        )
        judged = time.monotonic()
        self.judgments += 1
        budget.left -= judged - started
        read = judged if reader or self._levels is None else self._levels.read
        self._levels = _Entry(levels, now, judged - started, judged, settled, read=read)
        self._wanted.pop(_LEVELS, None)
        return levels

    def _desired_of_pinned(self, now: datetime) -> dict[str, tuple[str, str, datetime]] | None:
        """worker id -> (version, rollout id, issued_at) desired for it at ``now``, as
        ``Fleet.worker_levels`` says (the latest reload rollout that expects it and is pending,
        progressing or succeeded), without a Track per worker or a level per known worker:
        every reload rollout held in full must be pinned to worker ids (it expects exactly
        those), else None (ask ``Fleet.worker_levels``). Its phase: a judgment of it that found
        it ended (an ended rollout stays ended), else its acks alone when they decide it
        (``settled_end``, ``unended_by_acks``: no stall, not expired, not aborted), else it is
        judged in counts."""
        fleet = self._coordinator.fleet
        state = fleet.fold_state()
        commands = [fleet.command(r) for r in state.commands]
        # A dry run changes nothing: it desires no version (as Fleet.worker_levels says).
        reloads = [c for c in commands if isinstance(c.spec, ReloadWeightsSpec) and not c.dry_run]
        if any(c.selector.worker_ids is None for c in reloads):
            return None
        deadline = timedelta(seconds=fleet.progress_deadline_s)
        desired: dict[str, tuple[str, str, datetime]] = {}
        for command in sorted(reloads, key=lambda c: (c.issued_at, c.rollout_id), reverse=True):
            ids = command.selector.worker_ids or ()
            if len(desired) >= len(ids) and all(w in desired for w in ids):
                continue  # a newer rollout already decides for all of its workers
            rid = command.rollout_id
            held = self._rollouts.get(rid)
            phase: RolloutPhase | None = None
            if (
                held is not None
                and held.value.terminal
                and held.value.command_id == command.command_id
                and fleet.ended(rid) is not None  # judged ended at an instant known current
            ):
                phase = held.value.phase  # an ended rollout stays ended
            else:
                ledger = state.ledgers.get((rid, command.command_id))
                abort = state.aborts.get(rid)
                end = settled_end(command, ledger, now=now, progress_deadline=deadline, abort=abort)
                if end is not None:
                    phase = end.phase
                elif not unended_by_acks(
                    command, ledger, now=now, progress_deadline=deadline, abort=abort
                ):
                    phase = fleet.tally(rid, now).status.phase
            if phase is None or phase in _DESIRING:  # None: not ended, pending or progressing
                version = command.spec.version  # type: ignore[union-attr]
                for worker_id in ids:
                    desired.setdefault(worker_id, (version, rid, command.issued_at))
        for worker_id, (issued, rid, version) in state.summary_desired.items():
            mine = desired.get(worker_id)
            if mine is None or (issued, rid) > (mine[2], mine[1]):
                desired[worker_id] = (version, rid, issued)
        return desired

    def _turn(self, held: _Entry[Any] | None) -> float:
        """Seconds until ``held`` may be judged again: at most once per four times what
        judging it cost, so one that changes all the time takes at most a fifth of the
        loop, however many readers ask."""
        if held is None:
            return 0.0
        return max(0.0, held.judged + 4 * held.cost - time.monotonic())

    def _want(self, key: str) -> None:
        """Judge ``key`` again in the background (a rollout id, or :data:`_LEVELS`)."""
        self._wanted[key] = None
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):  # no running loop: a synchronous caller
                self._task = asyncio.get_running_loop().create_task(
                    self._refresh(), name="summaries-refresh"
                )

    def _entry(self, key: str) -> _Entry[Any] | None:
        return self._levels if key == _LEVELS else self._rollouts.get(key)

    def _next(self) -> str | None:
        """What to judge next: a key asked for, else the stalest entry read lately that is
        not fresh; None when there is none."""
        while self._wanted:
            key = next(iter(self._wanted))
            held = self._entry(key)
            if held is None or not self._fresh(held):
                return key
            del self._wanted[key]
        clock = time.monotonic()
        stalest: tuple[datetime, str] | None = None
        keyed: list[tuple[str, _Entry[Any] | None]] = [(_LEVELS, self._levels)]
        for key, entry in itertools.chain(keyed, self._rollouts.items()):
            if entry is None or clock - entry.read >= KEEP_WARM_S or self._fresh(entry):
                continue
            if stalest is None or entry.as_of < stalest[0]:
                stalest = (entry.as_of, key)
        return None if stalest is None else stalest[1]

    def _warm(self) -> bool:
        """Whether an entry read lately can go stale (the background task has work ahead)."""
        clock = time.monotonic()
        entries = itertools.chain([self._levels], self._rollouts.values())
        return any(
            e is not None and clock - e.read < KEEP_WARM_S and (e.dirty or not e.settled)
            for e in entries
        )

    async def _refresh(self) -> None:
        """Judge what readers asked for, then keep what they read lately judged, at most a
        quarter of the loop's time; ends when nothing read lately can go stale."""
        while True:
            key = self._next()
            if key is None:
                if not self._wanted and not self._warm():
                    return
                await asyncio.sleep(self._max_age.total_seconds() / 4)
                continue
            self._wanted.pop(key, None)
            started = time.monotonic()
            try:
                if key == _LEVELS:
                    self._judge_levels(Budget(), reader=False)
                elif key in self._coordinator.fleet:
                    self._judge(key, reader=False)
                else:
                    self._rollouts.pop(key, None)
                    self._full.pop(key, None)
            except Exception:  # a reader judging it itself meets the same error
                log.exception("judging %s in the background failed", key)
            await asyncio.sleep(IDLE_PER_COST * (time.monotonic() - started))


@dataclass(frozen=True, slots=True)
class _Pinned:
    """A rollout pinned to worker ids, as a page of its workers is judged: its expected
    workers are exactly those ids, whatever the heartbeats say."""

    command: Command
    ledger: CommandLedger | None
    #: The pinned ids, sorted, and as a set.
    ids: list[str]
    base: frozenset[str]
    #: Its status judged in counts (no per-worker lists), as shown.
    status: RolloutStatus
    #: The instant it was judged at: each worker's detail is judged at it too.
    judged_at: datetime

    def expected(self, after: str | None, limit: int | None) -> list[str]:
        """Expected workers by id after ``after``, at most ``limit`` of them."""
        start = 0 if after is None else bisect.bisect_right(self.ids, after)
        return self.ids[start : None if limit is None else start + limit]

    def unexpected(self) -> list[str]:
        """Workers that acked without being pinned, by id."""
        if self.ledger is None:
            return []
        base = self.base
        return sorted(w for w in self.ledger.workers if w not in base)


def _ledger(fleet: Fleet, command: Command) -> CommandLedger | None:
    """The command's ledger of acks (the fleet's own: read it, never change it)."""
    return fleet.fold_state().ledgers.get((command.rollout_id, command.command_id))


def _row_id(row: tuple[WorkerDetail, bool]) -> str:
    return row[0].worker_id


def _rows(status: RolloutStatus) -> list[tuple[WorkerDetail, bool]]:
    """A rollout's workers, expected and unexpected (flagged True), sorted by id."""
    rows = [(w, False) for w in status.workers]
    if status.unexpected:
        rows.extend((w, True) for w in status.unexpected)
        rows.sort(key=_row_id)
    return rows


def _any_in(ids: Iterable[str], sorted_ids: list[str]) -> bool:
    """Whether any of ``ids`` is in ``sorted_ids`` (O(len(ids) log n))."""
    if not sorted_ids:
        return False
    for worker_id in ids:
        i = bisect.bisect_left(sorted_ids, worker_id)
        if i < len(sorted_ids) and sorted_ids[i] == worker_id:
            return True
    return False


def in_sync_with(want: Desire, hb: Heartbeat | None) -> bool:
    """Whether a worker whose latest heartbeat is ``hb`` runs what ``want`` says."""
    if want.in_sync is not None:
        return want.in_sync
    degraded = hb is not None and hb.degraded is not None
    reported = None if hb is None else hb.weights_version
    return not degraded and (want.version is None or reported == want.version)
