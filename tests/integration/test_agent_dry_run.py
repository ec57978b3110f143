"""Dry runs (``Command.dry_run``, docs/wire.md "Dry runs") through a real broker and real agents:
each worker checks what the command would check and changes nothing.

Two torch workers: a good checkpoint validates on both (its facts in the ack, the version in
force unchanged, the weights bit for bit as before), a checkpoint of the wrong shape is rejected
WEIGHTS_SHAPE_MISMATCH on both, a path outside the roots PATH_NOT_ALLOWED, a bad config value
CONFIG_VALUE_INVALID. The fake runner: a dry run never enters the journal's applied state, a
restart re-applies only what was applied, a duplicate is a duplicate, and a runner that cannot
check without applying refuses the dry run.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    CommandSpec,
    ReloadWeightsSpec,
    UpdateConfigSpec,
)
from tests.factories import agent_running, agent_settings, running_agent
from tests.fleet import Tail, acks_tail, has_terminal, make_command, publish, settled, terminal
from tests.integration.conftest import RecordingRunner
from workers.agent.journal import JOURNAL_NAME
from workers.demo.checkpoints import BrokenKind, sha256_manifest, write_broken, write_checkpoint
from workers.runners.fake_runner import FakeRunner
from workers.runners.torch_runner import TorchRunner

pytestmark = pytest.mark.kafka

TINY = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq": 16}


def dry(spec: CommandSpec, **kw: Any) -> Command:
    return make_command(spec, dry_run=True, **kw)


def weights_of(runner: TorchRunner) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in runner._targets.items()}


async def outcome(kafka: KafkaSettings, acks: Tail, command: Command, n: int) -> list[Ack]:
    """Publish ``command``; its ``n`` terminal acks, by worker id. Every ack of it says
    ``dry_run`` (accepted and running too)."""
    await publish(kafka, command)
    await acks.until(has_terminal(command.command_id, n))
    mine = [a for a in acks.items if a.command_id == command.command_id]
    assert all(a.result.get("dry_run") is True for a in mine), mine
    return sorted(terminal(acks.items, command.command_id), key=lambda a: a.worker_id)


async def test_torch_workers_validate_a_good_checkpoint_and_reject_a_wrong_one(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    good = write_checkpoint(root / "good", model_kwargs=TINY, seed=1, shards=2)
    broken = write_broken(BrokenKind.SHAPE, root / "shape", model_kwargs=TINY, seed=1)
    async with contextlib.AsyncExitStack() as stack:
        runners = [TorchRunner({"model_kwargs": TINY, "seed": 0}) for _ in range(2)]
        for runner in runners:
            stack.callback(runner.close)
            runner.load()
        for n, runner in enumerate(runners, 1):
            settings = agent_settings(
                kafka, tmp_path, worker_id=f"t{n}", state_dir=tmp_path / f"state{n}"
            )
            await stack.enter_async_context(agent_running(settings, runner))
        acks = await stack.enter_async_context(acks_tail(kafka))
        before = [weights_of(r) for r in runners]
        digests = [r.describe().extra["weights_digest"] for r in runners]

        spec = ReloadWeightsSpec(path=str(good), version="v2", sha256=sha256_manifest(good))
        validated = await outcome(kafka, acks, dry(spec), 2)
        assert [a.worker_id for a in validated] == ["t1", "t2"]
        for ack in validated:
            assert ack.state is AckState.SUCCEEDED, ack.error
            assert ack.weights_version == "init"  # the version in force, unchanged
            assert ack.result["files"] == 2 and ack.result["sha256"] is True
            assert ack.result["tensors"] == len(before[0])

        wrong = ReloadWeightsSpec(path=str(broken.path), version="v3")
        rejected = await outcome(kafka, acks, dry(wrong), 2)
        for ack in rejected:
            assert ack.state is AckState.REJECTED
            assert ack.error is not None and ack.error.code == "WEIGHTS_SHAPE_MISMATCH"
            assert ack.weights_version == "init"

        outside = ReloadWeightsSpec(path=str(tmp_path / "elsewhere.safetensors"), version="v4")
        for ack in await outcome(kafka, acks, dry(outside), 2):
            assert ack.state is AckState.REJECTED
            assert ack.error is not None and ack.error.code == "PATH_NOT_ALLOWED"

        config = await outcome(kafka, acks, dry(UpdateConfigSpec(overrides={"top_k": 4})), 2)
        assert [(a.state, a.result["keys"]) for a in config] == [
            (AckState.SUCCEEDED, ["top_k"])
        ] * 2
        bad_config = await outcome(kafka, acks, dry(UpdateConfigSpec(overrides={"top_k": -1})), 2)
        assert [a.error.code if a.error else None for a in bad_config] == [
            "CONFIG_VALUE_INVALID"
        ] * 2

        for runner, held, digest in zip(runners, before, digests, strict=True):
            described = runner.describe()
            assert (described.weights_version, described.degraded) == ("init", None)
            assert described.extra["weights_digest"] == digest
            assert described.config["top_k"] == 0
            now = weights_of(runner)
            assert all(torch.equal(now[name], held[name]) for name in held)

        # The real command of the good checkpoint then applies on both.
        real = make_command(spec)
        await publish(kafka, real)
        await acks.until(has_terminal(real.command_id, 2))
        assert {a.weights_version for a in terminal(acks.items, real.command_id)} == {"v2"}


def journal_entries(state_dir: Path) -> list[dict[str, Any]]:
    (journal,) = state_dir.glob(f"*/{JOURNAL_NAME}")  # the worker's own directory
    lines = journal.read_text().splitlines()
    return [json.loads(line) for line in lines if line]


async def test_a_dry_run_never_enters_the_journals_applied_state(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    """Applied v2, then dry runs of v3 (validated) and badshape-v4 (rejected): the journal's
    applied state is v2 alone, a restart restores v2 and nothing else, and the dry run
    delivered again is a duplicate (its ack not sent again, the runner not asked again)."""
    path = str(weights / "model.safetensors")
    first = FakeRunner({})
    applied = make_command(ReloadWeightsSpec(path=path, version="v2"))
    check = dry(ReloadWeightsSpec(path=path, version="v3"))
    refused = dry(ReloadWeightsSpec(path=path, version="badshape-v4"))
    config = dry(UpdateConfigSpec(overrides={"top_k": 9}))
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, first):
            await settled(kafka, acks, applied)
            (ok,) = await outcome(kafka, acks, check, 1)
            assert (ok.state, ok.weights_version, ok.result["bytes"]) == (
                AckState.SUCCEEDED,
                "v2",
                64,
            )
            (no,) = await outcome(kafka, acks, refused, 1)
            assert no.state is AckState.REJECTED and no.error is not None
            assert no.error.code == "WEIGHTS_SHAPE_MISMATCH" and no.weights_version == "v2"
            (cfg,) = await outcome(kafka, acks, config, 1)
            assert cfg.state is AckState.SUCCEEDED and cfg.result["keys"] == ["top_k"]
        assert first.history == ["init", "v2"]
        assert [s.version for s in first.validations] == ["v3", "badshape-v4"]
        assert first.config_updates == [] and first.describe().config["top_k"] == 0
        entries = journal_entries(tmp_path / "state")
        assert [e["spec"]["version"] for e in entries if e["t"] == "weights"] == ["v2"]
        assert [e for e in entries if e["t"] == "config"] == []
        outcomes = {e["ack"]["command_id"] for e in entries if e["t"] == "outcome"}
        assert {check.command_id, refused.command_id, config.command_id} <= outcomes

        second = FakeRunner({})
        async with running_agent(kafka, tmp_path, second):
            marker = make_command(ReloadWeightsSpec(path=path, version="v5"))
            await publish(kafka, check, marker)  # the dry run again: a duplicate
            await acks.until(has_terminal(marker.command_id))
        assert second.history == ["init", "v2", "v5"]  # v2 restored; v3 never
        assert second.validations == []
        assert len(terminal(acks.items, check.command_id)) == 1


async def test_a_runner_that_cannot_check_refuses_a_dry_run_and_applies_nothing(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()  # no validate_reload: it could only check by applying
    command = dry(ReloadWeightsSpec(path=str(weights / "model.safetensors"), version="v2"))
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        (ack,) = await outcome(kafka, acks, command, 1)
    assert ack.state is AckState.FAILED and ack.error is not None
    assert ack.error.code == "RUNNER_FAILED" and "dry run refused" in ack.error.message
    assert runner.applied == []
