"""Signing from the command line, against a real broker and an agent holding a trust store made
by `controlplane keys generate`: the CLI's signed rollout applies and its unsigned one is
refused; the kcat example of docs/signing.md (``controlplane sign | kcat -P``) applies (with
Debian's kcat where it is installed, else with a stand-in that sends the same bytes through the
same broker with the project's producer)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import AckState, utcnow
from tests.conftest import say
from tests.factories import running_agent
from tests.fleet import acks_tail, terminal
from tests.integration.conftest import RecordingRunner

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "signing.md"


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
    )


def generated(tmp_path: Path) -> tuple[Path, Path]:
    """A key made by the CLI, scoped to model=tiny, and its trust store file."""
    key = tmp_path / "ci.pem"
    made = cli("keys", "generate", str(key), "--key-id", "ci", "--selector", "model=tiny")
    assert made.returncode == 0, made.stderr
    store = tmp_path / "trust.json"
    store.write_text(made.stdout)
    return key, store


def test_keys_generate_writes_a_private_file_and_refuses_to_overwrite(tmp_path: Path) -> None:
    key, store = generated(tmp_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    entry = json.loads(store.read_text())["keys"]["ci"]
    assert entry["scope"] == {"selectors": [{"labels": {"model": "tiny"}}]}
    shown = cli("keys", "show", str(key), "--key-id", "ci", "--selector", "model=tiny")
    assert json.loads(shown.stdout) == json.loads(store.read_text())
    again = cli("keys", "generate", str(key))
    assert again.returncode == 3 and "SETTINGS_INVALID" in again.stderr
    assert "Traceback" not in again.stderr


def test_sign_refuses_what_a_worker_would_refuse_with_its_code(tmp_path: Path) -> None:
    key, _ = generated(tmp_path)
    for text, code in (
        ('{"command_id": "c-1", "command_id": "c-2"}', "DUPLICATE_KEY"),
        ("{", "MALFORMED_JSON"),
        ('{"schema_version": 1, "command_id": "c-1"}', "SCHEMA_INVALID"),
    ):
        proc = cli("sign", "--signing-key", str(key), stdin=text)
        assert proc.returncode == 3 and f"error: {code}:" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""


async def test_the_cli_signs_its_rollouts_and_an_unsigned_one_is_refused(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    """The signed rollout succeeds; the unsigned one is refused by the worker, whose NACK
    names no kind (a forgery's refusal must never count as the real command's outcome): the
    rollout is shown with that NACK as an anomaly and waits (here until --wait-timeout: exit
    2) until the coordinator verifies signatures itself (docs/signing.md, "Not yet")."""
    key, store = generated(tmp_path)
    runner = RecordingRunner()
    where = ("--bootstrap", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix)
    reload = ("reload-weights", str(weights / "model.safetensors"), "-s", "model=tiny")
    async with running_agent(kafka, tmp_path, runner, trust_store=store):
        signed = await asyncio.to_thread(
            cli,
            *reload,
            "--version",
            "v2",
            "--signing-key",
            str(key),
            "--key-id",
            "ci",
            "--wait",
            "--wait-timeout",
            "60",
            *where,
        )
        unsigned = await asyncio.to_thread(
            cli, *reload, "--version", "v3", "--rollout-id", "r-unsigned", *where
        )
        assert unsigned.returncode == 0, unsigned.stdout + unsigned.stderr  # published
        for _ in range(120):  # until the worker's NACK is in the log (a condition, polled)
            shown = await asyncio.to_thread(cli, "status", "r-unsigned", "--json", *where)
            if "SIGNATURE_MISSING" in shown.stdout:
                break
    assert signed.returncode == 0, signed.stdout + signed.stderr
    assert "signed by key ci" in signed.stdout
    status = json.loads(shown.stdout)
    assert status["phase"] == "pending", status  # no worker acked the command it runs
    assert [a["code"] for a in status["anomalies"]] == ["UNREADABLE_COMMAND_NACK"]
    assert "SIGNATURE_MISSING" in status["anomalies"][0]["message"]
    assert runner.applied == ["v2"]


def kcat_example() -> str:
    """The shell lines of docs/signing.md's kcat example (the block after its marker)."""
    text = DOCS.read_text()
    block = text.split("<!-- kcat example: run by tests/integration/test_cli_signing.py -->", 1)[1]
    return block.split("```bash\n", 1)[1].split("```", 1)[0]


#: What the example asks of kcat (``-P -b BOOTSTRAP -t TOPIC -k KEY``, one record a line of
#: stdin), for machines without it.
KCAT_STAND_IN = f"""#!{sys.executable}
import argparse, asyncio, sys
from controlplane.kafka.bus import Producer
from controlplane.kafka.settings import KafkaSettings

parser = argparse.ArgumentParser()
parser.add_argument("-P", action="store_true", required=True)
parser.add_argument("-b", required=True)
parser.add_argument("-t", required=True)
parser.add_argument("-k")
args = parser.parse_args()

async def main() -> None:
    async with Producer(KafkaSettings(bootstrap_servers=args.b)) as producer:
        for line in sys.stdin.buffer.read().splitlines():
            key = None if args.k is None else args.k.encode()
            await producer.send(args.t, line, key=key)

asyncio.run(main())
"""


async def test_the_kcat_example_of_the_docs_is_applied_by_a_signed_worker(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, pytestconfig: pytest.Config
) -> None:
    key, store = generated(tmp_path)
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    if shutil.which("kcat") is None or os.environ.get("FLEET_TEST_KCAT_STAND_IN"):
        stand_in = tmp_path / "bin" / "kcat"
        stand_in.parent.mkdir()
        stand_in.write_text(KCAT_STAND_IN)
        stand_in.chmod(0o755)
        path = f"{stand_in.parent}:{path}"
        say(pytestconfig, "\n[kcat] the docs' example runs with a stand-in for kcat")
    now = utcnow()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLEET_")},
        "PATH": path,
        "BOOTSTRAP": kafka.bootstrap_servers,
        "TOPIC": kafka.topics.commands.name,
        "FLEET_SIGNING_KEY": str(key),
        "FLEET_SIGNING_KEY_ID": "ci",
        "CHECKPOINT": str(weights / "model.safetensors"),
        "ISSUED": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "EXPIRES": (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    runner = RecordingRunner()
    async with (
        running_agent(kafka, tmp_path, runner, trust_store=store),
        acks_tail(kafka) as acks,
    ):
        proc = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-euo", "pipefail", "-c", kcat_example()],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        await acks.until(lambda items: bool(terminal(items, "kcat-v2.c1")))
    (final,) = terminal(acks.items, "kcat-v2.c1")
    assert final.state is AckState.SUCCEEDED and final.weights_version == "kcat-v2"
    assert runner.applied == ["kcat-v2"]
