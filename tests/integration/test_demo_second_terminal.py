"""The demo tells a second terminal how to reach what it started (issue 15, Demo): the
``export`` lines it prints (and writes to ``<workdir>/env.sh``) make a plain ``controlplane ...``
in another shell read the demo's broker, topics and coordinator, and the write token is shown.

Real broker (the session's, under a topic prefix that is not the default, as a demo with
FLEET_TOPIC_PREFIX runs) and a real coordinator whose reads need a token.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.api.server import ApiServer
from controlplane.cli.demo import Demo
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.settings import KafkaSettings
from tests.fleet import wait_for
from tests.integration.test_cli_one_rollout import beat

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
TOKEN = "demo-write-token-123"


def second_terminal(script: Path, command: str) -> subprocess.CompletedProcess[str]:
    """``command`` in a fresh bash that has only sourced ``script``: no FLEET_* inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-c", f"source {script} && {command}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_the_printed_exports_make_a_second_terminal_work(
    kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await beat(kafka, ["w-demo"])
    settings = CoordinatorSettings(
        kafka=kafka, api_token=SecretStr(TOKEN), api_read_token=SecretStr("read-only-456")
    )
    coordinator = Coordinator(settings)
    async with coordinator:
        await coordinator.wait_ready(60)
        await wait_for(lambda: "w-demo" in coordinator.fleet.registry, timeout=60)
        async with ApiServer(coordinator, "127.0.0.1", 0, app=create_app(coordinator)) as server:
            demo = Demo(tmp_path / "demo")
            (tmp_path / "demo").mkdir()
            demo.bootstrap = kafka.bootstrap_servers
            demo.env["FLEET_TOPIC_PREFIX"] = kafka.topic_prefix
            script = demo.second_terminal(server.url, TOKEN)
            printed = capsys.readouterr().out
            assert f"export FLEET_KAFKA_BOOTSTRAP={kafka.bootstrap_servers}" in printed
            assert f"export FLEET_TOPIC_PREFIX={kafka.topic_prefix}" in printed
            assert f"export FLEET_API_URL={server.url}" in printed
            assert f"export FLEET_API_TOKEN={TOKEN}" in printed
            assert f"write token: {TOKEN}" in printed
            assert script == tmp_path / "demo" / "env.sh"
            # Through the coordinator (its reads need the token), the loop left free to serve:
            api = await asyncio.to_thread(second_terminal, script, "controlplane workers --json")
            assert api.returncode == 0, api.stderr
            assert [w["worker_id"] for w in json.loads(api.stdout)] == ["w-demo"]
            # From the log (bootstrap and topic prefix), no coordinator asked:
            log = await asyncio.to_thread(
                second_terminal, script, "unset FLEET_API_URL && controlplane workers --json"
            )
            assert log.returncode == 0, log.stderr
            assert [w["worker_id"] for w in json.loads(log.stdout)] == ["w-demo"]


def test_long_export_lines_are_printed_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each line is pasted into a shell: never wrapped at the console's width."""
    demo = Demo(tmp_path)
    demo.bootstrap = "127.0.0.1:39092"
    demo.env["FLEET_SIGNING_KEY"] = str(tmp_path / ("k" * 150) / "demo-ci.pem")
    demo.second_terminal("http://127.0.0.1:8080/", "t0k")
    printed = capsys.readouterr().out
    assert f"export FLEET_SIGNING_KEY={demo.env['FLEET_SIGNING_KEY']}\n" in printed


def test_the_default_topic_prefix_is_not_exported(tmp_path: Path) -> None:
    demo = Demo(tmp_path)
    demo.bootstrap = "127.0.0.1:39092"
    demo.env.pop("FLEET_TOPIC_PREFIX", None)
    lines = demo.exports("http://127.0.0.1:8080/", "t0k")
    assert "export FLEET_KAFKA_BOOTSTRAP=127.0.0.1:39092" in lines
    assert not any("FLEET_TOPIC_PREFIX" in line for line in lines)
    demo.env["FLEET_SIGNING_KEY"] = "/keys/demo-ci.pem"
    demo.env["FLEET_SIGNING_KEY_ID"] = "demo-ci"
    signed = demo.exports("http://127.0.0.1:8080/", "t0k")
    assert "export FLEET_SIGNING_KEY=/keys/demo-ci.pem" in signed  # its rollouts are signed too
    assert "export FLEET_SIGNING_KEY_ID=demo-ci" in signed
