"""Ctrl-C (SIGINT) while `controlplane ... --wait` or `status --watch` follows a rollout: exit
130 (the shell's convention, never 1, which CI reads as "failed") and one line saying the
rollout goes on and how to look at it. Real broker, a real agent whose reload takes minutes,
the installed `controlplane` as a user runs it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.exits import CliExit
from tests.factories import agent_running, agent_settings
from tests.integration.test_cli_usage import ENTRY, REPO
from workers.runners.fake_runner import FakeRunner

pytestmark = pytest.mark.kafka

#: A progress line of ``--wait`` / ``--watch`` (stderr): the command is following the rollout.
PROGRESS = re.compile(r"^\[\d\d:\d\d:\d\d\] (r-\S+) \w+: \d+/\d+ done")


def interrupted(
    settings: KafkaSettings, *args: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run `controlplane ARGS`; once it printed a progress line (it is waiting), SIGINT it.
    The finished process and the rollout id of that line."""
    where = ("--bootstrap", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix)
    proc = subprocess.Popen(
        [str(ENTRY), *args, *where],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "120", "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    seen: list[str] = []
    rollout_id = None
    for line in proc.stderr:  # until the command says it follows the rollout
        seen.append(line)
        match = PROGRESS.match(line)
        if match:
            rollout_id = match.group(1)
            break
    assert rollout_id is not None, "".join(seen)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err), (
        rollout_id
    )


class HeldRunner(FakeRunner):
    """A fake runner whose reload waits until the test lets it go: the rollout is in progress
    for as long as the test needs."""

    def __init__(self) -> None:
        super().__init__({})
        self.release = threading.Event()

    def reload_weights(self, spec: Any, path: Path, *, cancel: Any = None) -> Any:
        self.release.wait()
        return super().reload_weights(spec, path, cancel=cancel)


async def test_ctrl_c_while_waiting_exits_130_and_says_the_rollout_goes_on(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    path = str(weights / "model.safetensors")
    held = HeldRunner()
    async with agent_running(agent_settings(kafka, tmp_path), held):
        try:
            waiting, rollout_id = await asyncio.to_thread(
                interrupted, kafka, "reload-weights", path, "--version", "v2", "-s", "model=tiny",
                "--wait",
            )  # fmt: skip
            watching, watched = await asyncio.to_thread(
                interrupted, kafka, "status", rollout_id, "--watch"
            )
        finally:
            held.release.set()
    for proc in (waiting, watching):
        assert proc.returncode == CliExit.INTERRUPTED, proc.stdout + proc.stderr
        assert proc.stderr.splitlines()[-1] == (
            f"interrupted; the rollout goes on: controlplane status {rollout_id}"
        ), proc.stderr
        assert "Traceback" not in proc.stderr
    assert watched == rollout_id
    assert int(CliExit.INTERRUPTED) == 130  # the shell's 128 + SIGINT
