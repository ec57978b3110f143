"""Topic names, partition counts, configs, message keys and consumer group ids: all of them, here.

No I/O. ``kafka.admin.Admin.ensure_topics`` creates these or reports how existing ones differ.

Replication: ``Topics.replication_factor`` None means the cluster's ``default.replication.factor``
(``kafka.admin.Admin`` reads it from a broker and passes it to :meth:`Topics.resolved`), and
``min_insync_replicas`` None means :func:`default_min_insync_replicas` of that factor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

DEFAULT_PREFIX: Final = "fleet"
MINUTE_MS: Final = 60 * 1000
HOUR_MS: Final = 60 * MINUTE_MS
DAY_MS: Final = 24 * HOUR_MS
MIB: Final = 1024 * 1024

#: Topic configs that only say when segments roll and when the log cleaner may run: changing
#: them on a live topic changes no record a reader is given (compaction keeps each key's latest
#: either way), so ``topics ensure`` sets them in place on an existing topic that differs.
#: Anything else that differs (cleanup policy, retention, timestamp type, replication) is
#: reported for the operator to change.
TUNED_IN_PLACE: Final = frozenset(
    {
        "segment.ms",
        "segment.bytes",
        "min.cleanable.dirty.ratio",
        "delete.retention.ms",
        "min.compaction.lag.ms",
        "max.compaction.lag.ms",
    }
)


def default_min_insync_replicas(replication_factor: int) -> int:
    """``min.insync.replicas`` when none is set: RF-1 when RF >= 3, else 1.

    With RF 3 and min ISR 2, an acknowledged write (``acks=all``) is on two brokers, so losing
    any one broker loses nothing, and the topic stays writable while one broker is down. With
    RF 2, min ISR 2 would stop every write while either broker is down, so it is 1 (a write is
    then on one broker only while the other is out of the ISR); with RF 1 there is no choice.
    """
    if replication_factor < 1:
        raise ValueError(f"replication factor {replication_factor} < 1")
    return replication_factor - 1 if replication_factor >= 3 else 1


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    #: Topic-level configs we rely on; others are left to the cluster's defaults.
    config: dict[str, str] = field(default_factory=dict)
    #: Replicas per partition; None: the cluster's default (not resolved yet).
    replication_factor: int | None = None


@dataclass(frozen=True)
class Topics:
    """The three topics of one fleet. A prefix lets several fleets (or tests) share a cluster."""

    prefix: str = DEFAULT_PREFIX
    #: Replicas per partition; None: the cluster's ``default.replication.factor``.
    replication_factor: int | None = None
    #: ``min.insync.replicas`` of every topic; None: :func:`default_min_insync_replicas`.
    min_insync_replicas: int | None = None
    #: How long commands and acks are kept; the coordinator rebuilds status from them on start.
    retention_ms: int = 30 * DAY_MS
    #: The workers topic's active segment rolls after this long or this size, whichever comes
    #: first; only rolled segments are compacted (see :attr:`workers`).
    workers_segment_ms: int = MINUTE_MS
    workers_segment_bytes: int = 8 * MIB

    def resolved(self, cluster_default_replication_factor: int) -> Topics:
        """These topics with a concrete replication factor (the cluster's when none is set)."""
        if self.replication_factor is not None:
            return self
        return replace(self, replication_factor=cluster_default_replication_factor)

    @property
    def effective_min_insync_replicas(self) -> int | None:
        """The ``min.insync.replicas`` the topics get; None until the factor is known."""
        if self.min_insync_replicas is not None:
            return self.min_insync_replicas
        if self.replication_factor is None:
            return None
        return default_min_insync_replicas(self.replication_factor)

    def _durability(self, *, no_unclean_election: bool) -> dict[str, str]:
        config: dict[str, str] = {}
        min_isr = self.effective_min_insync_replicas
        if min_isr is not None:
            config["min.insync.replicas"] = str(min_isr)
        if no_unclean_election:
            # An out-of-sync replica never becomes leader: that would drop acknowledged
            # commands or acks (the cluster's default is false too; said here, and checked).
            config["unclean.leader.election.enable"] = "false"
        return config

    @property
    def commands(self) -> TopicSpec:
        # One partition: every worker sees every command in one total order.
        return TopicSpec(
            f"{self.prefix}.commands",
            1,
            {
                "cleanup.policy": "delete",
                "retention.ms": str(self.retention_ms),
                **self._durability(no_unclean_election=True),
            },
            self.replication_factor,
        )

    @property
    def acks(self) -> TopicSpec:
        # Keyed by worker id: one worker's acks stay in order on one partition.
        return TopicSpec(
            f"{self.prefix}.acks",
            6,
            {
                "cleanup.policy": "delete",
                "retention.ms": str(self.retention_ms),
                **self._durability(no_unclean_election=True),
            },
            self.replication_factor,
        )

    @property
    def workers(self) -> TopicSpec:
        """Compacted, keyed by worker id: the latest heartbeat of each worker survives, so a
        reader replays about one record per worker plus what the cleaner has not reached yet.

        The log cleaner never compacts the active segment, and checks for dirty logs every
        ``log.cleaner.backoff.ms`` (a broker setting, 15 s by default). So the segment rolls
        after :attr:`workers_segment_ms` (1 minute; Kafka 4.1 accepts 1 ms and up) or
        :attr:`workers_segment_bytes` (8 MiB; at least 1 MiB): 10,000 workers beating every
        3 s fill 8 MiB in a few seconds, instead of the 1 GiB default (hours of heartbeats,
        millions of records). ``min.cleanable.dirty.ratio`` 0.1: nearly every record of a
        rolled segment is superseded, so it is cleaned as soon as it is a tenth of the log.
        ``delete.retention.ms`` 1 hour: the tombstone of a worker gone for good is dropped an
        hour after its segment is cleaned (a reader must finish a replay within that to see
        it; the default is a day). ``min.compaction.lag.ms`` stays 0: a reader needs only each
        worker's latest heartbeat.

        LogAppendTime: each heartbeat carries the broker's clock when it was appended, which
        the readers judge liveness by (a worker's own clock may be off; the follower falls
        back to its own clock at the fetch on a topic without it)."""
        return TopicSpec(
            f"{self.prefix}.workers",
            1,
            {
                "cleanup.policy": "compact",
                "min.cleanable.dirty.ratio": "0.1",
                "segment.ms": str(self.workers_segment_ms),
                "segment.bytes": str(self.workers_segment_bytes),
                "delete.retention.ms": str(HOUR_MS),
                "message.timestamp.type": "LogAppendTime",
                **self._durability(no_unclean_election=False),
            },
            self.replication_factor,
        )

    @property
    def controller(self) -> TopicSpec:
        # The controller's election (its group's one partition: the member assigned it leads)
        # and, compacted by key, what the leader says of itself. docs/controller.md.
        return TopicSpec(
            f"{self.prefix}.controller",
            1,
            {
                "cleanup.policy": "compact",
                **self._durability(no_unclean_election=True),
            },
            self.replication_factor,
        )

    @property
    def snapshots(self) -> TopicSpec:
        """The coordinators' snapshots of their fold (docs/architecture.md, "Snapshots"):
        compacted, one partition; each snapshot is a few chunks of at most ~900 KB and a
        manifest, keyed so that compaction keeps every writer's latest. The active segment rolls
        every 10 minutes or 64 MiB and is cleaned at a dirty ratio of 0.1, so a starting
        coordinator reads about the latest snapshots, not every one ever written."""
        return TopicSpec(
            f"{self.prefix}.snapshots",
            1,
            {
                "cleanup.policy": "compact",
                "min.cleanable.dirty.ratio": "0.1",
                "segment.ms": str(10 * MINUTE_MS),
                "segment.bytes": str(64 * MIB),
                "delete.retention.ms": str(HOUR_MS),
                **self._durability(no_unclean_election=True),
            },
            self.replication_factor,
        )

    def snapshots_only(self) -> SnapshotTopic:
        """These topics' settings, ensuring only :attr:`snapshots` (see :class:`SnapshotTopic`)."""
        return SnapshotTopic(
            prefix=self.prefix,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
            retention_ms=self.retention_ms,
            workers_segment_ms=self.workers_segment_ms,
            workers_segment_bytes=self.workers_segment_bytes,
        )

    @property
    def controller_transactional_id(self) -> str:
        """The one ``transactional.id`` every controller writes with: each new leader's init
        fences the ones before (a per-host id would silently disable that)."""
        return f"{self.prefix}.controller"

    @property
    def controller_group(self) -> str:
        """The consumer group the controllers are elected in (never a worker's group)."""
        return f"{self.prefix}.controller"

    def all(self) -> list[TopicSpec]:
        """The three topics of the fleet's channels (commands, acks, heartbeats)."""
        return [self.commands, self.acks, self.workers]

    def ensured(self) -> list[TopicSpec]:
        """Every topic a fleet needs: :meth:`all` and the controller's."""
        return [*self.all(), self.controller]

    def worker_group(self, worker_id: str) -> str:
        """Each worker is its own consumer group on the commands topic (broadcast)."""
        return f"{self.prefix}.worker.{worker_id}"


@dataclass(frozen=True)
class SnapshotTopic(Topics):
    """The snapshots topic alone, for ``Admin.ensure_topics`` (which ensures :meth:`ensured`):
    ``topics ensure`` ensures it after the others. It is not in :meth:`Topics.ensured`, so a
    fleet whose topics were made without it still works (its coordinators replay in full)."""

    def ensured(self) -> list[TopicSpec]:
        return [self.snapshots]


def snapshot_key(kind: str, writer: str, *parts: str) -> bytes:
    """A key on the snapshots topic: ``kind/writer[/part...]`` in UTF-8."""
    return "/".join((kind, writer, *parts)).encode("utf-8")


def worker_key(worker_id: str) -> bytes:
    """Message key for acks and heartbeats."""
    return worker_id.encode("utf-8")


def command_key(rollout_id: str) -> bytes:
    return rollout_id.encode("utf-8")
