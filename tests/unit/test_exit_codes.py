"""The exit-code contract of both command lines, `controlplane` and `fleet-worker run`.

The tables (controlplane.wire.exits) against what README.md documents, and every mapped code
through typer's CliRunner: the error line and the exit, never a traceback. No Kafka: the
error is raised where the command would first touch the outside world.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from controlplane.cli import main as cli_main
from controlplane.cli.common import Exit
from controlplane.cli.common import app as controlplane_app
from controlplane.kafka import bus
from controlplane.kafka.broker import LocalBroker
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode
from controlplane.wire.exits import (
    CLI_EXITS,
    PHASE_EXITS,
    WORKER_EXITS,
    CliExit,
    WorkerExit,
    cli_exit,
    worker_exit,
)
from workers import cli as worker_cli
from workers.agent import loop as agent_module

#: Every code, wire and local: both command lines map each.
CODES: list[WireCode | LocalCode] = [*WireCode, *LocalCode]
README = Path(__file__).resolve().parents[2] / "README.md"
ROLLOUTS_MD = Path(__file__).resolve().parents[2] / "docs" / "rollouts.md"


def _paragraph(text: str, start: str, end: str) -> str:
    """The text from ``start`` to the next ``end`` after it, on one line."""
    begin = text.index(start)
    return " ".join(text[begin : text.index(end, begin)].split())


# --------------------------------------------------------------------------- the tables


def test_the_controlplane_codes_are_the_ones_readme_documents() -> None:
    text = _paragraph(README.read_text(), "Exit codes:", "--json")
    documented = {int(n): words for n, words in re.findall(r"`(\d+)` ([a-zA-Z ]+)", text)}
    meaning = {
        CliExit.OK: "succeeded",
        CliExit.FAILED: "failed",
        CliExit.TIMED_OUT: "timed out",
        CliExit.INVALID: "invalid input",
        CliExit.UNREACHABLE: "Kafka unreachable",
        CliExit.INTERNAL: "internal error",
        CliExit.UNKNOWN: "publish outcome unknown",
        CliExit.ABORTED: "aborted",
        CliExit.ROLLED_BACK: "rolled back",
        CliExit.USAGE: "usage error",
        CliExit.INTERRUPTED: "interrupted",
    }
    assert set(documented) == {int(e) for e in CliExit}, text
    for code, words in meaning.items():
        assert documented[code].startswith(words), (code, documented[code])


def test_the_worker_codes_are_the_ones_readme_documents() -> None:
    text = _paragraph(README.read_text(), "`fleet-worker run` stops with one line", "drain.")
    # "`N` what it means (`CODE`)": the first error code named after each number.
    pairs = re.findall(r"`(\d)` [^`]*(?:`([A-Z_]+)`)?", text)
    documented = {int(n): code for n, code in pairs}
    assert set(documented) == {int(e) for e in WorkerExit}, text
    for number, code in documented.items():
        if code:
            assert WORKER_EXITS[{c.value: c for c in CODES}[code]] == number, (code, number)
    assert documented[WorkerExit.SETTINGS] == "SETTINGS_INVALID"
    assert "Kafka" in text and WORKER_EXITS[LocalCode.BROKER_UNAVAILABLE] == 4


def test_every_error_code_maps_to_a_documented_exit() -> None:
    for code in CODES:
        error = ControlPlaneError("x", code=code)
        usage = (Exit.USAGE,) if code is LocalCode.USAGE else ()  # the command line's own
        assert cli_exit(error) in (
            Exit.FAILED,
            Exit.INVALID,
            Exit.UNREACHABLE,
            Exit.UNKNOWN,
            *usage,
        )
        assert worker_exit(error) in set(WorkerExit) - {WorkerExit.OK}
    assert set(CLI_EXITS.values()) == {Exit.INVALID, Exit.UNREACHABLE, Exit.UNKNOWN, Exit.USAGE}
    assert set(WORKER_EXITS.values()) == set(WorkerExit) - {WorkerExit.OK, WorkerExit.ERROR}


def test_the_old_names_are_the_table() -> None:
    assert Exit is CliExit
    assert worker_cli.EXIT_CODES is WORKER_EXITS
    assert (worker_cli.EXIT_ERROR, worker_cli.EXIT_SETTINGS, worker_cli.EXIT_KAFKA) == (1, 3, 4)
    assert (worker_cli.EXIT_STATE_DIR_LOCKED, worker_cli.EXIT_JOURNAL) == (5, 6)
    assert worker_cli.EXIT_RUNNER == 7


def test_each_phase_exits_as_docs_rollouts_table_says() -> None:
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| (\d) \|", ROLLOUTS_MD.read_text(), re.M)
    documented = {phase: int(n) for phase, n in rows}
    assert documented == {"succeeded": 0, "failed": 1, "timed_out": 2, "aborted": 1}
    assert dict(PHASE_EXITS) == documented
    for phase in RolloutPhase:
        expected = documented.get(phase.value)
        assert phase.exit_code == expected
        assert phase.terminal is (expected is not None)
        assert type(phase.exit_code) is (int if expected is not None else type(None))


# --------------------------------------------------------------------------- controlplane


def invoke(app: typer.Typer, args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("code", CODES)
def test_controlplane_fail_maps_every_code(
    monkeypatch: pytest.MonkeyPatch, code: WireCode | LocalCode
) -> None:
    """Through ``fail``: a command's own ``except ControlPlaneError`` (broker install)."""

    def check_java(self: LocalBroker) -> int:
        raise ControlPlaneError("it broke", code=code)

    monkeypatch.setattr(LocalBroker, "check_java", check_java)
    exit_code, output = invoke(controlplane_app, ["broker", "install"])
    assert exit_code == CLI_EXITS.get(code, Exit.FAILED)
    assert output == f"error: {code}: it broke\n"


