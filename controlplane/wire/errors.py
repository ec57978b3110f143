"""Every error the control plane and its workers report, as one small tree.

Each error has a stable machine-readable ``code`` and says whether retrying the same thing could
succeed. Two sets of codes: a :class:`WireCode` travels in acks and heartbeats (a worker reports
it, the coordinator folds it, the API and CLI show it); a :class:`LocalCode` is raised by a tool
on its own side (publishing, Kafka, the local broker, a worker's start-up) and ends up in that
tool's output (its error line and exit code, an HTTP error), never in a message. A tool may
raise a wire code too (``SCHEMA_INVALID`` for bad input): the split says what may travel, not
who raises it. No I/O here.

    ControlPlaneError
    ├── ProtocolError             untrusted bytes did not decode into our wire models
    ├── CommandRejected           a well-formed command this worker refuses before touching anything
    ├── RunnerError               the model runner refused or failed a command
    │   └── WeightsCorrupted      copying began and did not finish: the worker is degraded
    ├── BusError                  Kafka could not be reached or disagrees with us (translated once, in kafka/client.py)
    │   └── TopicMismatch         an existing topic's partitions or configs differ from topics.py
    └── BrokerError               the local Apache Kafka broker could not be provisioned or started
"""

from __future__ import annotations

from enum import StrEnum


class WireCode(StrEnum):
    """Codes a worker sends in an ack's error or a heartbeat's ``degraded``. Never rename one:
    CI scripts and dashboards match on them."""

    # Decoding untrusted bytes (codec.py): a worker NACKs the command with them.
    MALFORMED_JSON = "MALFORMED_JSON"
    SCHEMA_INVALID = "SCHEMA_INVALID"
    UNSUPPORTED_SCHEMA_VERSION = "UNSUPPORTED_SCHEMA_VERSION"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    DUPLICATE_KEY = "DUPLICATE_KEY"
    # Refused by the agent before the runner sees it.
    EXPIRED = "EXPIRED"
    TTL_TOO_LONG = "TTL_TOO_LONG"
    ISSUED_IN_FUTURE = "ISSUED_IN_FUTURE"
    PATH_NOT_ALLOWED = "PATH_NOT_ALLOWED"
    # Signed commands (signing.py), refused by a worker holding a trust store. Never remembered
    # as applied: a forged record must not block the real command of the same id.
    SIGNATURE_MISSING = "SIGNATURE_MISSING"
    SIGNATURE_INVALID = "SIGNATURE_INVALID"
    KEY_UNKNOWN = "KEY_UNKNOWN"
    KEY_REVOKED = "KEY_REVOKED"
    #: Signed by a trusted key that may not command this kind, selector or path.
    SCOPE_DENIED = "SCOPE_DENIED"
    # Refused by the runner after validation, before any weight or setting changed.
    MODEL_NOT_LOADED = "MODEL_NOT_LOADED"
    WEIGHTS_UNREADABLE = "WEIGHTS_UNREADABLE"
    WEIGHTS_MISSING = "WEIGHTS_MISSING"
    WEIGHTS_UNEXPECTED = "WEIGHTS_UNEXPECTED"
    WEIGHTS_SHAPE_MISMATCH = "WEIGHTS_SHAPE_MISMATCH"
    WEIGHTS_DTYPE_MISMATCH = "WEIGHTS_DTYPE_MISMATCH"
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    CONFIG_KEY_REJECTED = "CONFIG_KEY_REJECTED"
    CONFIG_VALUE_INVALID = "CONFIG_VALUE_INVALID"
    # Checkpoints signed with the OpenSSF model-signing format (OMS), checked before any copy.
    #: Signed, but not by a trusted model key, or a file the signature does not name.
    MODEL_SIGNATURE_INVALID = "MODEL_SIGNATURE_INVALID"
    #: No signature where the worker requires one.
    MODEL_SIGNATURE_MISSING = "MODEL_SIGNATURE_MISSING"
    # Failed while applying.
    WEIGHTS_CORRUPTED = "WEIGHTS_CORRUPTED"
    COMMAND_TIMEOUT = "COMMAND_TIMEOUT"
    RUNNER_FAILED = "RUNNER_FAILED"
    WORKER_SHUTTING_DOWN = "WORKER_SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    # A worker degraded by itself, not by a command (its heartbeat's ``degraded.code``).
    JOURNAL_WRITE_FAILED = "JOURNAL_WRITE_FAILED"
    RUNNER_LOAD_FAILED = "RUNNER_LOAD_FAILED"


