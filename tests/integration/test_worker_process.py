"""Worker agents as real processes: crash safety under SIGKILL, draining under SIGTERM, one
agent per state directory.

No sleeps and no clock readings: every step waits for what it needs (a heartbeat, an ack, the
process's exit), with a generous deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import AckState, ReloadWeightsSpec, Selector, WorkerStatus
from tests.factories import worker_argv
from tests.fleet import (
    acks_tail,
    has_terminal,
    heartbeats_tail,
    latest,
    make_command,
    publish,
    settled,
    terminal,
)
from workers.cli import EXIT_STATE_DIR_LOCKED

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


class WorkerProcess:
    def __init__(
        self,
        kafka: KafkaSettings,
        tmp_path: Path,
        worker_id: str,
        runner: str,
        options: dict[str, object],
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        self.log = tmp_path / f"{name or worker_id}.log"
        self.cmd = worker_argv(
            worker_id,
            bootstrap=kafka.bootstrap_servers,
            prefix=kafka.topic_prefix,
            state_dir=tmp_path / "state",
            runner=runner,
            options=options,
            allow_root=tmp_path / "ckpts",
            heartbeat_s="0.5",
            labels={"model": "tiny"},
        )
        self.env = {**os.environ, "PJRT_DEVICE": "CPU", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env={**self.env, **(extra_env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def journal(self) -> list[dict[str, object]]:
        path = self.log.parent / "state" / "w1" / "state.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    root.mkdir()
    path = root / "model.safetensors"
    path.write_bytes(b"\0" * 32)
    return path


@pytest.fixture
def worker(kafka: KafkaSettings, tmp_path: Path) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(kafka, tmp_path, "w1", "fake", {})
    yield proc
    proc.stop()


async def _ready(kafka: KafkaSettings) -> None:
    async with heartbeats_tail(kafka) as hbs:
        await hbs.until(
            lambda items: any(h.status is WorkerStatus.READY for h in items), timeout=60
        )


@pytest.mark.parametrize("committed_before", [False, True], ids=["first-commit", "committed"])
@pytest.mark.parametrize("failpoint", ["after_apply", "after_ack"])
async def test_sigkill_between_apply_and_commit_applies_once_and_acks_once(
    kafka: KafkaSettings, ckpt: Path, worker: WorkerProcess, failpoint: str, committed_before: bool
) -> None:
    """The worker dies (SIGKILL, from a failpoint) after applying: before the ack, or after the
    ack and before the commit. Restarted, it neither applies again nor ends with two terminal acks.

    ``after_apply``: the outcome (and the weights it applied) is durable, the ack never left.
    ``after_ack``: the ack left, and the journal has it published and the next offset (Kafka has
    no commit of it). ``committed``: a command for another worker went first and its offset was
    committed to Kafka, so the restart reads the killed command again from Kafka's (stale)
    position and must recognise it; ``first-commit``: no Kafka commit yet, the journal's own
    offset decides where the restart reads from.
    """
    worker.start({"FLEET_FAILPOINTS": f"{failpoint}=kill"})
    await _ready(kafka)
    cmd = make_command(ReloadWeightsSpec(path=str(ckpt), version="v2"))
    if committed_before:  # not for w1: no ack, so no failpoint; only its offset is committed
        other = make_command(
            ReloadWeightsSpec(path=str(ckpt), version="v-other"),
            selector=Selector(worker_ids=["w9"]),
        )
        await publish(kafka, other, cmd)
    else:
        await publish(kafka, cmd)
    assert worker.wait(60) == -signal.SIGKILL
    before_restart = worker.journal()
    worker.start()  # same state directory, no failpoint
    async with acks_tail(kafka) as acks:
        await acks.until(has_terminal(cmd.command_id))
        marker = make_command(ReloadWeightsSpec(path=str(ckpt), version="v3"))
        await settled(kafka, acks, marker)
    finals = terminal(acks.items, cmd.command_id)
    assert len(finals) == 1, finals
    assert finals[0].state is AckState.SUCCEEDED and finals[0].weights_version == "v2"
    # What the journal held when the process died: the outcome and the weights it applied,
    # and, after the ack, the "published" mark and the next offset.
    kinds = [e["t"] for e in before_restart]
    recorded = [
        i
        for i, e in enumerate(before_restart)
        if e["t"] == "outcome" and e["ack"]["command_id"] == cmd.command_id
    ]
    assert len(recorded) == 1, "the outcome was not durable when the process died"
    outcome_at = recorded[0]
    assert "weights" in kinds[:outcome_at] and before_restart[outcome_at]["published"] is False
    after_outcome = before_restart[outcome_at + 1 :]
    cmd_offset = 1 if committed_before else 0
    published = {"t": "published", "id": cmd.command_id}
    if failpoint == "after_apply":  # the ack never left: the restart publishes the recorded one
        assert finals[0].attempt == 2 and finals[0].result.get("replayed") is True
        assert published not in after_outcome
    else:
        assert finals[0].attempt == 1
        assert after_outcome[-2:] == [published, {"t": "offset", "next": cmd_offset + 1}]
    outcomes = [
        e
        for e in worker.journal()
        if e["t"] == "outcome" and e["ack"]["command_id"] == cmd.command_id
    ]
    assert len(outcomes) == 1, "the command was applied (recorded) more than once"
    # Read again after the restart: from Kafka's stale commit, or from the journal's offset
    # when the crash came before the journal had moved past the command.
    redelivered = committed_before or failpoint == "after_apply"
    assert ("duplicate delivery ignored" in worker.log.read_text()) is redelivered


async def test_sigterm_during_a_reload_drains(
    kafka: KafkaSettings, ckpt: Path, worker: WorkerProcess
) -> None:
    # Long enough that the SIGTERM, sent once the reload is seen running, lands during it: the
    # stopping heartbeat below proves it did (it names the command in flight).
    worker.cmd[worker.cmd.index("--runner-options") + 1] = json.dumps({"reload_delay_s": 10.0})
    worker.start()
    await _ready(kafka)
    cmd = make_command(ReloadWeightsSpec(path=str(ckpt), version="v-drain"))
    async with acks_tail(kafka) as acks, heartbeats_tail(kafka) as hbs:
        await publish(kafka, cmd)
        await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGTERM)
        await hbs.until(lambda items: any(h.status is WorkerStatus.STOPPING for h in items))
        assert worker.wait(60) == 0
        await acks.until(has_terminal(cmd.command_id))
        await hbs.until(
            lambda items: (
                latest(items, "w1") is not None
                and latest(items, "w1").status is WorkerStatus.STOPPED
            )
        )
    stopping = next(h for h in hbs.items if h.status is WorkerStatus.STOPPING)
    assert stopping.in_flight is not None and stopping.in_flight.command_id == cmd.command_id
    (final,) = terminal(acks.items, cmd.command_id)
    assert final.state is AckState.SUCCEEDED and final.weights_version == "v-drain"
    last = latest(hbs.items, "w1")
    assert last is not None and last.weights_version == "v-drain" and last.in_flight is None


async def test_sigterm_past_the_drain_timeout_cancels_with_a_coded_ack(
    kafka: KafkaSettings, ckpt: Path, worker: WorkerProcess
) -> None:
    worker.cmd[worker.cmd.index("--runner-options") + 1] = json.dumps({"reload_delay_s": 30.0})
    worker.start({"FLEET_WORKER_DRAIN_TIMEOUT_S": "0.5"})
    await _ready(kafka)
    cmd = make_command(ReloadWeightsSpec(path=str(ckpt), version="v-never"))
    async with acks_tail(kafka) as acks:
        await publish(kafka, cmd)
        await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
        assert worker.proc is not None
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
        await acks.until(has_terminal(cmd.command_id))
    (final,) = terminal(acks.items, cmd.command_id)
    assert final.state is AckState.FAILED
    assert final.error is not None and final.error.code == "WORKER_SHUTTING_DOWN"
    assert final.weights_version == "init"


async def test_a_second_agent_on_the_same_state_dir_exits_with_a_code(
    kafka: KafkaSettings, ckpt: Path, worker: WorkerProcess, tmp_path: Path
) -> None:
    """Two agents with the same id and state directory both applied every command: the second
    now stops before Kafka, with STATE_DIR_LOCKED and its exit code, and the first goes on."""
    worker.start()
    await _ready(kafka)
    second = WorkerProcess(kafka, tmp_path, "w1", "fake", {}, name="w1-second")
    try:
        second.start()
        assert second.wait(60) == EXIT_STATE_DIR_LOCKED
    finally:
        second.stop()
    output = second.log.read_text()
    assert "error: STATE_DIR_LOCKED: " in output and str(tmp_path / "state" / "w1") in output
    assert worker.proc is not None and f"pid {worker.proc.pid}" in output
    assert "Traceback" not in output
    cmd = make_command(ReloadWeightsSpec(path=str(ckpt), version="v2"))
    async with acks_tail(kafka) as acks:
        await settled(kafka, acks, cmd)
    (final,) = terminal(acks.items, cmd.command_id)
    assert final.state is AckState.SUCCEEDED
    # The second agent never touched the journal (it would have counted an incarnation).
    journal = worker.journal()
    assert [e for e in journal if e["t"] == "incarnation"] == [{"t": "incarnation", "n": 1}]
    assert sum(1 for e in journal if e["t"] == "outcome") == 1