class _Failing:
    """An ``Admin`` that fails as it opens (raises ``error``)."""

    error: BaseException

    def __init__(self, settings: object) -> None:
        pass

    async def __aenter__(self) -> Any:
        raise self.error

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(
    ("error", "exit_code", "line"),
    [
        (
            ControlPlaneError("down", code=LocalCode.BROKER_UNAVAILABLE),
            Exit.UNREACHABLE,
            "error: BROKER_UNAVAILABLE: down",
        ),
        (
            ControlPlaneError("maybe", code=LocalCode.PUBLISH_OUTCOME_UNKNOWN),
            Exit.UNKNOWN,
            "error: PUBLISH_OUTCOME_UNKNOWN: maybe",
        ),
        (
            ControlPlaneError("differs", code=LocalCode.TOPIC_MISMATCH),
            Exit.FAILED,
            "error: TOPIC_MISMATCH: differs",
        ),
        (RuntimeError("a bug"), Exit.INTERNAL, "error: INTERNAL: RuntimeError: a bug"),
    ],
)
def test_controlplane_run_maps_errors_and_bugs(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, exit_code: int, line: str
) -> None:
    """Through ``run``: an error (or a bug) raised in a command's coroutine (topics ensure)."""
    monkeypatch.setattr(_Failing, "error", error, raising=False)
    monkeypatch.setattr(bus, "Admin", _Failing)
    assert invoke(controlplane_app, ["topics", "ensure"]) == (exit_code, line + "\n")


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["reload-weights", "/w", "--version", "v1", "--all", "--ttl", "1e9"], "TTL_TOO_LONG"),
        (["update-config", "--set", "k=1", "--all", "--ttl", "1e9"], "TTL_TOO_LONG"),
        (["reload-weights", "/w", "--version", "", "--all"], "SCHEMA_INVALID"),
        (["update-config", "--set", "=1", "--all"], "SCHEMA_INVALID"),
        (["topics", "ensure", "--replication-factor", "0"], "SCHEMA_INVALID"),
    ],
)
def test_controlplane_invalid_input_exits_3_before_kafka(args: list[str], code: str) -> None:
    exit_code, output = invoke(controlplane_app, [*args, "--bootstrap", "127.0.0.1:1"])
    assert exit_code == Exit.INVALID, output
    assert output.startswith(f"error: {code}: "), output


def test_controlplane_a_missing_java_exits_1() -> None:
    exit_code, output = invoke(controlplane_app, ["broker", "install", "--java", "no-such-java"])
    assert (exit_code, output.startswith("error: JAVA_NOT_FOUND: ")) == (Exit.FAILED, True)


