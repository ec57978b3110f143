"""Bad settings are one coded line and a documented exit code, before Kafka, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli.main import app as controlplane_app
from workers.agent import loop as agent_module
from workers.agent.journal import WorkerState
from workers.cli import EXIT_JOURNAL, EXIT_SETTINGS, EXIT_STATE_DIR_LOCKED
from workers.cli import app as worker_app

#: Nothing listens there: a worker that got as far as Kafka would fail differently.
NO_KAFKA = ["--bootstrap", "127.0.0.1:1"]
FAST_KAFKA_FAILURE = {"FLEET_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "1000"}


@pytest.fixture
def no_kafka(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent must not start: settings are refused before it (and so before Kafka)."""

    async def run(self: object) -> None:
        raise AssertionError("the agent started: settings were not checked up front")

    monkeypatch.setattr(agent_module.Agent, "run", run)


def invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(worker_app, ["run", *args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "env", "field"),
    [
        ([], {"FLEET_WORKER_HEARTBEAT_INTERVAL_S": "-1"}, "heartbeat_interval_s"),
        ([], {"FLEET_WORKER_LABELS": "not json"}, "labels"),
        ([], {"FLEET_WORKER_LABELS": '{"bad key": "x"}'}, "labels"),
        ([], {"FLEET_WORKER_WORKER_ID": "bad id!"}, "worker_id"),
        ([], {"FLEET_WORKER_MAX_TTL_S": "0"}, "max_ttl_s"),
        ([], {"FLEET_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "5"}, "kafka.request_timeout_ms"),
        (["--label", "bad key=x"], {}, "labels"),
        (["--label", "zone=" + "x" * 64], {}, "labels"),
        (["--label", "novalue"], {}, "--label"),
        (["--label", "a=1", "--label", "a=2"], {}, "given twice"),
        (["--id", "a%2Fb"], {}, "worker_id"),
        (["--id", "-x"], {}, "worker_id"),
        (["--heartbeat-s", "0"], {}, "heartbeat_interval_s"),
        (["--runner", "nope"], {}, "unknown runner"),
        (["--runner-options", '{"reload_delay_s": -1}'], {}, "reload_delay_s"),
        (["--runner-options", "[1]"], {}, "--runner-options"),
        (["--log-level", "LOUD"], {}, "--log-level"),
    ],
)
def test_worker_settings_are_refused_before_kafka(
    no_kafka: None, args: list[str], env: dict[str, str], field: str
) -> None:
    code, output = invoke(["--runner", "fake", *NO_KAFKA, *args], env={**FAST_KAFKA_FAILURE, **env})
    assert code == EXIT_SETTINGS == 3, output
    assert output.startswith("error: SETTINGS_INVALID: ") and field in output, output
    assert output.count("\n") == 1, output


def test_a_locked_state_dir_is_a_coded_exit(tmp_path: Path) -> None:
    holder = WorkerState.open(tmp_path / "w%2F1")  # the directory of worker "w/1"
    try:
        code, output = invoke(
            ["--id", "w/1", "--runner", "fake", "--state-dir", str(tmp_path), *NO_KAFKA],
            env=FAST_KAFKA_FAILURE,
        )
    finally:
        holder.close()
    assert code == EXIT_STATE_DIR_LOCKED == 5, output
    assert output.startswith("error: STATE_DIR_LOCKED: ") and str(tmp_path / "w%2F1") in output


def test_an_unusable_state_dir_is_a_coded_exit(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    code, output = invoke(
        ["--id", "w1", "--runner", "fake", "--state-dir", str(tmp_path / "file"), *NO_KAFKA],
        env=FAST_KAFKA_FAILURE,
    )
    assert code == EXIT_JOURNAL == 6, output
    assert output.startswith("error: JOURNAL_WRITE_FAILED: ") and "file" in output


def test_coordinator_settings() -> None:
    result = CliRunner().invoke(
        controlplane_app, ["coordinator"], env={"FLEET_COORDINATOR_PORT": "abc"}
    )
    assert result.exit_code == 3, result.output
    assert "SCHEMA_INVALID: invalid settings: port" in result.output


def test_a_journal_kept_by_an_earlier_version_for_an_id_with_a_slash_is_pointed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def run(self: object) -> None:
        return None

    monkeypatch.setattr(agent_module.Agent, "run", run)
    (tmp_path / "a_b").mkdir()  # where "a/b" (and "a_b") kept their journal before
    code, _ = invoke(["--id", "a/b", "--runner", "fake", "--state-dir", str(tmp_path)])
    assert code == 0
    assert str(tmp_path / "a%2Fb") in caplog.text and str(tmp_path / "a_b") in caplog.text
    caplog.clear()
    code, _ = invoke(["--id", "a_b", "--runner", "fake", "--state-dir", str(tmp_path)])
    assert code == 0 and "earlier versions" not in caplog.text
