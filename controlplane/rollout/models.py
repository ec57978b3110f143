"""Rollout status as the HTTP API, dashboard and CLI see it: enums and frozen pydantic models.

Output only: built by ``rollout_status``, serialized to JSON, never parsed from the wire.
No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, JsonValue, computed_field

from controlplane.wire.exits import PHASE_EXITS
from controlplane.wire.protocol import AckError, CommandKind, Selector


class RolloutPhase(StrEnum):
    PENDING = "pending"
    PROGRESSING = "progressing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self not in (RolloutPhase.PENDING, RolloutPhase.PROGRESSING)

    @property
    def exit_code(self) -> int | None:
        """What ``controlplane ... --wait`` exits with: 0 succeeded, 1 failed or aborted, 2 timed
        out (``PHASE_EXITS``); None while the rollout runs."""
        code = PHASE_EXITS.get(self.value)
        return None if code is None else int(code)


class RolloutReason(StrEnum):
    """Why a rollout ended other than in success. Stable: CI scripts match on these."""

    NO_MATCHING_WORKERS = "NO_MATCHING_WORKERS"
    WORKERS_FAILED = "WORKERS_FAILED"
    #: No longer given (a lost worker is waited for until a deadline, see rollout.py); kept so
    #: that clients reading older statuses still parse them.
    WORKERS_LOST = "WORKERS_LOST"
    EXPIRED = "EXPIRED"
    #: No worker could read the command (refused by the schema): known only from the NACKs.
    COMMAND_REJECTED = "COMMAND_REJECTED"
    PROGRESS_DEADLINE_EXCEEDED = "PROGRESS_DEADLINE_EXCEEDED"
    ABORTED = "ABORTED"


class WorkerState(StrEnum):
    """One expected worker's state in one rollout. Ack states only move forward, left to right;
    ``lost`` (its heartbeats do not prove it alive) is provisional until the rollout ends: a
    worker that comes back is pending, accepted or running again."""

    PENDING = "pending"
    ACCEPTED = "accepted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        return self not in (WorkerState.PENDING, WorkerState.ACCEPTED, WorkerState.RUNNING)


class AnomalyCode(StrEnum):
    """Things the log says that should not happen; recorded, never fatal. Stable codes."""

    DUPLICATE_ROLLOUT_COMMAND = "DUPLICATE_ROLLOUT_COMMAND"
    COMMAND_ID_REUSED = "COMMAND_ID_REUSED"
    CONFLICTING_TERMINAL_ACKS = "CONFLICTING_TERMINAL_ACKS"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    #: A NACK of an unreadable record (``kind`` null) carrying the ids of a readable command.
    UNREADABLE_COMMAND_NACK = "UNREADABLE_COMMAND_NACK"
    #: A command the coordinator's trust store does not verify (unsigned, forged, out of its
    #: key's scope): shown, never folded into a rollout.
    COMMAND_UNVERIFIED = "COMMAND_UNVERIFIED"


class _Out(BaseModel):
    # Clients parse these back from the API's JSON: ignoring unknown fields (``exit_code``, or
    # a field a newer server added) lets an older CLI read a newer coordinator.
    model_config = ConfigDict(frozen=True, extra="ignore")


class StateCounts(_Out):
    pending: int = 0
    accepted: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    rejected: int = 0
    lost: int = 0

    @classmethod
    def of(cls, states: Iterable[WorkerState]) -> StateCounts:
        counts = dict.fromkeys(WorkerState, 0)
        for state in states:
            counts[state] += 1
        return cls(**{state.value: n for state, n in counts.items()})

    def __getitem__(self, state: WorkerState) -> int:
        value: int = getattr(self, state.value)
        return value


class Anomaly(_Out):
    code: AnomalyCode
    message: str
    worker_id: str | None = None
    command_id: str | None = None


class WorkerDetail(_Out):
    """One worker's part in one rollout, from its acks and its latest heartbeat."""

    worker_id: str
    state: WorkerState
    #: Set once the rollout has ended when the worker reported a different state afterwards
    #: (for instance ``succeeded`` after the command expired); the phase does not change.
    late_state: WorkerState | None = None
    error: AckError | None = None
    weights_version: str | None = None
    config_digest: str | None = None
    attempt: int | None = None
    acks: int = 0
    accepted_at: AwareDatetime | None = None
    started_at: AwareDatetime | None = None
    finished_at: AwareDatetime | None = None
    duration_s: float | None = None
    last_ack_at: AwareDatetime | None = None
    #: When its heartbeats stopped proving it alive, for a worker judged lost.
    lost_at: AwareDatetime | None = None


