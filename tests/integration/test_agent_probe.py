"""The probe after a reload, through a real broker: a reload command that asks for one gets a
succeeded ack whose ``result["probe"]`` the coordinator reads (either decoder); one that does
not ask has none. On the fake runner, and on two torch workers that must agree."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.ack_codec import decode_ack_fast
from controlplane.wire.messages import ProbeSpec
from controlplane.wire.protocol import Ack, AckState, Command, ReloadWeightsSpec, encode
from tests.factories import agent_running, agent_settings, running_agent
from tests.fleet import Tail, acks_tail, has_terminal, make_command, publish, settled, terminal
from workers.runners.fake_runner import FakeRunner, fake_probe

pytestmark = pytest.mark.kafka

PROBE = ProbeSpec(prompt="The capital of France is", max_tokens=6)


def reload_with(path: Path, version: str, probe: ProbeSpec | None) -> Command:
    return make_command(ReloadWeightsSpec(path=str(path), version=version, probe=probe))


async def final_ack(
    kafka: KafkaSettings, acks: Tail, path: Path, version: str, probe: ProbeSpec | None
) -> Ack:
    command = reload_with(path, version, probe)
    await settled(kafka, acks, command)
    (ack,) = terminal(acks.items, command.command_id)
    assert ack.state is AckState.SUCCEEDED, ack.error
    assert ack.weights_version == version  # the weights are applied, whatever the probe said
    # The coordinator's fast decoder reads the same result.
    assert decode_ack_fast(encode(ack)).result == ack.result
    return ack


async def test_the_succeeded_ack_carries_the_probe_only_when_asked(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = FakeRunner({})
    path = weights / "model.safetensors"
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        asked = await final_ack(kafka, acks, path, "v2", PROBE)
        assert asked.result["probe"] == fake_probe("v2", PROBE.prompt, 6).as_dict()
        assert asked.result["bytes"] == 64  # the reload's own facts are still there
        silent = await final_ack(kafka, acks, path, "v3", None)
        assert "probe" not in silent.result
        bad = await final_ack(kafka, acks, path, "badprobe-v4", PROBE)
        assert bad.result["probe"] == fake_probe("badprobe-v4", PROBE.prompt, 6, bad=True).as_dict()
        failed = await final_ack(kafka, acks, path, "probefail-v5", PROBE)
        assert failed.result["probe"] == {
            "error": {
                "code": "RUNNER_FAILED",
                "message": "scripted probe failure for 'probefail-v5'",
            }
        }
    assert runner.probes == [
        ("v2", PROBE.prompt, 6),
        ("badprobe-v4", PROBE.prompt, 6),
        ("probefail-v5", PROBE.prompt, 6),
    ]


async def test_two_torch_workers_on_the_same_weights_probe_alike(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    from workers.demo.checkpoints import write_checkpoint
    from workers.runners.torch_runner import TorchRunner

    tiny = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq": 16}
    root = tmp_path / "ckpts"
    root.mkdir()
    seed1 = write_checkpoint(root / "seed1", model_kwargs=tiny, seed=1)
    seed0 = write_checkpoint(root / "seed0", model_kwargs=tiny, seed=0)
    reference = TorchRunner({"model_kwargs": tiny, "seed": 1})
    reference.load()
    expected = reference.probe(PROBE.prompt, PROBE.max_tokens)
    assert expected is not None
    async with contextlib.AsyncExitStack() as stack:
        runners = [TorchRunner({"model_kwargs": tiny, "seed": 0}) for _ in range(2)]
        for runner in runners:
            stack.callback(runner.close)
            runner.load()
        for n in (1, 2):
            settings = agent_settings(
                kafka, tmp_path, worker_id=f"t{n}", state_dir=tmp_path / f"state{n}"
            )
            await stack.enter_async_context(agent_running(settings, runners[n - 1]))
        acks = await stack.enter_async_context(acks_tail(kafka))
        command = reload_with(seed1, "seed1", PROBE)
        await publish(kafka, command)
        await acks.until(has_terminal(command.command_id, 2))
        done = terminal(acks.items, command.command_id)
        assert sorted(a.worker_id for a in done) == ["t1", "t2"]
        assert all(a.state is AckState.SUCCEEDED for a in done)
        assert [a.result["probe"] for a in done] == [expected.as_dict()] * 2
        back = reload_with(seed0, "seed0", PROBE)
        await publish(kafka, back)
        await acks.until(has_terminal(back.command_id, 2))
        again = terminal(acks.items, back.command_id)
        assert again[0].result["probe"] == again[1].result["probe"] != expected.as_dict()
