"""The reload spec's drain and cache policies on the wire (issue 14): omitted when not given,
so a worker built before them (whose schema forbids unknown fields) still reads every command
that does not ask; round-tripped when given; reachable from the CLI and the API body."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from typer.testing import CliRunner

from controlplane.api.models import parse_rollout_request
from controlplane.cli import main as cli_main  # registers the commands
from controlplane.cli import rollout as cli_rollout
from controlplane.cli.common import app
from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.exits import CliExit
from controlplane.wire.messages import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_MODES,
    MAX_DRAIN_TIMEOUT_S,
    DrainMode,
    DrainPolicy,
)
from controlplane.wire.protocol import ReloadWeightsSpec, decode_command, encode
from controlplane.wire.schema_export import SCHEMA_DIR
from tests.unit.conftest import reload_command

assert cli_main  # imported for its side effect

NEW_FIELDS = ("drain", "reset_cache")


def older_worker_schema() -> dict[str, Any]:
    """The command schema of a worker built before drain policies: today's, without them."""
    schema: dict[str, Any] = json.loads((SCHEMA_DIR / "command.json").read_text())
    spec = schema["$defs"]["ReloadWeightsSpec"]
    for name in NEW_FIELDS:
        del spec["properties"][name]
    assert spec["additionalProperties"] is False  # what makes an unknown field fatal
    return schema


def test_a_spec_without_them_encodes_without_them() -> None:
    command = reload_command()
    wire = json.loads(encode(command))
    assert not set(NEW_FIELDS) & set(wire["spec"])
    jsonschema.validate(wire, older_worker_schema())  # an older worker reads it
    spec = decode_command(encode(command)).spec
    assert isinstance(spec, ReloadWeightsSpec)
    assert (spec.drain, spec.reset_cache) == (None, None)
    assert spec.drain_policy == DrainPolicy(mode="wait", timeout_s=DEFAULT_DRAIN_TIMEOUT_S)
    assert spec.resets_cache is True


@pytest.mark.parametrize("mode", DRAIN_MODES)
@pytest.mark.parametrize("reset_cache", [True, False])
def test_given_they_round_trip(mode: DrainMode, reset_cache: bool) -> None:
    spec = ReloadWeightsSpec(
        path="/ckpts/v2",
        version="v2",
        drain=DrainPolicy(mode=mode, timeout_s=2.5),
        reset_cache=reset_cache,
    )
    command = reload_command(spec=spec)
    wire = json.loads(encode(command))
    assert wire["spec"]["drain"] == {"mode": mode, "timeout_s": 2.5}
    assert wire["spec"]["reset_cache"] is reset_cache
    back = decode_command(encode(command))
    assert back == command
    assert isinstance(back.spec, ReloadWeightsSpec) and back.spec.resets_cache is reset_cache
    # What an older worker would refuse: hence written only when asked for.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wire, older_worker_schema())


def test_an_empty_drain_object_is_the_default_policy() -> None:
    raw = json.loads(encode(reload_command()))
    raw["spec"]["drain"] = {}
    spec = decode_command(json.dumps(raw).encode()).spec
    assert isinstance(spec, ReloadWeightsSpec)
    assert spec.drain_policy == DrainPolicy()
    assert (spec.drain_policy.mode, spec.drain_policy.timeout_s) == ("wait", 60.0)


@pytest.mark.parametrize(
    "drain",
    [
        {"mode": "pause"},
        {"timeout_s": 0},
        {"timeout_s": -1},
        {"timeout_s": MAX_DRAIN_TIMEOUT_S + 1},
        {"timeout_s": "5"},
        {"mode": "wait", "deadline": 5},
    ],
)
def test_a_bad_drain_policy_is_schema_invalid(drain: dict[str, Any]) -> None:
    raw = json.loads(encode(reload_command()))
    raw["spec"]["drain"] = drain
    with pytest.raises(ProtocolError) as caught:
        decode_command(json.dumps(raw).encode())
    assert caught.value.code is WireCode.SCHEMA_INVALID


def test_the_cli_modes_are_the_wire_modes() -> None:
    assert get_args(DrainMode) == DRAIN_MODES == tuple(cli_rollout.DrainChoice)


# --------------------------------------------------------------------------- the CLI


def reload_spec_from_cli(monkeypatch: pytest.MonkeyPatch, *flags: str) -> ReloadWeightsSpec:
    """The spec ``controlplane reload-weights`` makes from ``flags`` (nothing published)."""
    made: list[ReloadWeightsSpec] = []

    def roll_out(make_spec: Callable[[], ReloadWeightsSpec], **_: Any) -> None:
        made.append(make_spec())

    monkeypatch.setattr(cli_rollout, "_roll_out", roll_out)
    args = ["reload-weights", "/ckpts/v2", "--version", "v2", "--all", *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(made) == 1
    return made[0]


def test_cli_flags_reach_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = reload_spec_from_cli(
        monkeypatch, "--drain", "abort", "--drain-timeout", "7.5", "--no-reset-cache"
    )
    assert spec.drain == DrainPolicy(mode="abort", timeout_s=7.5)
    assert spec.reset_cache is False
    assert reload_spec_from_cli(monkeypatch, "--drain", "keep").drain == DrainPolicy(mode="keep")
    assert reload_spec_from_cli(monkeypatch, "--drain-timeout", "3").drain == DrainPolicy(
        timeout_s=3
    )


def test_cli_without_the_flags_writes_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = reload_spec_from_cli(monkeypatch)
    assert (spec.drain, spec.reset_cache) == (None, None)
    assert not set(NEW_FIELDS) & set(json.loads(encode(reload_command(spec=spec)))["spec"])


def invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_cli_bad_drain_flags_are_refused_before_any_kafka() -> None:
    base = ["reload-weights", "/ckpts/v2", "--version", "v2", "--all"]
    code, out = invoke([*base, "--drain-timeout", "0", "--bootstrap", "127.0.0.1:1"])
    assert code == 3 and "SCHEMA_INVALID" in out
    code, out = invoke([*base, "--drain", "pause"])
    assert code == CliExit.USAGE and "--drain" in out  # usage error, the choices listed


# --------------------------------------------------------------------------- the API body


def test_the_api_body_takes_them_through_the_spec_model() -> None:
    body = {
        "kind": "reload_weights",
        "path": "/ckpts/v2",
        "version": "v2",
        "selector": {"labels": {"model": "tiny"}},
        "drain": {"mode": "abort", "timeout_s": 5},
        "reset_cache": False,
    }
    spec, _ = parse_rollout_request(json.dumps(body).encode())
    assert isinstance(spec, ReloadWeightsSpec)
    assert spec.drain == DrainPolicy(mode="abort", timeout_s=5)
    assert spec.reset_cache is False
    del body["drain"], body["reset_cache"]
    spec, _ = parse_rollout_request(json.dumps(body).encode())
    assert isinstance(spec, ReloadWeightsSpec) and (spec.drain, spec.reset_cache) == (None, None)


def test_the_docs_example_is_a_valid_spec() -> None:
    """docs/wire.md's example of the two fields is what the decoder reads."""
    text = (Path(__file__).parents[2] / "docs" / "wire.md").read_text()
    section = text.split("## Drain and cache policy", 1)[1]
    example = section.split("```json", 1)[1].split("```", 1)[0]
    spec = ReloadWeightsSpec.model_validate_json(example, strict=True)
    assert spec.drain == DrainPolicy(mode="wait", timeout_s=30) and spec.reset_cache is True
