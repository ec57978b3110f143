"""The `controlplane` command line as a user meets it, through the installed entry point: usage
errors (their own exit code, one line), `--help` (readable, with the exit codes), `--version`,
shell completion, and Kafka unreachable (one coded line naming the address and what to do).

No broker: each of these ends before one is needed, or finds none where it looks.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.wire.exits import CLI_EXIT_MEANINGS, CliExit
from tests.factories import free_port

REPO = Path(__file__).resolve().parents[2]
#: The installed console script (pyproject's [project.scripts]), as a user runs it.
ENTRY = Path(sys.executable).parent / "controlplane"


def controlplane(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed `controlplane` with ``args``, in a 120-column terminal's width."""
    return subprocess.run(
        [str(ENTRY), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )


def flat(text: str) -> str:
    """Help text on one line: rich wraps it to the terminal."""
    return " ".join(text.split())


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["statuss"], "No such command 'statuss'"),
        (["reload-weights", "/m.safetensors", "--all"], "Missing option '--version'"),
        (["reload-weights", "/m.safetensors", "--version", "v1"], "choose workers"),
        (["update-config", "--set", "a=1"], "choose workers"),
        (["status", "--jsn"], "No such option: --jsn"),
        (["update-config", "--set", "a=1", "--all", "--ttl", "soon"], "'--ttl'"),
        (["broker", "nope"], "No such command 'nope'"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_a_usage_error_is_exit_64_and_one_line(args: list[str], says: str) -> None:
    """Not click's 2, which `controlplane` documents as "timed out": a CI script must not
    read a typo as a rollout that ran out of time."""
    proc = controlplane(*args, "--bootstrap", f"127.0.0.1:{free_port()}")
    assert proc.returncode == CliExit.USAGE, proc.stderr
    assert int(CliExit.USAGE) == 64  # sysexits EX_USAGE
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: USAGE: "), line
    assert says in line, line
    assert "hint: see `controlplane" in line and "--help`" in line, line


def test_the_usage_code_is_apart_from_every_outcome() -> None:
    outcomes = set(CliExit) - {CliExit.USAGE}
    assert CliExit.USAGE not in {int(c) for c in outcomes}
    assert set(CLI_EXIT_MEANINGS) == set(CliExit)


def test_dash_v_no_longer_means_the_weights_version() -> None:
    """`-v` reads as "verbose" or "version of the tool": the weights' version is `--version`."""
    proc = controlplane("reload-weights", "/m.safetensors", "-v", "v1", "--all")
    assert proc.returncode == CliExit.USAGE, proc.stderr
    assert "No such option: -v" in proc.stderr


# --------------------------------------------------------------------------- --help


@pytest.mark.parametrize(
    "args", [[], ["reload-weights"], ["update-config"], ["status"], ["workers"]], ids=str
)
def test_help_lists_every_exit_code(args: list[str]) -> None:
    proc = controlplane(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    text = flat(proc.stdout)
    for code, words in CLI_EXIT_MEANINGS.items():
        assert f"{int(code)} {words}" in text, (code, text)


@pytest.mark.parametrize(
    "args",
    [["reload-weights"], ["update-config"], ["status"], ["workers"], ["broker", "start"]],
    ids=str,
)
def test_help_names_values_readably(args: list[str]) -> None:
    proc = controlplane(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    for typer_says in ("<bool>", "<list[", "<str>", "<float", "<path>", "{path}"):
        assert typer_says not in proc.stdout, (typer_says, proc.stdout)


def test_reload_weights_help_reads_as_a_command_line() -> None:
    text = flat(controlplane("reload-weights", "--help").stdout)
    assert "reload-weights [OPTIONS] PATH" in text, text
    assert "--selector -s KEY=VALUE" in text, text
    assert "--version VERSION" in text, text
    assert "--drain wait|abort|keep" in text, text


# --------------------------------------------------------------------------- --version, completion


def test_version_is_the_package_version() -> None:
    proc = controlplane("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"controlplane {importlib.metadata.version('fleet-controlplane')}\n"


def test_bash_completion_is_offered() -> None:
    proc = controlplane("--show-completion", "bash")
    assert proc.returncode == 0, proc.stderr
    assert "_CONTROLPLANE_COMPLETE=complete_bash" in proc.stdout, proc.stdout
    assert re.search(r"^complete .*controlplane$", proc.stdout, re.M), proc.stdout


def test_completion_completes_a_command() -> None:
    """What the installed script answers when bash asks (the protocol the script above uses)."""
    proc = controlplane(
        env={
            "_CONTROLPLANE_COMPLETE": "complete_bash",
            "COMP_WORDS": "controlplane reload-w",
            "COMP_CWORD": "1",
        }
    )
    assert proc.returncode == 0, proc.stderr
    assert "reload-weights" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- Kafka unreachable


@pytest.mark.parametrize(
    "args",
    [["status"], ["status", "r-1"], ["workers"], ["update-config", "--set", "a=1", "--all"]],
    ids=lambda a: " ".join(a),
)
@pytest.mark.parametrize("via", ["flag", "env"])
def test_kafka_unreachable_is_one_line_naming_where_and_what_to_do(
    args: list[str], via: str
) -> None:
    where = f"127.0.0.1:{free_port()}"
    if via == "flag":
        proc = controlplane(*args, "--bootstrap", where)
    else:
        proc = controlplane(*args, env={"FLEET_KAFKA_BOOTSTRAP": where})
    assert proc.returncode == CliExit.UNREACHABLE, proc.stderr
    [line] = proc.stderr.splitlines()  # nothing of aiokafka's before it
    assert line.startswith(f"error: BROKER_UNAVAILABLE: Kafka unreachable at {where} "), line
    assert "--bootstrap" in line and "FLEET_KAFKA_BOOTSTRAP" in line, line
    assert "AddressFamily" not in line and "[(" not in line, line