class LocalCode(StrEnum):
    """Codes a tool raises on its own side, never sent in a message. Never rename one either:
    they end a command's output (``error: CODE: ...``), choose its exit code, or an HTTP error's."""

    #: The command line itself was wrong (a typo'd command or option, a missing one, a bad
    #: value, no worker selector): nothing was done (`controlplane` exits 64).
    USAGE = "USAGE"
    # Publishing a rollout (the CLI and the API, before anything is written).
    NO_MATCHING_WORKERS = "NO_MATCHING_WORKERS"
    ROLLOUT_EXISTS = "ROLLOUT_EXISTS"
    # A worker's start-up.
    SETTINGS_INVALID = "SETTINGS_INVALID"
    STATE_DIR_LOCKED = "STATE_DIR_LOCKED"
    # Kafka.
    BROKER_UNAVAILABLE = "BROKER_UNAVAILABLE"
    #: A publish the cluster did not confirm within the delivery timeout: the record may
    #: still be written (the producer was retrying), so "not published" would be a guess.
    PUBLISH_OUTCOME_UNKNOWN = "PUBLISH_OUTCOME_UNKNOWN"
    TOPIC_MISMATCH = "TOPIC_MISMATCH"
    KAFKA_ERROR = "KAFKA_ERROR"
    # Local broker provisioning.
    JAVA_NOT_FOUND = "JAVA_NOT_FOUND"
    JAVA_TOO_OLD = "JAVA_TOO_OLD"
    MAVEN_NOT_FOUND = "MAVEN_NOT_FOUND"
    JARS_UNRESOLVABLE = "JARS_UNRESOLVABLE"
    PORT_IN_USE = "PORT_IN_USE"
    BROKER_DIED = "BROKER_DIED"
    BROKER_START_TIMEOUT = "BROKER_START_TIMEOUT"
    # Targets and progressive rollouts (the controller's state records, the CLI, the API).
    TARGET_UNKNOWN = "TARGET_UNKNOWN"
    #: Another rollout of the target is in progress.
    TARGET_BUSY = "TARGET_BUSY"
    #: A worker matched by two targets' selectors: shown, and left alone by the controller.
    TARGET_CONFLICT = "TARGET_CONFLICT"
    ROLLOUT_UNKNOWN = "ROLLOUT_UNKNOWN"
    #: An action on a rollout that has ended (ended is ended).
    ROLLOUT_ENDED = "ROLLOUT_ENDED"
    ABORTED_BY_OPERATOR = "ABORTED_BY_OPERATOR"
    MAX_FAILURES_EXCEEDED = "MAX_FAILURES_EXCEEDED"
    GATE_FAILED = "GATE_FAILED"
    PROGRESS_DEADLINE_EXCEEDED = "PROGRESS_DEADLINE_EXCEEDED"
    #: A rollback command failed on some worker: those may still run the aborted change.
    ROLLBACK_FAILED = "ROLLBACK_FAILED"
    #: Aborted with rollback, but the target had no stable state to go back to.
    ROLLBACK_UNAVAILABLE = "ROLLBACK_UNAVAILABLE"
    #: Another coordinator took over the controller's transactional id: this one stopped writing.
    CONTROLLER_FENCED = "CONTROLLER_FENCED"
    # A coordinator's snapshot of its fold, not used at start (it replays the log in full).
    #: A manifest or chunk that does not decode, or a chunk whose sha256 differs.
    SNAPSHOT_CORRUPT = "SNAPSHOT_CORRUPT"
    #: A chunk the manifest names is not on the snapshots topic.
    SNAPSHOT_INCOMPLETE = "SNAPSHOT_INCOMPLETE"
    #: Written in a format this version does not know.
    SNAPSHOT_VERSION_UNKNOWN = "SNAPSHOT_VERSION_UNKNOWN"
    #: Its offsets are not in the log any more (below a partition's log start: retention
    #: deleted records after them) or not yet (past its end: the topic was recreated).
    SNAPSHOT_OFFSETS_GONE = "SNAPSHOT_OFFSETS_GONE"
    #: Made of other partitions, or with other fold settings, than this coordinator's.
    SNAPSHOT_MISMATCH = "SNAPSHOT_MISMATCH"
    #: The CLI's ``--api``: the coordinator's API did not answer as one does (unreachable,
    #: not ready, not the API).
    COORDINATOR_UNAVAILABLE = "COORDINATOR_UNAVAILABLE"
    # A secured Kafka (SASL_SSL): what the client was told by the broker or the TLS handshake.
    #: The broker refused the SASL credentials (wrong user or password).
    KAFKA_AUTH_FAILED = "KAFKA_AUTH_FAILED"
    #: The broker's certificate is not signed by a CA the client trusts (or names another host).
    KAFKA_TLS_UNTRUSTED = "KAFKA_TLS_UNTRUSTED"
    #: An ACL denies this principal the topic, group or transactional id.
    KAFKA_ACCESS_DENIED = "KAFKA_ACCESS_DENIED"


