"""``--dry-run`` and ``--preflight`` (C1) from the installed `controlplane`, against the real
broker and three real agents (fake runner): a dry run is validated on every worker (exit 0,
nothing applied) or its rejections are collapsed by code with counts (exit 1, nothing applied);
``--preflight`` publishes the command itself only when every matched worker validated it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.exits import CliExit
from tests.factories import agent_running, agent_settings
from tests.integration.test_cli_usage import controlplane
from workers.runners.fake_runner import FakeRunner

pytestmark = pytest.mark.kafka

WORKERS = ("d1", "d2", "d3")


def cli(settings: KafkaSettings, *args: str) -> subprocess.CompletedProcess[str]:
    """A rollout command to the model=tiny workers (wait at most 90 s)."""
    where = ("--bootstrap", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix)
    return controlplane(*args, "--selector", "model=tiny", "--wait-timeout", "90", *where)


@contextlib.asynccontextmanager
async def fleet(kafka: KafkaSettings, tmp_path: Path) -> AsyncIterator[list[FakeRunner]]:
    """Three agents, model=tiny, weights only from ``tmp_path/ckpts``."""
    runners = [FakeRunner({}) for _ in WORKERS]
    async with contextlib.AsyncExitStack() as stack:
        for worker_id, runner in zip(WORKERS, runners, strict=True):
            settings = agent_settings(
                kafka, tmp_path, worker_id=worker_id, state_dir=tmp_path / f"state-{worker_id}"
            )
            await stack.enter_async_context(agent_running(settings, runner))
        yield runners


async def test_a_dry_run_validates_on_every_worker_and_applies_nothing(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    path = str(weights / "model.safetensors")
    async with fleet(kafka, tmp_path) as runners:
        proc = await asyncio.to_thread(
            cli, kafka, "reload-weights", path, "--version", "v2", "--dry-run"
        )
        config = await asyncio.to_thread(
            cli, kafka, "update-config", "--set", "top_k=9", "--dry-run", "-o", "json"
        )
    assert proc.returncode == CliExit.OK, proc.stdout + proc.stderr
    assert re.search(
        r"^published dry run r-\S+ .* to 3 worker\(s\): d1, d2, d3$", proc.stdout, re.M
    )
    assert re.search(
        r"^dry run r-\S+: validated on 3 worker\(s\); nothing applied$", proc.stdout, re.M
    ), proc.stdout
    assert config.returncode == CliExit.OK, config.stdout + config.stderr
    judged = json.loads(config.stdout)
    assert judged["phase"] == "succeeded" and judged["counts"]["succeeded"] == 3, judged
    assert judged["message"].startswith("dry run"), judged
    for runner in runners:
        assert [s.version for s in runner.validations] == ["v2"]
        assert runner.history == ["init"] and runner.reloads == []
        assert runner.config_updates == [] and runner.describe().config["top_k"] == 0


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["reload-weights", "/etc/passwd", "--version", "v2"], "PATH_NOT_ALLOWED"),
        (["reload-weights", "{weights}", "--version", "badshape-v2"], "WEIGHTS_SHAPE_MISMATCH"),
        (["update-config", "--set", "top_k=-1"], "CONFIG_VALUE_INVALID"),
    ],
    ids=lambda a: a if isinstance(a, str) else None,
)
async def test_a_dry_run_rejected_everywhere_is_one_line_per_code_with_a_count(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, args: list[str], code: str
) -> None:
    args = [a.replace("{weights}", str(weights / "model.safetensors")) for a in args]
    async with fleet(kafka, tmp_path) as runners:
        proc = await asyncio.to_thread(cli, kafka, *args, "--dry-run")
    assert proc.returncode == CliExit.FAILED, proc.stdout + proc.stderr
    assert re.search(
        r"^dry run r-\S+: not validated on 3 of 3 worker\(s\); nothing applied$", proc.stdout, re.M
    ), proc.stdout
    [line] = [ln for ln in proc.stdout.splitlines() if code in ln]
    assert line.startswith(f"  3 {code}: ") and line.endswith("(d1, d2, d3)"), line
    for runner in runners:
        assert runner.history == ["init"] and runner.reloads == []
        assert runner.config_updates == []


async def test_preflight_publishes_the_command_only_when_every_worker_validated_it(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    path = str(weights / "model.safetensors")
    async with fleet(kafka, tmp_path) as runners:
        refused = await asyncio.to_thread(
            cli, kafka, "reload-weights", path, "--version", "badshape-v3", "--preflight", "--wait"
        )
        assert refused.returncode == CliExit.FAILED, refused.stdout + refused.stderr
        assert "preflight failed: the command itself was not published" in refused.stderr
        assert refused.stdout.count("published ") == 1, refused.stdout  # the dry run alone
        for runner in runners:
            assert runner.history == ["init"] and runner.reloads == []

        passed = await asyncio.to_thread(
            cli, kafka, "reload-weights", path, "--version", "v3", "--preflight", "--wait"
        )
    assert passed.returncode == CliExit.OK, passed.stdout + passed.stderr
    out = passed.stdout
    assert out.index("validated on 3 worker(s)") < out.index("published rollout "), out
    for runner in runners:
        assert runner.history == ["init", "v3"]


async def test_preflight_as_json_or_yaml_is_one_document_of_both_steps(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    """``-o json|yaml`` under ``--preflight``: stdout is ONE document, the dry run's verdict and
    the command's (its status under --wait; null when it was not published)."""
    import yaml

    path = str(weights / "model.safetensors")
    async with fleet(kafka, tmp_path) as runners:
        as_json = await asyncio.to_thread(
            cli, kafka, "reload-weights", path, "--version", "v3", "--preflight", "--wait",
            "-o", "json",
        )  # fmt: skip
        as_yaml = await asyncio.to_thread(
            cli, kafka, "update-config", "--set", "top_k=7", "--preflight", "-o", "yaml"
        )
        refused = await asyncio.to_thread(
            cli, kafka, "update-config", "--set", "top_k=-1", "--preflight", "-o", "json"
        )
    assert as_json.returncode == CliExit.OK, as_json.stdout + as_json.stderr
    both = json.loads(as_json.stdout)
    assert both["dry_run"]["phase"] == "succeeded" and both["dry_run"]["dry_run"], both
    assert both["rollout"]["phase"] == "succeeded", both
    assert both["rollout"]["counts"]["succeeded"] == 3 and not both["rollout"]["dry_run"], both
    assert as_yaml.returncode == CliExit.OK, as_yaml.stdout + as_yaml.stderr
    config = yaml.safe_load(as_yaml.stdout)
    assert config["dry_run"]["counts"]["succeeded"] == 3, config
    assert config["rollout"]["spec"]["overrides"] == {"top_k": 7}, config  # the command
    assert refused.returncode == CliExit.FAILED, refused.stdout + refused.stderr
    assert json.loads(refused.stdout)["rollout"] is None, refused.stdout
    for runner in runners:
        assert runner.history == ["init", "v3"]


async def test_markup_in_a_config_value_is_shown_as_it_is(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """``--set 'stop=[/INST]'``: the rollout's verdict (failed: no such key on a fake worker)
    with the value in its title, never exit 5 (rich read ``[/INST]`` as a closing tag)."""
    async with fleet(kafka, tmp_path):
        proc = await asyncio.to_thread(
            cli, kafka, "update-config", "--set", "stop=[/INST]", "--wait"
        )
    assert proc.returncode == CliExit.FAILED, proc.stdout + proc.stderr
    assert "config stop=[/INST]" in proc.stdout, proc.stdout
