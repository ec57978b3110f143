"""A forged command in a signed fleet does not change what the CLI reports, against a real
broker: whoever can write the commands topic copies a rollout's ids into an unsigned command
issued earlier and pinned to fewer workers (which a fold without a trust store takes for the
rollout). ``--wait`` judges only the command it published; ``status --trust-store`` lists the
forgery as COMMAND_UNVERIFIED beside the real rollout; ``--rollout-id R --trust-store S`` is
not refused because a forgery used R first."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.kafka.bus import Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Selector,
    Timings,
    UpdateConfigSpec,
    decode_command,
    encode,
    utcnow,
)
from controlplane.wire.signing import Signer, private_key_pem, public_key_text
from controlplane.wire.topics import worker_key
from tests.factories import fake_heartbeat, succeeded_acks
from tests.fleet import Tail, make_command, publish

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
WORKERS = ["w1", "w2"]


class Keys:
    """CI's key (``ci``, trusted for config updates) as a PEM file, and the trust store."""

    def __init__(self, tmp_path: Path) -> None:
        self.ci = Signer(Ed25519PrivateKey.generate(), "ci")
        self.pem = tmp_path / "ci.pem"
        self.pem.write_bytes(private_key_pem(self.ci.key))
        self.store = tmp_path / "trust.json"
        entry = {
            "public_key": public_key_text(self.ci.key.public_key()),
            "scope": {"kinds": ["update_config"]},
        }
        self.store.write_text(json.dumps({"keys": {"ci": entry}}))


def argv(kafka: KafkaSettings, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "controlplane",
        *args,
        "--bootstrap",
        kafka.bootstrap_servers,
        "--topic-prefix",
        kafka.topic_prefix,
    ]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}