#: Codes for which the same command may succeed later without being changed.
RETRYABLE_CODES: frozenset[WireCode | LocalCode] = frozenset(
    {
        WireCode.WEIGHTS_UNREADABLE,
        WireCode.COMMAND_TIMEOUT,
        WireCode.WORKER_SHUTTING_DOWN,
        LocalCode.BROKER_UNAVAILABLE,
        LocalCode.KAFKA_ERROR,
        LocalCode.PORT_IN_USE,
        LocalCode.BROKER_START_TIMEOUT,
    }
)

#: Codes meaning "refused before anything changed" (ack state ``rejected``, an xDS NACK);
#: every other code on an ack means the command was attempted and ``failed``.
REJECTION_CODES: frozenset[WireCode | LocalCode] = frozenset(
    {
        WireCode.MALFORMED_JSON,
        WireCode.SCHEMA_INVALID,
        WireCode.UNSUPPORTED_SCHEMA_VERSION,
        WireCode.MESSAGE_TOO_LARGE,
        WireCode.DUPLICATE_KEY,
        WireCode.EXPIRED,
        WireCode.TTL_TOO_LONG,
        WireCode.ISSUED_IN_FUTURE,
        WireCode.PATH_NOT_ALLOWED,
        WireCode.SIGNATURE_MISSING,
        WireCode.SIGNATURE_INVALID,
        WireCode.KEY_UNKNOWN,
        WireCode.KEY_REVOKED,
        WireCode.SCOPE_DENIED,
        WireCode.MODEL_NOT_LOADED,
        WireCode.WEIGHTS_UNREADABLE,
        WireCode.WEIGHTS_MISSING,
        WireCode.WEIGHTS_UNEXPECTED,
        WireCode.WEIGHTS_SHAPE_MISMATCH,
        WireCode.WEIGHTS_DTYPE_MISMATCH,
        WireCode.CHECKSUM_MISMATCH,
        WireCode.CONFIG_KEY_REJECTED,
        WireCode.CONFIG_VALUE_INVALID,
        # The publisher's refusal: nothing was written.
        LocalCode.NO_MATCHING_WORKERS,
    }
)


class ControlPlaneError(Exception):
    """Base of every error we raise on purpose."""

    default_code: WireCode | LocalCode = WireCode.INTERNAL

    def __init__(self, message: str, *, code: WireCode | LocalCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code: WireCode | LocalCode = code if code is not None else self.default_code

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES

    @property
    def is_rejection(self) -> bool:
        """True when nothing was changed: the ack state is ``rejected`` rather than ``failed``."""
        return self.code in REJECTION_CODES

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code.value!r}, message={self.message!r})"


class ProtocolError(ControlPlaneError):
    """Bytes from the wire are not one of our messages."""

    default_code = WireCode.SCHEMA_INVALID

    def __init__(
        self,
        message: str,
        *,
        code: WireCode | LocalCode | None = None,
        command_id: str | None = None,
    ) -> None:
        super().__init__(message, code=code)
        #: The command id, when it could be read from the broken message (so it can be NACKed).
        self.command_id = command_id
        self.rollout_id: str | None = None


class CommandRejected(ControlPlaneError):
    """A valid command this worker refuses: expired, outside the allowed roots, no live worker
    matches it. Always raised with the code that says which (there is no default)."""

    def __init__(self, message: str, *, code: WireCode | LocalCode) -> None:
        super().__init__(message, code=code)


class RunnerError(ControlPlaneError):
    """The model runner refused (validation) or failed (application) a command."""

    default_code = WireCode.RUNNER_FAILED


class WeightsCorrupted(RunnerError):
    """A reload failed after copying began: parameters are a mix of two checkpoints."""

    default_code = WireCode.WEIGHTS_CORRUPTED

    def __init__(self, message: str, *, from_version: str | None, to_version: str) -> None:
        super().__init__(message)
        self.from_version = from_version
        self.to_version = to_version


class BusError(ControlPlaneError):
    """Kafka failed us; raised only in controlplane/kafka, which translates aiokafka's errors."""

    default_code = LocalCode.KAFKA_ERROR


class TopicMismatch(BusError):
    """An existing topic does not have the partitions or configs that topics.py declares."""

    default_code = LocalCode.TOPIC_MISMATCH

    def __init__(self, message: str, *, differences: list[str]) -> None:
        super().__init__(message)
        self.differences = differences


class BrokerError(ControlPlaneError):
    """The local Apache Kafka broker (broker.py) could not be provisioned or started."""

    default_code = LocalCode.BROKER_DIED
