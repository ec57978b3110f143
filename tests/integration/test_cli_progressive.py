"""`controlplane targets` and `controlplane rollout ...` as a user runs them (separate processes),
against a real broker, a coordinator's controller and in-process agents (issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.control import ActionKind, ControlPhase, Strategy
from controlplane.wire.exits import CliExit
from tests.integration.test_cli_outage import Cli
from tests.integration.test_progressive import (
    commands_on_the_topic,
    fleet_of,
    workers_commanded,
)

pytestmark = pytest.mark.kafka


def kafka_args(kafka: KafkaSettings) -> list[str]:
    return ["--bootstrap", kafka.bootstrap_servers, "--topic-prefix", kafka.topics.prefix]


async def cli(kafka: KafkaSettings, *args: str, timeout: float = 120.0) -> tuple[int, Cli]:
    process = await Cli.start(*args, *kafka_args(kafka))
    return await process.wait(timeout), process


async def test_a_canary_that_fails_the_probe_gate_is_rolled_back_and_nobody_else_is_touched(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 4) as fleet:
        code, out = await cli(
            kafka,
            "targets",
            "set",
            "tiny",
            "--selector",
            "model=tiny",
            "--weights",
            fleet.weights("v1").path,
            "--version",
            "v1",
        )
        assert code == CliExit.OK, out.err
        # the fake runner scores every "badprobe-*" version far below any sane bound: the
        # checkpoint validates and loads, but its answers are wrong
        code, out = await cli(
            kafka, "rollout", "start", "tiny",
            "--weights", fleet.weights("v1").path, "--version", "badprobe-v2",
            "--canary", "1", "--steps", "100%",
            "--probe-prompt", "the capital of France is", "--probe-min-logprob", "-10",
            "--rollout-id", "r-probe", "--wait", "--json",
        )  # fmt: skip
        assert code == CliExit.ROLLED_BACK, (out.out, out.err)
        body = json.loads(out.out[-1])
        state = body["state"]
        assert state["phase"] == "rolled_back" and state["code"] == "GATE_FAILED"
        assert "probe gate" in state["message"] and "w00" in state["message"]
        assert body["exit_code"] == CliExit.ROLLED_BACK
        commanded = workers_commanded(await commands_on_the_topic(kafka), "r-probe")
        assert commanded == {"w00": ["r-probe.w0.b0", "r-probe.rb.b0"]}  # nobody else
        assert [r.history for r in fleet.runners.values()] == [
            ["v1", "badprobe-v2", "v1"],
            ["v1"],
            ["v1"],
            ["v1"],
        ]
        assert fleet.runners["w00"].probes  # it really ran the probe


async def test_targets_shows_desired_against_actual_and_status_history_undo_work(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 3) as fleet:
        path = fleet.weights("v1").path
        assert (await cli(kafka, "targets", "set", "tiny", "-s", "model=tiny",
                          "--weights", path, "--version", "v1"))[0] == 0  # fmt: skip
        code, out = await cli(kafka, "targets", "--json")
        assert code == 0, out.err
        (tiny,) = json.loads(out.out[-1])
        assert (tiny["name"], tiny["stable_version"], tiny["workers"]) == ("tiny", "v1", 3)
        assert (tiny["at_stable"], tiny["drifting"], tiny["lost"]) == (3, 0, 0)

        code, out = await cli(kafka, "rollout", "start", "tiny", "--weights", path,
                              "--version", "v2", "--rollout-id", "r-v2", "--wait")  # fmt: skip
        assert code == CliExit.OK, (out.out, out.err)
        code, out = await cli(kafka, "targets", "--json")
        (tiny,) = json.loads(out.out[-1])
        assert (tiny["stable_version"], tiny["at_stable"], tiny["rollout"]) == ("v2", 3, None)

        # ended is ended; unknown things are refused with their code (exit 3)
        code, out = await cli(kafka, "rollout", "abort", "r-v2")
        assert code == CliExit.INVALID and "ROLLOUT_ENDED" in out.err[-1]
        code, out = await cli(kafka, "rollout", "promote", "r-nope")
        assert code == CliExit.INVALID and "ROLLOUT_UNKNOWN" in out.err[-1]
        code, out = await cli(kafka, "rollout", "start", "nope", "--weights", path,
                              "--version", "v3")  # fmt: skip
        assert code == CliExit.INVALID and "TARGET_UNKNOWN" in out.err[-1]
        code, out = await cli(kafka, "rollout", "start", "tiny", "--weights", path,
                              "--version", "v3", "--rollout-id", "r-v2")  # fmt: skip
        assert code == CliExit.INVALID and "ROLLOUT_EXISTS" in out.err[-1]

        code, out = await cli(kafka, "rollout", "undo", "tiny", "--wait", "--json")
        assert code == CliExit.OK, (out.out, out.err)
        undo = json.loads(out.out[-1])
        assert undo["spec"]["undo_of"] == "r-v2"
        assert undo["spec"]["desired"]["weights"]["version"] == "v1"
        assert [r.history[-1] for r in fleet.runners.values()] == ["v1"] * 3

        code, out = await cli(kafka, "rollout", "history", "tiny", "--json")
        assert code == 0, out.err
        body = json.loads(out.out[-1])
        stables = [e["desired"]["weights"]["version"] for e in body["stable"]]
        assert stables == ["v1", "v2", "v1"]
        assert [r["state"]["phase"] for r in body["rollouts"]] == ["succeeded", "succeeded"]
        code, out = await cli(kafka, "rollout", "status", "r-v2")
        assert code == CliExit.OK and any("r-v2" in line for line in out.out)


async def test_a_second_rollout_while_one_runs_is_target_busy_and_abort_without_rollback_exits_7(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 2) as fleet:
        await fleet.target()
        await fleet.rollout("r-held", "v2", Strategy(canary=1, pause="manual"))
        await fleet.phase("r-held", ControlPhase.PAUSED)
        path = fleet.weights("v3").path
        code, out = await cli(kafka, "rollout", "start", "tiny", "--weights", path,
                              "--version", "v3")  # fmt: skip
        assert code == CliExit.INVALID and "TARGET_BUSY" in out.err[-1]
        waiter = await Cli.start("rollout", "status", "r-held", "--wait", *kafka_args(kafka))
        code, out = await cli(kafka, "rollout", "abort", "r-held", "--no-rollback")
        assert code == CliExit.OK, out.err
        assert await waiter.wait() == CliExit.ABORTED, (waiter.out, waiter.err)
        assert fleet.rollout_of("r-held").abort is not None
        assert fleet.rollout_of("r-held").count(ActionKind.ABORT) == 1
        # without rollback the canary keeps what it applied: held, shown drifting, not synced
        assert [r.history[-1] for r in fleet.runners.values()] == ["v2", "v1"]
        code, out = await cli(kafka, "targets", "--json")
        (tiny,) = json.loads(out.out[-1])
        alignment = {m["worker_id"]: m["alignment"] for m in tiny["members"]}
        assert alignment == {"w00": "drifting", "w01": "in_sync"}
        assert (tiny["drifting"], tiny["at_stable"]) == (1, 1)
        assert fleet.runners["w00"].history == ["v1", "v2"]


async def test_targets_rollout_status_and_history_take_o_table_wide_json_yaml(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """``-o table|wide|json|yaml`` as on every other command (``--json`` kept: the same data as
    ``-o json``)."""
    import yaml

    async with fleet_of(kafka, tmp_path, 2) as fleet:
        await fleet.target()
        await fleet.rollout("r-held", "v2", Strategy(canary=1, pause="manual"))
        await fleet.phase("r-held", ControlPhase.PAUSED)
        for args in (["targets"], ["rollout", "status"], ["rollout", "status", "r-held"],
                     ["rollout", "history", "tiny"]):  # fmt: skip
            code, as_json = await cli(kafka, *args, "-o", "json")
            assert code == CliExit.OK, (args, as_json.out, as_json.err)
            expected = shape(json.loads(as_json.out[-1]))
            code, alias = await cli(kafka, *args, "--json")
            assert code == CliExit.OK and shape(json.loads(alias.out[-1])) == expected
            code, as_yaml = await cli(kafka, *args, "-o", "yaml")
            assert code == CliExit.OK, (args, as_yaml.out, as_yaml.err)
            assert shape(yaml.safe_load("\n".join(as_yaml.out))) == expected, args
            for shown in ("table", "wide"):
                code, table = await cli(kafka, *args, "-o", shown)
                assert code == CliExit.OK, (args, table.out, table.err)
                assert any(("tiny" if args == ["targets"] else "r-held") in ln for ln in table.out)
        code, out = await cli(kafka, "targets", "-o", "yaml")
        (tiny,) = yaml.safe_load("\n".join(out.out))
        assert (tiny["name"], tiny["rollout"]["rollout_id"]) == ("tiny", "r-held"), tiny


def shape(doc: object) -> object:
    """A document's fields, nested, without their values (heartbeat times differ each read)."""
    if isinstance(doc, dict):
        return {k: shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [shape(v) for v in doc]
    return type(doc).__name__ if doc is not None else None
