"""The exit codes of the two command lines, by the code of the error that ended them.

Two tables, not one set of numbers: `controlplane` (:class:`CliExit`) and `fleet-worker run`
(:class:`WorkerExit`) give 5 and 6 different meanings, and both sets are documented in
README.md, stable for CI. A rollout's verdict maps to an exit too (:data:`PHASE_EXITS`, what
``--wait`` and ``status`` exit with). Stdlib and ``wire.errors`` only: the workers import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType
from typing import TypedDict

from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode


class CliExit(IntEnum):
    """Exit codes of `controlplane`, stable for CI."""

    OK = 0
    FAILED = 1
    TIMED_OUT = 2
    INVALID = 3
    #: Kafka (or --api's coordinator) unreachable; a publish failing so was not published.
    UNREACHABLE = 4
    INTERNAL = 5
    UNKNOWN = 6  # a publish not confirmed in time: it may be in the log (check status)
    ABORTED = 7  # a progressive rollout aborted (without rollback, or its rollback failed)
    ROLLED_BACK = 8  # a progressive rollout aborted and every updated worker put back on stable
    #: The command line itself was wrong (a typo'd command or option, a missing one, a bad
    #: value, no worker selector): nothing was done. sysexits' EX_USAGE, apart from every
    #: outcome above (click's own 2 would read as "timed out").
    USAGE = 64
    #: Ctrl-C (SIGINT) while ``--wait`` or ``status --watch`` followed a rollout: only the
    #: waiting stopped, the rollout goes on (the shell's 128 + SIGINT; never 1, "failed").
    INTERRUPTED = 130


#: What each `controlplane` exit means, in the words README.md and ``--help`` use.
CLI_EXIT_MEANINGS: Mapping[CliExit, str] = MappingProxyType(
    {
        CliExit.OK: "succeeded",
        CliExit.FAILED: "failed",
        CliExit.TIMED_OUT: "timed out",
        CliExit.INVALID: "invalid input",
        CliExit.UNREACHABLE: "Kafka unreachable (not published)",
        CliExit.INTERNAL: "internal error",
        CliExit.UNKNOWN: "publish outcome unknown",
        CliExit.ABORTED: "aborted",
        CliExit.ROLLED_BACK: "rolled back",
        CliExit.USAGE: "usage error (nothing done)",
        CliExit.INTERRUPTED: "interrupted (Ctrl-C; the rollout goes on)",
    }
)


def exit_codes_help() -> str:
    """The exit codes on one line, for ``controlplane --help`` (and every command's)."""
    return (
        "Exit codes: "
        + ", ".join(f"{int(code)} {words}" for code, words in CLI_EXIT_MEANINGS.items())
        + "."
    )


class WorkerExit(IntEnum):
    """Exit codes of `fleet-worker run` (0: stopped by SIGTERM/SIGINT after draining)."""

    OK = 0
    ERROR = 1  # any other coded error
    SETTINGS = 3
    KAFKA = 4
    STATE_DIR_LOCKED = 5
    JOURNAL = 6
    RUNNER = 7


#: `controlplane`: an error whose code is not here exits :attr:`CliExit.FAILED`.
CLI_EXITS: Mapping[WireCode | LocalCode, CliExit] = MappingProxyType(
    {
        LocalCode.USAGE: CliExit.USAGE,
        LocalCode.BROKER_UNAVAILABLE: CliExit.UNREACHABLE,
        LocalCode.COORDINATOR_UNAVAILABLE: CliExit.UNREACHABLE,
        LocalCode.PUBLISH_OUTCOME_UNKNOWN: CliExit.UNKNOWN,
        WireCode.SCHEMA_INVALID: CliExit.INVALID,
        WireCode.PATH_NOT_ALLOWED: CliExit.INVALID,
        LocalCode.NO_MATCHING_WORKERS: CliExit.INVALID,
        WireCode.TTL_TOO_LONG: CliExit.INVALID,
        LocalCode.ROLLOUT_EXISTS: CliExit.INVALID,
        LocalCode.SETTINGS_INVALID: CliExit.INVALID,
        # A secured Kafka refusing who we are or what we asked: our settings or its ACLs.
        LocalCode.KAFKA_AUTH_FAILED: CliExit.INVALID,
        LocalCode.KAFKA_TLS_UNTRUSTED: CliExit.INVALID,
        LocalCode.KAFKA_ACCESS_DENIED: CliExit.INVALID,
        LocalCode.TARGET_UNKNOWN: CliExit.INVALID,
        LocalCode.TARGET_BUSY: CliExit.INVALID,
        LocalCode.ROLLOUT_UNKNOWN: CliExit.INVALID,
        LocalCode.ROLLOUT_ENDED: CliExit.INVALID,
    }
)

#: `fleet-worker run`: an error whose code is not here exits :attr:`WorkerExit.ERROR`.
WORKER_EXITS: Mapping[WireCode | LocalCode, WorkerExit] = MappingProxyType(
    {
        LocalCode.SETTINGS_INVALID: WorkerExit.SETTINGS,
        LocalCode.BROKER_UNAVAILABLE: WorkerExit.KAFKA,
        LocalCode.KAFKA_ERROR: WorkerExit.KAFKA,
        LocalCode.TOPIC_MISMATCH: WorkerExit.KAFKA,
        LocalCode.KAFKA_AUTH_FAILED: WorkerExit.KAFKA,
        LocalCode.KAFKA_TLS_UNTRUSTED: WorkerExit.KAFKA,
        LocalCode.KAFKA_ACCESS_DENIED: WorkerExit.KAFKA,
        LocalCode.STATE_DIR_LOCKED: WorkerExit.STATE_DIR_LOCKED,
        WireCode.JOURNAL_WRITE_FAILED: WorkerExit.JOURNAL,
        WireCode.RUNNER_LOAD_FAILED: WorkerExit.RUNNER,
    }
)

#: What ``controlplane ... --wait`` (and ``status`` of an ended rollout) exits with, by the
#: rollout's phase value: 0 succeeded, 1 failed or aborted, 2 timed out; a phase not here has
#: not ended.
PHASE_EXITS: Mapping[str, CliExit] = MappingProxyType(
    {
        "succeeded": CliExit.OK,
        "failed": CliExit.FAILED,
        "aborted": CliExit.FAILED,
        "timed_out": CliExit.TIMED_OUT,
    }
)


#: What ``controlplane rollout start|status|undo --wait`` exits with, by a progressive rollout's
#: phase value (``controlplane.wire.control.ControlPhase``): 0 succeeded, 7 aborted, 8 rolled
#: back, 3 rejected (it never started: unknown target, another rollout in progress, no worker).
CONTROL_PHASE_EXITS: Mapping[str, CliExit] = MappingProxyType(
    {
        "succeeded": CliExit.OK,
        "aborted": CliExit.ABORTED,
        "rolled_back": CliExit.ROLLED_BACK,
        "rejected": CliExit.INVALID,
    }
)


def cli_exit(error: ControlPlaneError) -> CliExit:
    """The `controlplane` exit for an error."""
    return CLI_EXITS.get(error.code, CliExit.FAILED)


def worker_exit(error: ControlPlaneError) -> WorkerExit:
    """The `fleet-worker run` exit for an error."""
    return WORKER_EXITS.get(error.code, WorkerExit.ERROR)


def error_line(error: ControlPlaneError) -> str:
    """The one line both command lines end with on a coded error."""
    return f"error: {error.code}: {error.message}"


def internal_line(exc: BaseException) -> str:
    """The one line for anything unexpected (a bug): still no traceback."""
    return f"error: {WireCode.INTERNAL}: {type(exc).__name__}: {exc}"


class AppSettings(TypedDict):
    """What both command lines' ``typer.Typer(...)`` share: no traceback ever reaches a user
    (errors end as :func:`error_line`), and typer's shell completion (``--install-completion``,
    ``--show-completion SHELL``)."""

    no_args_is_help: bool
    pretty_exceptions_enable: bool
    add_completion: bool


APP_SETTINGS = AppSettings(
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=True
)
