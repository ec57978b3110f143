"""One summarizer of validation errors; each caller's message stays what it was, byte for byte."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from pydantic import BaseModel, Field, ValidationError, model_validator

from controlplane.kafka.settings import KafkaSettings, load_settings
from controlplane.wire.errors import ControlPlaneError, ProtocolError
from controlplane.wire.protocol import Heartbeat, decode_command
from controlplane.wire.validation import Location, clip_text, dotted, summarize
from workers.agent import settings as settings_module
from workers.agent.settings import load_worker_settings
from workers.runners.base import parse_options

NOT_INT = "Input should be a valid integer, unable to parse string as an integer"


class _Model(BaseModel):
    a: int
    b: list[int]


def _errors() -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        _Model.model_validate({"a": "x", "b": ["p", "q", "r", "s", "t", "u"]})
    return caught.value


def test_the_default_names_locations_dotted_and_says_how_many_were_left_out() -> None:
    shown = "; ".join(f"{loc}: {NOT_INT}" for loc in ("a", "b.0", "b.1", "b.2", "b.3"))
    assert summarize(_errors()) == f"{shown}; ... and 2 more"
    assert summarize(_errors(), limit=2) == f"a: {NOT_INT}; b.0: {NOT_INT}; ... and 5 more"
    assert summarize(_errors(), limit=7) == summarize(_errors(), limit=7, more=False)
    assert summarize(_errors(), more=False) == shown


def test_options_clip_show_the_input_and_name_locations() -> None:
    assert summarize(_errors(), limit=1, clip=10) == "a: Inpu...; ... and 6 more"
    assert summarize(_errors(), limit=1, more=False, show_input=True) == f"a: {NOT_INT} (got 'x')"
    named = summarize(_errors(), limit=2, more=False, name=lambda loc: "/".join(map(str, loc)))
    assert named == f"a: {NOT_INT}; b/0: {NOT_INT}"


def test_locations_and_clipping() -> None:
    root: Location = ()
    assert dotted(root) == "<root>"
    assert dotted(("spec", 0, "name")) == "spec.0.name"
    assert dotted(("x" * 10, "y"), part_clip=5) == "xx....y"
    assert clip_text("abcdef", 6) == "abcdef" and clip_text("abcdefg", 6) == "abc..."


# ------------------------------------------------------------------ each caller, pinned


def test_wire_decoding_clips_each_location_part_and_each_problem() -> None:
    data = {
        "schema_version": 1,
        "command_id": "x" * 300,
        "rollout_id": ["y" * 300] * 3,
        "kind": 1,
        "issued_at": "z" * 500,
        "ttl_s": "a",
    }
    with pytest.raises(ProtocolError) as refused:
        decode_command(json.dumps(data).encode())
    assert refused.value.message == (
        "invalid Command: command_id: String should match pattern "
        "'^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$'; rollout_id: Input should be a valid string; "
        "issued_at: Value error, expected an RFC 3339 date-time with an offset, like "
        "2025-01-01T12:00:00Z; expires_at: Field required; issuer: Field required; ... and 3 more"
    )


def test_kafka_settings_show_five_problems_and_no_count_of_the_rest() -> None:
    with pytest.raises(ControlPlaneError) as refused:
        load_settings(
            KafkaSettings,
            request_timeout_ms=1,
            delivery_timeout_ms="no",
            replication_factor=0,
            min_insync_replicas=0,
            client_id=3,
            ssl_cafile=[1],
            security_protocol="X",
        )
    assert refused.value.message == (
        "invalid settings: replication_factor: Input should be greater than or equal to 1; "
        "min_insync_replicas: Input should be greater than or equal to 1; "
        "client_id: Input should be a valid string; "
        "security_protocol: Input should be 'PLAINTEXT', 'SSL', 'SASL_PLAINTEXT' or 'SASL_SSL'; "
        "ssl_cafile: Input should be a valid string"
    )


def test_runner_options_show_the_input() -> None:
    class Options(BaseModel):
        n: int
        m: int = 0

    with pytest.raises(ValueError) as refused:
        parse_options(Options, {"n": "x", "m": [1]}, "fake")
    assert str(refused.value) == (
        f"invalid options for runner 'fake': n: {NOT_INT} (got 'x'); "
        "m: Input should be a valid integer (got [1])"
    )


def test_worker_settings_name_heartbeat_fields_by_their_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Stricter(Heartbeat):
        interval_s: Annotated[float, Field(gt=0, le=60)]
        lease_s: Annotated[float, Field(gt=0, le=100)]
        runner: Annotated[str, Field(max_length=2)]

    monkeypatch.setattr(settings_module, "Heartbeat", Stricter)
    with pytest.raises(ControlPlaneError) as refused:
        load_worker_settings(heartbeat_interval_s=61, runner="fake")
    assert refused.value.message == (
        "invalid settings: <root>: Value error, not valid in a heartbeat: "
        "runner: String should have at most 2 characters; "
        "heartbeat_interval_s: Input should be less than or equal to 60; "
        "lease_s: Input should be less than or equal to 100"
    )

    class Never(Heartbeat):
        @model_validator(mode="after")
        def _never(self) -> Never:
            raise ValueError("never")

    monkeypatch.setattr(settings_module, "Heartbeat", Never)
    with pytest.raises(ControlPlaneError) as refused:
        load_worker_settings()
    assert refused.value.message == (
        "invalid settings: <root>: Value error, not valid in a heartbeat: "
        "heartbeat: Value error, never"
    )
