"""Every error the control plane and its workers report, as one small tree.

Each error has a stable machine-readable ``code`` (an :class:`ErrorCode`) that travels in acks,
and says whether retrying the same thing could succeed. No I/O here.

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


class ErrorCode(StrEnum):
    """Stable codes. Never rename one: CI scripts and dashboards match on them."""

    # Decoding untrusted bytes (protocol.py).
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
    NO_MATCHING_WORKERS = "NO_MATCHING_WORKERS"
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
    # Failed while applying.
    WEIGHTS_CORRUPTED = "WEIGHTS_CORRUPTED"
    COMMAND_TIMEOUT = "COMMAND_TIMEOUT"
    RUNNER_FAILED = "RUNNER_FAILED"
    WORKER_SHUTTING_DOWN = "WORKER_SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    # The worker itself (start-up, its state directory, its runner).
    SETTINGS_INVALID = "SETTINGS_INVALID"
    STATE_DIR_LOCKED = "STATE_DIR_LOCKED"
    JOURNAL_WRITE_FAILED = "JOURNAL_WRITE_FAILED"
    RUNNER_LOAD_FAILED = "RUNNER_LOAD_FAILED"
    # Publishing a rollout.
    ROLLOUT_EXISTS = "ROLLOUT_EXISTS"
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


#: Codes for which the same command may succeed later without being changed.
RETRYABLE_CODES: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.WEIGHTS_UNREADABLE,
        ErrorCode.COMMAND_TIMEOUT,
        ErrorCode.WORKER_SHUTTING_DOWN,
        ErrorCode.BROKER_UNAVAILABLE,
        ErrorCode.KAFKA_ERROR,
        ErrorCode.PORT_IN_USE,
        ErrorCode.BROKER_START_TIMEOUT,
    }
)

#: Codes meaning "refused before anything changed" (ack state ``rejected``, an xDS NACK);
#: every other code on an ack means the command was attempted and ``failed``.
REJECTION_CODES: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.MALFORMED_JSON,
        ErrorCode.SCHEMA_INVALID,
        ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
        ErrorCode.MESSAGE_TOO_LARGE,
        ErrorCode.DUPLICATE_KEY,
        ErrorCode.EXPIRED,
        ErrorCode.TTL_TOO_LONG,
        ErrorCode.ISSUED_IN_FUTURE,
        ErrorCode.PATH_NOT_ALLOWED,
        ErrorCode.NO_MATCHING_WORKERS,
        ErrorCode.MODEL_NOT_LOADED,
        ErrorCode.WEIGHTS_UNREADABLE,
        ErrorCode.WEIGHTS_MISSING,
        ErrorCode.WEIGHTS_UNEXPECTED,
        ErrorCode.WEIGHTS_SHAPE_MISMATCH,
        ErrorCode.WEIGHTS_DTYPE_MISMATCH,
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.CONFIG_KEY_REJECTED,
        ErrorCode.CONFIG_VALUE_INVALID,
    }
)


class ControlPlaneError(Exception):
    """Base of every error we raise on purpose."""

    default_code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode = code if code is not None else self.default_code

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

    default_code = ErrorCode.SCHEMA_INVALID

    def __init__(
        self, message: str, *, code: ErrorCode | None = None, command_id: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        #: The command id, when it could be read from the broken message (so it can be NACKed).
        self.command_id = command_id
        self.rollout_id: str | None = None


class CommandRejected(ControlPlaneError):
    """A valid command this worker refuses: expired, outside the allowed roots, no live worker
    matches it. Always raised with the code that says which (there is no default)."""

    def __init__(self, message: str, *, code: ErrorCode) -> None:
        super().__init__(message, code=code)


class RunnerError(ControlPlaneError):
    """The model runner refused (validation) or failed (application) a command."""

    default_code = ErrorCode.RUNNER_FAILED


class WeightsCorrupted(RunnerError):
    """A reload failed after copying began: parameters are a mix of two checkpoints."""

    default_code = ErrorCode.WEIGHTS_CORRUPTED

    def __init__(self, message: str, *, from_version: str | None, to_version: str) -> None:
        super().__init__(message)
        self.from_version = from_version
        self.to_version = to_version


class BusError(ControlPlaneError):
    """Kafka failed us; raised only in controlplane/kafka, which translates aiokafka's errors."""

    default_code = ErrorCode.KAFKA_ERROR


class TopicMismatch(BusError):
    """An existing topic does not have the partitions or configs that topics.py declares."""

    default_code = ErrorCode.TOPIC_MISMATCH

    def __init__(self, message: str, *, differences: list[str]) -> None:
        super().__init__(message)
        self.differences = differences


class BrokerError(ControlPlaneError):
    """The local Apache Kafka broker (broker.py) could not be provisioned or started."""

    default_code = ErrorCode.BROKER_DIED
