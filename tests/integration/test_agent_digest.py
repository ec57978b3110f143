"""The weights digest through a real broker: every succeeded reload ack carries
``result["weights_digest"]`` (what the controller's fleet-agreement gate compares, with either
decoder); workers on the same weights agree, a worker whose weights differ does not, and a
failed reload's ack carries none."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.ack_codec import decode_ack_fast
from controlplane.wire.protocol import AckState, ReloadWeightsSpec, encode
from tests.factories import agent_running, agent_settings
from tests.fleet import acks_tail, has_terminal, make_command, publish, terminal
from workers.runners.fake_runner import FakeRunner, fake_weights_digest

pytestmark = pytest.mark.kafka


async def test_succeeded_reload_acks_carry_the_weights_digest(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    path = weights / "model.safetensors"
    runners = {"d1": FakeRunner({}), "d2": FakeRunner({}), "d3": FakeRunner({"digest_salt": "x"})}
    async with contextlib.AsyncExitStack() as stack:
        for worker_id, runner in runners.items():
            settings = agent_settings(
                kafka, tmp_path, worker_id=worker_id, state_dir=tmp_path / f"state-{worker_id}"
            )
            await stack.enter_async_context(agent_running(settings, runner))
        acks = await stack.enter_async_context(acks_tail(kafka))
        command = make_command(ReloadWeightsSpec(path=str(path), version="v2"))
        await publish(kafka, command)
        await acks.until(has_terminal(command.command_id, 3))
        done = {a.worker_id: a for a in terminal(acks.items, command.command_id)}
        assert all(a.state is AckState.SUCCEEDED for a in done.values())
        digests = {w: a.result["weights_digest"] for w, a in done.items()}
        assert digests == {
            "d1": fake_weights_digest("v2"),
            "d2": fake_weights_digest("v2"),
            "d3": fake_weights_digest("v2", "x"),  # the worker that disagrees
        }
        assert digests["d1"] != digests["d3"]
        for ack in done.values():  # the coordinator's fast decoder reads the same result
            assert decode_ack_fast(encode(ack)).result == ack.result
        failing = make_command(ReloadWeightsSpec(path=str(path), version="fail-v3"))
        await publish(kafka, failing)
        await acks.until(has_terminal(failing.command_id, 3))
        failed = terminal(acks.items, failing.command_id)
        assert all(a.state is AckState.FAILED for a in failed)
        assert all("weights_digest" not in (a.result or {}) for a in failed)
