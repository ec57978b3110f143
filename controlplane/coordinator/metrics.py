"""Prometheus metrics of one coordinator: counters fed by follower batches, gauges read at scrape time.

Each instance owns its CollectorRegistry (never the process-global one). No I/O, no HTTP: api.py
serves the text. Counters count what this process folded: the whole log at start, or only its tail
after a snapshot restore. The rollout duration histogram observes each ended rollout the fold
holds once per process (a restart observes them again; dry runs never).
Gauges come from :class:`~controlplane.coordinator.summary.Summaries` (cached judgments and
counts kept as heartbeats arrive): a scrape costs O(rollouts + targets), never O(workers x
rollouts) plus O(workers of targets) for the per-target version counts; await
``summaries.prepare()`` before :meth:`CoordinatorMetrics.render` so that it judges nothing itself.

No ``_created`` series: creating :class:`CoordinatorMetrics` turns them off for the process
(``prometheus_client.disable_created_metrics``), one per label set of every counter and histogram
otherwise, which nobody graphs.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Final, NamedTuple

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.coordinator.follower import Batch
from controlplane.coordinator.summary import Desire, GroupCount, Summaries
from controlplane.rollout.desired import Alignment
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.ack_codec import AckLike
from controlplane.wire.control import ControlPhase
from controlplane.wire.errors import LocalCode, WireCode
from controlplane.wire.protocol import Command

if TYPE_CHECKING:
    from controlplane.coordinator.service import Coordinator

#: Seconds from a command's ``issued_at`` to a worker's terminal ack: reloads take seconds to minutes.
LATENCY_BUCKETS: Final = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)

#: Seconds from a rollout's issue to its verdict: a canary rollout with bakes takes hours
#: (the latency buckets from 30 s to 30 min, with seconds below and hours above).
DURATION_BUCKETS: Final = (1.0, 5.0, 10.0, *LATENCY_BUCKETS[8:], 3600.0, 7200.0, 21600.0, 86400.0)

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST


class Sample(NamedTuple):
    """One command-to-terminal-ack latency: the command's kind, the ack's state, seconds."""

    kind: str
    state: str
    seconds: float


#: Commands whose latency pairing is remembered (and commands with held acks): the oldest
#: noted are forgotten beyond this (a redelivered ack for one may then be held again, never
#: sampled twice unless its command is seen again).
MAX_TRACKED_COMMANDS: Final = 4096

#: Label value of ack error codes that are not ours (a :class:`~controlplane.wire.errors.WireCode`
#: or :class:`~controlplane.wire.errors.LocalCode` value): the code is worker input, and every
#: distinct label value is a new time series.
OTHER_CODE: Final = "OTHER"
_KNOWN_CODES: Final = frozenset(code.value for code in (*WireCode, *LocalCode))


def code_label(code: str | None) -> str:
    """The ``code`` label of an ack: "" without an error, the code when it is one of ours."""
    if code is None:
        return ""
    return code if code in _KNOWN_CODES else OTHER_CODE


class AckLatency:
    """Pairs commands with their workers' terminal acks, whatever order they arrive in.

    A sample is produced once per (command id, worker), when both the command and a terminal ack
    are known: on a replay acks may come before their command (they are held until it does).
    Of several terminal acks held for one worker the earliest sent counts, as in the status rules;
    after a sample, later ones (redelivery) are ignored. Pure: no clock, no I/O.
    Memory is bounded: the last ``max_commands`` commands noted, and held acks for at most as
    many unknown command ids (the oldest forgotten first).
    """

    def __init__(self, *, max_commands: int = MAX_TRACKED_COMMANDS) -> None:
        self._max = max(1, max_commands)
        self._issued: dict[str, tuple[datetime, str]] = {}
        self._held: dict[str, dict[str, AckLike]] = {}
        self._sampled: dict[str, set[str]] = {}

    def command(self, command: Command) -> list[Sample]:
        """Note a command; returns the samples of the terminal acks that were waiting for it."""
        if command.command_id in self._issued:  # a reused command id: the first one seen counts
            return []
        self._issued[command.command_id] = (command.issued_at, command.kind.value)
        while len(self._issued) > self._max:  # dicts keep insertion order: the oldest first
            oldest = next(iter(self._issued))
            del self._issued[oldest]
            self._sampled.pop(oldest, None)
        held = self._held.pop(command.command_id, {})
        return [self._sample(ack) for _, ack in sorted(held.items())]

    def ack(self, ack: AckLike) -> list[Sample]:
        """Note an ack; returns its sample when it is the first terminal one of a known command."""
        if not ack.state.terminal or ack.worker_id in self._sampled.get(ack.command_id, ()):
            return []
        if ack.command_id not in self._issued:
            held = self._held.get(ack.command_id)
            if held is None:
                held = self._held[ack.command_id] = {}
                while len(self._held) > self._max:
                    del self._held[next(iter(self._held))]
            first = held.get(ack.worker_id)
            if first is None or ack.sent_at < first.sent_at:
                held[ack.worker_id] = ack
            return []
        return [self._sample(ack)]

    @property
    def tracked(self) -> int:
        """Commands remembered plus command ids with held acks (bounded)."""
        return len(self._issued) + len(self._held)

    @property
    def waiting(self) -> int:
        """Terminal acks held because their command has not been seen yet."""
        return sum(len(held) for held in self._held.values())

    def _sample(self, ack: AckLike) -> Sample:
        issued_at, kind = self._issued[ack.command_id]
        self._sampled.setdefault(ack.command_id, set()).add(ack.worker_id)
        seconds = max(0.0, (ack.sent_at - issued_at).total_seconds())  # clock skew: never negative
        return Sample(kind, ack.state.value, seconds)


class CoordinatorMetrics:
    """The metrics of one coordinator. Create it before the coordinator starts folding the log,
    or the counters miss what was folded before (the scrape-time gauges never do).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        registry: CollectorRegistry | None = None,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
        summaries: Summaries | None = None,
    ) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide: see the docstring
        self.registry = registry if registry is not None else CollectorRegistry()
        self._coordinator = coordinator
        self.summaries = summaries if summaries is not None else Summaries(coordinator)
        self.latency = AckLatency()
        self._messages = Counter(
            "controlplane_messages",
            "Decoded messages folded into status, by kind (command, ack, heartbeat).",
            ["kind"],
            registry=self.registry,
        )
        self._acks = Counter(
            "controlplane_acks",
            "Acks folded, by state and error code (empty when the ack carries no error; "
            f"{OTHER_CODE} for a code that is not one of ours).",
            ["state", "code"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "controlplane_command_ack_latency_seconds",
            "Seconds from a command's issued_at to each worker's first terminal ack (its sent_at).",
            ["kind", "state"],
            buckets=buckets,
            registry=self.registry,
        )
        self._duration = Histogram(
            "controlplane_rollout_duration_seconds",
            "Seconds from a rollout's issue to its verdict, by type (command: one command, each "
            "batch of a progressive rollout included, dry runs excluded: they apply nothing; "
            "progressive: a target's rollout, issued to ended) and final phase. Each ended "
            "rollout the coordinator's fold holds is observed once per process: a restart "
            "observes them again from the replay or the restored snapshot (a counter reset to "
            "Prometheus: use rate() or increase()).",
            ["type", "phase"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        #: Ended rollouts already observed in the duration histogram, by type (pruned to the
        #: rollouts the fold still knows: bounded as the fold is).
        self._timed: dict[str, set[str]] = {"command": set(), "progressive": set()}
        self.registry.register(_FleetCollector(coordinator, self.summaries, self.latency))
        coordinator.follower.listeners.append(self.on_batch)

    def on_batch(self, batch: Batch) -> None:
        """A follower listener: count what one fetch folded."""
        for kind, n in (
            ("command", len(batch.commands)),
            ("ack", len(batch.acks)),
            ("heartbeat", len(batch.heartbeats)),
        ):
            if n:
                self._messages.labels(kind).inc(n)
        samples: list[Sample] = []
        # Commands first: an ack in the same batch may be for a command in it.
        for command in batch.commands:
            samples.extend(self.latency.command(command))
        # One increment per (state, code) of the batch, not per ack: a batch of 30,000 acks
        # costs 30,000 label lookups and locked increments otherwise (~40 ms).
        counted: collections.Counter[tuple[str, str | None]] = collections.Counter()
        for ack in batch.acks:
            error = ack.error
            counted[ack.state.value, error.code if error else None] += 1
            samples.extend(self.latency.ack(ack))
        for (state, code), n in counted.items():
            self._acks.labels(state, code_label(code)).inc(n)
        for sample in samples:
            self._latency.labels(sample.kind, sample.state).observe(sample.seconds)

    def observe_durations(self) -> None:
        """Observe the duration of each rollout seen ended for the first time (issue to verdict),
        from the cached judgments (a command rollout) and the control topic's fold (a
        progressive one). :meth:`render` calls it; nothing while the coordinator is not caught up."""
        coordinator = self._coordinator
        now = coordinator.judge_time()
        if now is None:
            return
        timed = self._timed["command"]
        known = coordinator.fleet.rollout_ids()
        for rollout_id in known:
            if rollout_id in timed:
                continue
            overview = self.summaries.overview_cached(rollout_id)
            if overview.terminal and overview.duration_s is not None:
                timed.add(rollout_id)
                if self._dry_run(rollout_id, now):
                    continue  # checked, applied nowhere: not a rollout's duration
                seconds = max(0.0, overview.duration_s)
                self._duration.labels("command", overview.phase.value).observe(seconds)
        timed.intersection_update(known)
        timed = self._timed["progressive"]
        rollouts = coordinator.control.rollouts()
        for rollout in rollouts:
            state = rollout.state
            if rollout.rollout_id in timed or state is None or state.ended_at is None:
                continue
            if not state.phase.terminal:
                continue
            timed.add(rollout.rollout_id)
            seconds = max(0.0, (state.ended_at - rollout.spec.issued_at).total_seconds())
            self._duration.labels("progressive", state.phase.value).observe(seconds)
        timed.intersection_update(r.rollout_id for r in rollouts)

    def _dry_run(self, rollout_id: str, now: datetime) -> bool:
        """Whether the rollout's command is a dry run (``Command.dry_run``): read from its command,
        or from its summary once summarized (never a judgment of its workers)."""
        fleet = self._coordinator.fleet
        try:
            return bool(fleet.command(rollout_id).dry_run)
        except KeyError:  # summarized, or only NACKs: the stored status says
            try:
                return fleet.status(rollout_id, now).dry_run
            except KeyError:
                return False

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (content type :data:`CONTENT_TYPE`)."""
        self.observe_durations()
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    """Gauges computed from the Fleet at scrape time, plus the follower's own record counts."""

    def __init__(self, coordinator: Coordinator, summaries: Summaries, latency: AckLatency) -> None:
        self._coordinator = coordinator
        self._summaries = summaries
        self._latency = latency

    def _snapshots(self) -> Iterator[Metric]:
        info = self._coordinator.snapshots.info
        restored = GaugeMetricFamily(
            "controlplane_snapshot_restored",
            "1 when this coordinator's start restored its fold from a snapshot (and read only "
            "the log after it), 0 when it replayed the log in full.",
        )
        restored.add_metric([], 1.0 if info.started_from == "snapshot" else 0.0)
        yield restored
        if info.age_s is not None:
            age = GaugeMetricFamily(
                "controlplane_snapshot_restored_age_seconds",
                "How old the snapshot the start restored from was.",
            )
            age.add_metric([], info.age_s)
            yield age
        written = CounterMetricFamily(
            "controlplane_snapshots_written", "Snapshots of the fold this coordinator wrote."
        )
        written.add_metric([], info.written)
        yield written
        if info.last_written_at is not None:
            last = GaugeMetricFamily(
                "controlplane_snapshot_last_written_timestamp_seconds",
                "When this coordinator last wrote a snapshot (Unix seconds).",
            )
            last.add_metric([], info.last_written_at.timestamp())
            yield last

    def collect(self) -> Iterator[Metric]:
        coordinator = self._coordinator
        fleet, follower = coordinator.fleet, coordinator.follower
        now = coordinator.judge_time()

        ready = GaugeMetricFamily(
            "controlplane_ready", "1 once the coordinator has caught up with the log."
        )
        ready.add_metric([], 1.0 if coordinator.ready else 0.0)
        yield ready

        records = CounterMetricFamily(
            "controlplane_records_folded", "Kafka records read from the three topics."
        )
        records.add_metric([], follower.records)
        yield records
        undecodable = CounterMetricFamily(
            "controlplane_records_undecodable", "Records skipped because they did not decode."
        )
        undecodable.add_metric([], follower.undecodable)
        yield undecodable

        yield from self._controller()
        yield from self._snapshots()
        if now is None:  # not caught up (or cut off from Kafka): no judgement to report
            return
        summaries = self._summaries
        levels = summaries.levels_cached()
        yield from self._targets(levels.targets)
        phases = collections.Counter(
            summaries.overview_cached(rollout_id).phase for rollout_id in fleet.rollout_ids()
        )
        rollouts = GaugeMetricFamily(
            "controlplane_rollouts", "Rollouts by phase.", labels=["phase"]
        )
        for phase in RolloutPhase:
            rollouts.add_metric([phase.value], phases[phase])
        yield rollouts

        workers = summaries.workers
        yield from self._versions(workers.summary(now, None).by_version)
        yield from self._target_versions(levels.desired, now)
        stats = fleet.stats()
        for name, text, value in (
            ("controlplane_workers", "Workers known from heartbeats.", len(workers)),
            (
                "controlplane_workers_alive",
                "Workers whose heartbeats prove them alive.",
                workers.alive(now),
            ),
            (
                "controlplane_workers_in_sync",
                "Workers reporting the weights version desired for them (a target's, for "
                "its workers), as last judged.",
                workers.in_sync,
            ),
            (
                "controlplane_workers_degraded",
                "Workers whose weights are a mix of two versions.",
                workers.degraded,
            ),
            (
                "controlplane_orphan_acks",
                "Acks whose command has not been seen.",
                stats.orphan_acks,
            ),
            (
                "controlplane_ack_latency_waiting",
                "Terminal acks held until their command is seen.",
                self._latency.waiting,
            ),
            (
                "controlplane_rollouts_summarized",
                "Ended rollouts beyond max_ended_rollouts, kept only as a final summary.",
                stats.compacted,
            ),
            (
                "controlplane_commands_unverified",
                "Commands the trust store did not verify, held (never a rollout: "
                "GET /api/v1/commands/unverified).",
                stats.unverified,
            ),
            (
                "controlplane_commands_unverified_dropped",
                "Unverified commands dropped beyond the newest max_unverified kept.",
                stats.unverified_dropped,
            ),
            (
                "controlplane_change_subscribers",
                "Open change-feed subscribers (server-sent event streams, waits).",
                coordinator.subscribers,
            ),
        ):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge

    def _controller(self) -> Iterator[Metric]:
        controller = self._coordinator.controller
        leading = GaugeMetricFamily(
            "controlplane_controller_leading",
            "1 while this coordinator is the elected controller and writes.",
        )
        leading.add_metric([], 1.0 if controller is not None and controller.leading else 0.0)
        yield leading
        if controller is None:
            return
        for name, text, value in (
            (
                "controlplane_controller_decisions",
                "Decisions this coordinator wrote as controller (one transaction each).",
                controller.decisions,
            ),
            (
                "controlplane_controller_commands",
                "Commands this coordinator published as controller.",
                controller.commands_published,
            ),
            (
                "controlplane_controller_fenced",
                "Times another coordinator fenced this one (CONTROLLER_FENCED).",
                controller.fenced,
            ),
        ):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], value)
            yield counter

    @staticmethod
    def _versions(by_version: dict[str, GroupCount]) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "controlplane_workers_by_version",
            'Live workers by the weights version their heartbeats report ("": none).',
            labels=["version"],
        )
        for version, count in by_version.items():
            if count.alive:
                gauge.add_metric([version], count.alive)
        yield gauge

    def _target_versions(self, desired: Mapping[str, Desire], now: datetime) -> Iterator[Metric]:
        """Live members of each target (as last judged; conflicts aside) by reported version."""
        registry = self._coordinator.fleet.registry
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for worker_id, want in desired.items():
            if want.target is None:
                continue
            hb = registry.latest(worker_id)
            if hb is not None and registry.is_alive(worker_id, now):
                counts[want.target, hb.weights_version or ""] += 1
        gauge = GaugeMetricFamily(
            "controlplane_target_workers_by_version",
            "Live workers of each target by the weights version their heartbeats report "
            '("": none), as last judged.',
            labels=["target", "version"],
        )
        for (target, version), n in sorted(counts.items()):
            gauge.add_metric([target, version], n)
        yield gauge

    def _targets(self, targets: dict[str, dict[Alignment, int]]) -> Iterator[Metric]:
        control = self._coordinator.control
        phases = collections.Counter(
            r.phase.value if r.phase is not None else "pending" for r in control.rollouts()
        )
        progressive = GaugeMetricFamily(
            "controlplane_progressive_rollouts", "Progressive rollouts by phase.", labels=["phase"]
        )
        for phase in ("pending", *(p.value for p in ControlPhase)):
            progressive.add_metric([phase], phases[phase])
        yield progressive
        workers = GaugeMetricFamily(
            "controlplane_target_workers",
            "Workers of each target by how they stand against its desired state (as last judged).",
            labels=["target", "alignment"],
        )
        for name, counts in targets.items():
            for alignment in Alignment:
                workers.add_metric([name, alignment.value], counts.get(alignment, 0))
        yield workers
