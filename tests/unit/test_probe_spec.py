"""A reload's optional probe on the wire: its bounds, and a command without one unchanged.

Workers built before probes existed decode commands with ``extra="forbid"``: a command that asks
for no probe must encode exactly as it did before the field existed (no ``"probe": null``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.messages import MAX_PROBE_PROMPT_CHARS, MAX_PROBE_TOKENS, ProbeSpec
from controlplane.wire.protocol import ReloadWeightsSpec, decode_command, encode, json_schemas
from tests.unit.conftest import command_dict, reload_command

#: reload_command() as the encoder wrote it before ReloadWeightsSpec had a probe field.
BEFORE_PROBES = (
    b'{"schema_version":1,"command_id":"cmd-1","rollout_id":"rollout-1",'
    b'"issued_at":"2025-06-01T12:00:00Z","expires_at":"2025-06-01T13:00:00Z",'
    b'"issuer":"ci@example","selector":{"worker_ids":null,"labels":{}},'
    b'"spec":{"kind":"reload_weights","path":"/ckpt/v42","version":"v42","sha256":{},'
    b'"strict":true},"timeout_s":null,"signature":null}'
)
SCHEMA = Draft202012Validator(json_schemas()["command"])


def with_probe(probe: Any) -> dict[str, Any]:
    return command_dict(
        spec={"kind": "reload_weights", "path": "/ckpt", "version": "v1", "probe": probe}
    )


def test_a_command_without_a_probe_encodes_as_before_probes_existed() -> None:
    assert encode(reload_command()) == BEFORE_PROBES
    assert encode(decode_command(BEFORE_PROBES)) == BEFORE_PROBES
    explicit_none = reload_command(spec=ReloadWeightsSpec(path="/ckpt/v42", version="v42"))
    assert explicit_none.spec.probe is None  # type: ignore[union-attr]
    assert encode(explicit_none) == BEFORE_PROBES


def test_a_spec_without_a_probe_dumps_without_the_key() -> None:
    """The journal stores the applied spec with model_dump: no key there either."""
    spec = ReloadWeightsSpec(path="/ckpt", version="v1")
    assert "probe" not in spec.model_dump(mode="json")
    assert ReloadWeightsSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_a_probe_round_trips_with_its_default_token_count() -> None:
    probe = ProbeSpec(prompt="The capital of France is")
    assert probe.max_tokens == 8
    command = reload_command(spec=ReloadWeightsSpec(path="/ckpt", version="v1", probe=probe))
    data = encode(command)
    assert json.loads(data)["spec"]["probe"] == {
        "prompt": "The capital of France is",
        "max_tokens": 8,
    }
    assert decode_command(data) == command
    assert list(SCHEMA.iter_errors(json.loads(data))) == []
    spec = ReloadWeightsSpec(path="/ckpt", version="v1", probe=probe)
    assert ReloadWeightsSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_an_explicit_null_probe_is_no_probe() -> None:
    data = json.dumps(with_probe(None)).encode()
    assert list(SCHEMA.iter_errors(json.loads(data))) == []
    command = decode_command(data)
    assert command.spec.probe is None  # type: ignore[union-attr]
    assert "probe" not in json.loads(encode(command))["spec"]


@pytest.mark.parametrize(
    "probe",
    [
        {"prompt": "x", "max_tokens": 1},
        {"prompt": "x", "max_tokens": MAX_PROBE_TOKENS},
        {"prompt": "é" * MAX_PROBE_PROMPT_CHARS},
    ],
    ids=["one-token", "most-tokens", "longest-prompt"],
)
def test_probes_at_the_bounds_are_accepted(probe: dict[str, Any]) -> None:
    instance = with_probe(probe)
    assert list(SCHEMA.iter_errors(instance)) == []
    decoded = decode_command(json.dumps(instance).encode()).spec.probe  # type: ignore[union-attr]
    assert decoded == ProbeSpec(**probe)


@pytest.mark.parametrize(
    "probe",
    [
        {"prompt": ""},
        {"prompt": "x" * (MAX_PROBE_PROMPT_CHARS + 1)},
        {"max_tokens": 4},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": MAX_PROBE_TOKENS + 1},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "max_tokens": "8"},
        {"prompt": 42},
        {"prompt": "x", "temperature": 0.0},
        "x",
    ],
    ids=[
        "empty-prompt",
        "prompt-too-long",
        "no-prompt",
        "zero-tokens",
        "too-many-tokens",
        "tokens-as-bool",
        "tokens-as-string",
        "prompt-not-text",
        "unknown-field",
        "not-an-object",
    ],
)
def test_bad_probes_are_refused_by_schema_and_decoder(probe: Any) -> None:
    instance = with_probe(probe)
    assert list(SCHEMA.iter_errors(instance)), "the command schema accepted it"
    with pytest.raises(ProtocolError) as caught:
        decode_command(json.dumps(instance).encode())
    assert caught.value.code is WireCode.SCHEMA_INVALID
    assert "probe" in caught.value.message
    assert caught.value.command_id == "cmd-42"  # a worker can NACK it


def test_a_float_token_count_is_refused_by_the_decoder() -> None:
    """JSON Schema calls 8.0 an integer; the strict decoder, like everywhere else, does not."""
    with pytest.raises(ProtocolError) as caught:
        decode_command(json.dumps(with_probe({"prompt": "x", "max_tokens": 8.0})).encode())
    assert caught.value.code is WireCode.SCHEMA_INVALID


@pytest.mark.parametrize(
    "fields",
    [{"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 65}],
)
def test_a_probe_out_of_bounds_cannot_be_built(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ProbeSpec(**fields)
