"""A target's and a progressive rollout's reload policy (drain, cache) reach every command the
controller publishes for them (issue 14): set with the CLI's `targets set` / `rollout start`
flags, carried in the desired state, in each drift sync and each wave's batch command, and
omitted on the wire when not given. Real broker, a coordinator's controller, in-process agents
with the fake runner (tests/integration/test_progressive.py's fleet).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.control import ControlPhase, Strategy
from tests.fleet import wait_for
from tests.integration.test_cli_one_rollout import cli
from tests.integration.test_progressive import fleet_of, read_all

pytestmark = pytest.mark.kafka


async def raw_commands(kafka: KafkaSettings) -> list[dict[str, Any]]:
    """Every command on the topic as written (JSON objects, not decoded models)."""
    records = await read_all(kafka, kafka.topics.commands.name, lambda value: value)
    return [json.loads(value) for value in records]


async def test_the_policy_of_targets_set_and_rollout_start_is_in_every_command(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 4) as fleet:
        ckpt = str(fleet.ckpts / "model.safetensors")
        # The stable state given directly, with a policy: every drifting worker gets a sync.
        done = await asyncio.to_thread(
            cli,
            kafka,
            *("targets", "set", "tiny", "-s", "model=tiny", "--weights", ckpt, "--version"),
            *("v3", "--drain", "abort", "--drain-timeout", "5", "--no-reset-cache"),
        )
        assert done.returncode == 0, done.stderr
        await wait_for(lambda: all(r.history[-1:] == ["v3"] for r in fleet.runners.values()), 60)
        # A progressive rollout with its own policy, to the end.
        done = await asyncio.to_thread(
            cli,
            kafka,
            *("rollout", "start", "tiny", "--weights", ckpt, "--version", "v2"),
            *("--drain", "keep", "--drain-timeout", "9", "--canary", "1", "--steps", "50%,100%"),
            *("--rollout-id", "r-drain", "--wait", "--wait-timeout", "120"),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        # And one without: its commands are written as before drain policies existed.
        await fleet.rollout("r-plain", "v4", Strategy(canary=1))
        assert await fleet.phase("r-plain", ControlPhase.SUCCEEDED) is ControlPhase.SUCCEEDED

        commands = await raw_commands(kafka)
        syncs = [c for c in commands if c["rollout_id"].startswith("sync-")]
        assert sorted(w for c in syncs for w in c["selector"]["worker_ids"]) == sorted(fleet.agents)
        for command in syncs:
            assert command["spec"]["version"] == "v3"
            assert command["spec"]["drain"] == {"mode": "abort", "timeout_s": 5.0}
            assert command["spec"]["reset_cache"] is False
        waves = [c for c in commands if c["rollout_id"].startswith("r-drain.w")]
        assert {c["rollout_id"].split(".")[1] for c in waves} == {"w0", "w1", "w2"}
        for command in waves:
            assert command["spec"]["drain"] == {"mode": "keep", "timeout_s": 9.0}
            assert "reset_cache" not in command["spec"]  # not given: omitted
        plain = [c for c in commands if c["rollout_id"].startswith("r-plain.w")]
        assert plain
        for command in plain:
            assert {"drain", "reset_cache"}.isdisjoint(command["spec"]), command["spec"]
        # The workers ran each command they were sent, in order.
        assert all(r.history[-3:] == ["v3", "v2", "v4"] for r in fleet.runners.values())
        rollout = fleet.rollout_of("r-drain")
        assert rollout.spec.desired.weights is not None
        assert rollout.spec.desired.weights.drain is not None
        assert rollout.spec.desired.weights.drain.mode == "keep"