class RolloutStatus(_Out):
    """Everything known about one rollout at ``as_of``; a pure function of the log and ``as_of``."""

    rollout_id: str
    command_id: str
    #: None for a rollout whose command no worker could read (``COMMAND_REJECTED``).
    kind: CommandKind | None
    target_version: str | None = None
    overrides: dict[str, JsonValue] | None = None
    #: A dry run (``Command.dry_run``): checked everywhere, applied nowhere; succeeded means
    #: validated, and it is never a desired version.
    dry_run: bool = False
    issuer: str | None
    selector: Selector
    #: For a ``COMMAND_REJECTED`` rollout (no readable command): its first NACK's ``sent_at``.
    issued_at: AwareDatetime
    expires_at: AwareDatetime | None
    as_of: AwareDatetime
    phase: RolloutPhase
    reason: RolloutReason | None = None
    message: str
    expected: int
    counts: StateCounts
    workers: tuple[WorkerDetail, ...]
    unexpected: tuple[WorkerDetail, ...] = ()
    anomalies: tuple[Anomaly, ...] = ()
    started_at: AwareDatetime | None = None
    finished_at: AwareDatetime | None = None
    duration_s: float | None = None
    #: An ended rollout older than the last ``max_ended_rollouts``: kept as this summary, its
    #: per-worker details, unexpected workers and anomalies dropped to bound memory.
    details_dropped: bool = False

    @property
    def terminal(self) -> bool:
        return self.phase.terminal

    @computed_field  # type: ignore[prop-decorator]
    @property
    def exit_code(self) -> int | None:
        """0 succeeded, 1 failed or aborted, 2 timed out, None while the rollout is running."""
        return self.phase.exit_code

    def worker(self, worker_id: str) -> WorkerDetail | None:
        for detail in self.workers:
            if detail.worker_id == worker_id:
                return detail
        return None


class OrphanAcks(_Out):
    """Acks for a (rollout, command) whose command has not been seen: kept for debugging."""

    rollout_id: str
    command_id: str
    workers: int
    acks: int
    first_sent_at: AwareDatetime
    last_sent_at: AwareDatetime


class WorkerLevel(_Out):
    """Desired weights version (from reload rollouts) against the version a worker reports."""

    worker_id: str
    alive: bool
    reported_version: str | None
    desired_version: str | None
    desired_rollout_id: str | None
    degraded: bool
    #: Not degraded, and reporting the desired version (or nothing is desired).
    in_sync: bool


class UnverifiedCommand(_Out):
    """A command the coordinator's trust store did not verify (unsigned, a bad signature, an
    unknown or revoked key, out of its key's scope, or a ttl beyond ``max_ttl_s``). Never part
    of a rollout: listed here, and as a ``COMMAND_UNVERIFIED`` anomaly on the rollout whose id
    it carries when that rollout has a verified command."""

    rollout_id: str
    command_id: str
    kind: CommandKind
    issuer: str
    issued_at: AwareDatetime
    #: The signature's key id (None: unsigned).
    key_id: str | None
    #: Why it was refused: SIGNATURE_MISSING, SIGNATURE_INVALID, KEY_UNKNOWN, KEY_REVOKED,
    #: SCOPE_DENIED or TTL_TOO_LONG.
    code: str
    message: str
    #: NACKs of it by workers (``kind`` null: they refused it too), listed here rather than as
    #: a rollout of their own. Once it expired, those read later are not counted.
    nacks: int = 0
    #: When it expires (None: from a snapshot that did not say).
    expires_at: AwareDatetime | None = None