def cli(kafka: KafkaSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv(kafka, *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env(),
    )


async def beat(kafka: KafkaSettings) -> None:
    async with Producer(kafka) as producer:
        for worker_id in WORKERS:
            hb = fake_heartbeat(worker_id, utcnow(), interval_s=600)
            await producer.send(kafka.topics.workers.name, encode(hb), key=worker_key(worker_id))


def failed_acks(worker_id: str, rollout_id: str, command_id: str) -> list[Ack]:
    """Accepted, then failed: a worker that could not apply the command."""
    now = utcnow()
    return [
        Ack(
            command_id=command_id,
            rollout_id=rollout_id,
            worker_id=worker_id,
            kind=CommandKind.UPDATE_CONFIG,
            state=state,
            timings=Timings(received_at=now, started_at=now, finished_at=now),
            error=None
            if state is AckState.ACCEPTED
            else AckError(code="CONFIG_VALUE_INVALID", message="refused by the runner"),
            sent_at=utcnow(),
        )
        for state in (AckState.ACCEPTED, AckState.FAILED)
    ]


async def send_acks(kafka: KafkaSettings, acks: list[Ack]) -> None:
    async with Producer(kafka) as producer:
        for ack in acks:
            await producer.send(kafka.topics.acks.name, encode(ack), key=worker_key(ack.worker_id))


def forgery_of(real: Command) -> Command:
    """The real command's ids, issued a minute earlier, pinned to w1 only, unsigned."""
    return real.model_copy(
        update={
            "issued_at": real.issued_at - timedelta(minutes=1),
            "selector": Selector(worker_ids=["w1"]),
            "issuer": "mallory",
            "signature": None,
        }
    )


async def read_line(stream: asyncio.StreamReader, needle: str, seen: list[str]) -> bool:
    """Read ``stream`` until a line holds ``needle`` (True) or it ends (False)."""
    while True:
        line = (await stream.readline()).decode()
        if not line:
            return False
        seen.append(line)
        if needle in line:
            return True


@pytest.mark.parametrize("with_store", [False, True], ids=["no-store", "trust-store"])
async def test_wait_judges_the_published_command_not_a_forgery_of_its_ids(
    kafka: KafkaSettings, tmp_path: Path, with_store: bool
) -> None:
    """The real rollout goes to w1 and w2; a forgery of its ids issued earlier names w1 only;
    w1 succeeds, w2 fails: ``--wait`` says failed (exit 1), never succeeded 1/1 (exit 0), and
    says once, while waiting, that it ignored the forgery."""
    keys = Keys(tmp_path)
    await beat(kafka)
    store = ["--trust-store", str(keys.store)] if with_store else []
    proc = await asyncio.create_subprocess_exec(
        *argv(
            kafka,
            "update-config",
            "--set",
            "t=1",
            "--worker",
            "w1",
            "--worker",
            "w2",
            "--rollout-id",
            "r-real",
            "--signing-key",
            str(keys.pem),
            "--key-id",
            "ci",
            *store,
            "--wait",
            "--wait-timeout",
            "120",
        ),
        cwd=REPO,
        env=env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        async with Tail(kafka, kafka.topics.commands.name, decode_command) as commands:
            (real,) = await commands.until(lambda cs: len(cs) == 1)
        assert real.rollout_id == "r-real" and real.signature is not None
        assert real.selector.worker_ids == WORKERS
        await publish(kafka, forgery_of(real))
        await send_acks(kafka, succeeded_acks("w1", "r-real", real.command_id))
        # Before the fix the forgery is the rollout: w1 succeeded is its end (exit 0, and
        # stderr ends without this line).
        seen: list[str] = []
        ignored = await asyncio.wait_for(
            read_line(proc.stderr, f"ignored command {real.command_id}", seen), 120
        )
        if not ignored:
            code = await proc.wait()
            raise AssertionError(f"the CLI ended (exit {code}) judging the forgery: {seen}")
        assert "mallory" in seen[-1]
        await send_acks(kafka, failed_acks("w2", "r-real", real.command_id))
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode() + "".join(seen) + err.decode()
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    assert "failed" in out.decode()


async def signed_and_forged(kafka: KafkaSettings, keys: Keys, rollout_id: str) -> Command:
    """A signed rollout to w1 and w2 (w1 succeeds, w2 fails) and its forgery (w1 only,
    issued earlier), on the topics; the real command."""
    await beat(kafka)
    real = keys.ci.sign(
        make_command(
            UpdateConfigSpec(overrides={"t": 1}),
            rollout_id=rollout_id,
            selector=Selector(worker_ids=WORKERS),
        )
    )
    await publish(kafka, real, forgery_of(real))
    await send_acks(
        kafka,
        [
            *succeeded_acks("w1", rollout_id, real.command_id),
            *failed_acks("w2", rollout_id, real.command_id),
        ],
    )
    return real


async def test_status_with_a_trust_store_shows_the_real_rollout_and_the_forgery_unverified(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """``status R --trust-store S``: the real verdict (failed: exit 1, both workers counted)
    and the forgery as COMMAND_UNVERIFIED (SIGNATURE_MISSING). Without the store the forgery
    is folded with the real command (COMMAND_ID_REUSED), as docs/signing.md says."""
    keys = Keys(tmp_path)
    real = await signed_and_forged(kafka, keys, "r-status")

    trusted = await asyncio.to_thread(
        cli, kafka, "status", "r-status", "--trust-store", str(keys.store), "--json"
    )
    assert trusted.returncode == 1, trusted.stdout + trusted.stderr
    status = json.loads(trusted.stdout)
    assert status["phase"] == "failed"
    assert status["counts"]["succeeded"] == 1 and status["counts"]["failed"] == 1
    assert status["command_id"] == real.command_id
    unverified = [a for a in status["anomalies"] if a["code"] == "COMMAND_UNVERIFIED"]
    assert len(unverified) == 1 and "SIGNATURE_MISSING" in json.dumps(unverified[0])
    assert "COMMAND_ID_REUSED" not in trusted.stdout

    table = await asyncio.to_thread(
        cli, kafka, "status", "r-status", "--trust-store", str(keys.store)
    )
    assert table.returncode == 1 and "COMMAND_UNVERIFIED" in table.stdout, table.stdout

    # The whole log, through FLEET_TRUST_STORE: the same verdict.
    every = await asyncio.to_thread(
        subprocess.run,
        argv(kafka, "status", "--json"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**env(), "FLEET_TRUST_STORE": str(keys.store)},
    )
    assert every.returncode == 0, every.stderr
    (listed,) = json.loads(every.stdout)
    assert listed["phase"] == "failed"

    blind = await asyncio.to_thread(cli, kafka, "status", "r-status", "--json")
    assert "COMMAND_ID_REUSED" in blind.stdout, blind.stdout
    assert "COMMAND_UNVERIFIED" not in blind.stdout
    readers = (REPO / "docs" / "signing.md").read_text().split("## The CLI's readers")[1]
    assert "`--trust-store trust.json` (`FLEET_TRUST_STORE`)" in readers
    assert "`COMMAND_ID_REUSED`" in readers.split("## Not yet")[0]


async def test_a_rollout_id_used_only_by_a_forgery_is_not_taken_under_a_trust_store(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """A forgery published first under R does not make ``--rollout-id R`` ROLLOUT_EXISTS for
    a CLI holding the store (it is without one: it cannot tell); a bad store is exit 3."""
    keys = Keys(tmp_path)
    await beat(kafka)
    forged = make_command(
        UpdateConfigSpec(overrides={"t": 0}),
        rollout_id="r-squat",
        selector=Selector(worker_ids=["w1"]),
    ).model_copy(update={"issuer": "mallory"})
    await publish(kafka, forged)
    common = ["update-config", "--set", "t=1", "--worker", "w1", "--worker", "w2"]
    signed = ["--rollout-id", "r-squat", "--signing-key", str(keys.pem), "--key-id", "ci"]

    blind = await asyncio.to_thread(cli, kafka, *common, *signed)
    assert blind.returncode == 3 and "ROLLOUT_EXISTS" in blind.stderr, blind.stderr

    bad = tmp_path / "bad.json"
    bad.write_text("{")
    broken = await asyncio.to_thread(cli, kafka, *common, *signed, "--trust-store", str(bad))
    assert broken.returncode == 3 and "SETTINGS_INVALID" in broken.stderr, broken.stderr
    assert "Traceback" not in broken.stderr

    # An unsigned command is one the store refuses: not published, this store's code.
    unsigned = await asyncio.to_thread(
        cli, kafka, *common, "--rollout-id", "r-squat", "--trust-store", str(keys.store)
    )
    assert unsigned.returncode == 3 and "SIGNATURE_MISSING" in unsigned.stderr, unsigned.stderr

    taken = await asyncio.to_thread(cli, kafka, *common, *signed, "--trust-store", str(keys.store))
    assert taken.returncode == 0, taken.stderr
    assert "published rollout r-squat" in taken.stdout
    async with Tail(kafka, kafka.topics.commands.name, decode_command) as commands:
        items = await commands.until(lambda cs: len(cs) == 2)
    assert items[0].issuer == "mallory" and items[1].signature is not None