@pytest.mark.parametrize(
    ("error", "exit_code", "line"),
    [
        (ControlPlaneError("x", code=WireCode.SCHEMA_INVALID), 1, "error: SCHEMA_INVALID: x"),
        (KeyError("k"), 5, "error: INTERNAL: KeyError: 'k'"),
    ],
)
def test_controlplane_last_net(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: BaseException,
    exit_code: int,
    line: str,
) -> None:
    """What escapes every command still ends as one line: exit 1 for a coded error, 5 a bug."""

    def app() -> None:
        raise error

    monkeypatch.setattr(cli_main, "app", app)
    with pytest.raises(SystemExit) as exited:
        cli_main.main()
    assert exited.value.code == exit_code
    assert capsys.readouterr().err == line + "\n"


# --------------------------------------------------------------------------- fleet-worker


@pytest.mark.parametrize("code", CODES)
def test_worker_run_maps_every_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: WireCode | LocalCode
) -> None:
    """Whatever stops the agent: the line and the exit of its code."""

    async def run(self: object) -> None:
        raise ControlPlaneError("it stopped", code=code)

    monkeypatch.setattr(agent_module.Agent, "run", run)
    args = ["run", "--id", "w1", "--runner", "fake", "--state-dir", str(tmp_path)]
    exit_code, output = invoke(worker_cli.app, [*args, "--bootstrap", "127.0.0.1:1"])
    assert exit_code == WORKER_EXITS.get(code, WorkerExit.ERROR)
    assert output.endswith(f"error: {code}: it stopped\n"), output


def test_worker_settings_exit_3_and_a_drain_exits_0(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stopped: list[bool] = []

    async def run(self: object) -> None:
        stopped.append(True)

    monkeypatch.setattr(agent_module.Agent, "run", run)
    args = ["run", "--id", "w1", "--runner", "fake", "--state-dir", str(tmp_path)]
    exit_code, output = invoke(worker_cli.app, [*args, "--log-level", "LOUD"])
    assert (exit_code, output.startswith("error: SETTINGS_INVALID: ")) == (3, True), output
    assert stopped == []
    assert invoke(worker_cli.app, args) == (WorkerExit.OK, "")
    assert stopped == [True]


PROGRESSIVE_MD = Path(__file__).resolve().parents[2] / "docs" / "progressive.md"


def test_each_progressive_phase_exits_as_docs_progressive_table_says() -> None:
    from controlplane.wire.control import ControlPhase
    from controlplane.wire.exits import CONTROL_PHASE_EXITS

    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| (\d) \|", PROGRESSIVE_MD.read_text(), re.M)
    documented = {phase: int(n) for phase, n in rows}
    assert documented == {"succeeded": 0, "rolled_back": 8, "aborted": 7, "rejected": 3}
    assert dict(CONTROL_PHASE_EXITS) == documented
    for phase in ControlPhase:
        assert phase.terminal is (phase.value in documented)
    assert (CliExit.ABORTED, CliExit.ROLLED_BACK) == (7, 8)


@pytest.mark.parametrize(
    "code",
    [LocalCode.KAFKA_AUTH_FAILED, LocalCode.KAFKA_TLS_UNTRUSTED, LocalCode.KAFKA_ACCESS_DENIED],
    ids=str,
)
def test_a_secured_kafka_refusing_us_is_invalid_input_for_the_cli_and_kafka_for_the_worker(
    code: LocalCode,
) -> None:
    """Wrong credentials, an untrusted CA or a missing ACL: the same command fails the same way
    until someone changes the settings or the ACLs (CLI 3, not 4 "unreachable")."""
    error = ControlPlaneError("x", code=code)
    assert cli_exit(error) is CliExit.INVALID
    assert worker_exit(error) is WorkerExit.KAFKA


@pytest.mark.parametrize(
    "args",
    [["rollouts-of-nothing"], ["status", "--no-such-option"], ["update-config", "--set", "x=1"]],
    ids=["unknown command", "unknown option", "no worker selector"],
)
def test_a_usage_error_is_code_usage_and_exit_64(args: list[str]) -> None:
    """The code a usage error's line names is a real one (LocalCode.USAGE), mapped to 64."""
    assert CLI_EXITS[LocalCode.USAGE] is Exit.USAGE and int(Exit.USAGE) == 64
    exit_code, output = invoke(controlplane_app, args)
    assert exit_code == Exit.USAGE, output
    [line] = [ln for ln in output.splitlines() if ln.startswith("error: ")]
    assert line.startswith(f"error: {LocalCode.USAGE.value}: "), output
