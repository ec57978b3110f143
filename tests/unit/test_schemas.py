"""The published JSON Schemas: fresh, valid Draft 2020-12, and in agreement with the decoder.

A Kafka client in any language validates against these files, so what they accept the decoder
must accept (beyond rules a schema cannot state, like expires_at after issued_at), and what the
decoder accepts they must accept too.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonschema import Draft202012Validator, FormatChecker

from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.protocol import encode, json_schemas
from controlplane.wire.schema_export import (
    EXPORT_COMMAND,
    SCHEMA_DIR,
    check_schemas,
    render_schemas,
    write_schemas,
)
from tests.unit.conftest import (
    DECODERS,
    MINIMAL,
    SCHEMA_NAME,
    VALID,
    VALID_IDS,
    Message,
    command_dict,
)

NAMES = ["ack", "command", "heartbeat"]

# RFC 3339 section 5.6 "date-time", written from the grammar (jsonschema checks the format only
# with the optional rfc3339-validator package, which this project does not need).
_DATE_TIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})",
    re.IGNORECASE,
)
FORMATS = FormatChecker(formats=())


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True  # formats apply to strings only
    if not _DATE_TIME.fullmatch(value):
        return False
    datetime.fromisoformat(value.upper())  # the date and time must exist
    return True


def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(json_schemas()[name], format_checker=FORMATS)


VALIDATORS = {name: validator(name) for name in NAMES}


def schema_errors(name: str, instance: Any) -> list[str]:
    return [error.message for error in VALIDATORS[name].iter_errors(instance)]


# --------------------------------------------------------------------------- committed files


def test_committed_schemas_are_fresh() -> None:
    stale = check_schemas(SCHEMA_DIR)
    assert not stale, (
        f"stale JSON Schema files in {SCHEMA_DIR}: {', '.join(stale)}; "
        f"regenerate them with `{EXPORT_COMMAND}` and commit the result"
    )


def test_committed_files_are_exactly_the_generated_ones() -> None:
    files = sorted(path.name for path in SCHEMA_DIR.glob("*.json"))
    assert files == [f"{name}.json" for name in NAMES]
    for name in NAMES:
        on_disk = json.loads((SCHEMA_DIR / f"{name}.json").read_text(encoding="utf-8"))
        assert on_disk == json_schemas()[name]


def test_write_then_check(tmp_path: Path) -> None:
    target = tmp_path / "out" / "schemas"
    assert check_schemas(target) == ["ack.json", "command.json", "heartbeat.json"]
    written = write_schemas(target)
    assert written == [target / f"{name}.json" for name in NAMES]
    assert check_schemas(target) == []
    assert write_schemas(target) == written  # idempotent
    assert check_schemas(target) == []


def test_files_are_pretty_printed_with_sorted_keys_and_a_trailing_newline(tmp_path: Path) -> None:
    for path in write_schemas(tmp_path):
        text = path.read_bytes().decode("utf-8")
        assert text.endswith("}\n")
        assert not text.endswith("\n\n")
        assert "\r" not in text
        assert (
            text
            == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        )
    assert set(render_schemas()) == {f"{name}.json" for name in NAMES}


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_text(p.read_text() + " "),
        lambda p: p.write_text(p.read_text().replace('"type": "object"', '"type": "array"', 1)),
        lambda p: p.write_text(p.read_text().rstrip("\n")),
        lambda p: p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n")),
        lambda p: p.write_text(json.dumps(json.loads(p.read_text()), indent=4)),
        lambda p: p.unlink(),
        lambda p: (p.unlink(), p.mkdir()),
    ],
    ids=["trailing-space", "content", "no-newline", "crlf", "indent", "missing", "directory"],
)
def test_check_reports_each_stale_file(tmp_path: Path, damage: Any) -> None:
    write_schemas(tmp_path)
    damage(tmp_path / "command.json")
    assert check_schemas(tmp_path) == ["command.json"]
    write_schemas(tmp_path / "fresh")
    assert check_schemas(tmp_path / "fresh") == []


def test_check_ignores_unrelated_files(tmp_path: Path) -> None:
    write_schemas(tmp_path)
    (tmp_path / "README.md").write_text("hello")
    assert check_schemas(tmp_path) == []


# --------------------------------------------------------------------------- the schemas


@pytest.mark.parametrize("name", NAMES)
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    schema = json_schemas()[name]
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://fleet-controlplane.dev/schemas/v1/{name}.json"
    assert jsonschema.validators.validator_for(schema) is Draft202012Validator


def _object_schemas(node: Any) -> list[dict[str, Any]]:
    found = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("type") == "object":
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_every_object_is_closed(name: str) -> None:
    """No object lets unknown keys through, since the decoder forbids them everywhere."""
    for obj in _object_schemas(json_schemas()[name]):
        if "properties" in obj or "patternProperties" in obj:
            assert obj.get("additionalProperties") is False, obj.get("title", obj)
        else:  # a map: every value is described
            assert "additionalProperties" in obj, obj


def _number_schemas(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number") and "const" not in node:
            found.append((path, node))
        for key, value in node.items():
            found.extend(_number_schemas(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_number_schemas(value, f"{path}/{i}"))
    return found


@pytest.mark.parametrize("name", NAMES)
def test_every_number_is_bounded(name: str) -> None:
    """A number a reader adds to a date or a counter must not overflow it (1e300 did)."""
    numbers = _number_schemas(json_schemas()[name])
    assert numbers
    for path, number in numbers:
        assert "maximum" in number or "exclusiveMaximum" in number, path
        assert "minimum" in number or "exclusiveMinimum" in number, path
        assert max(number.get("maximum", 0), number.get("exclusiveMaximum", 0)) <= 2**53, path


@pytest.mark.parametrize("name", NAMES)
def test_schema_version_is_required_on_the_wire(name: str) -> None:
    schema = json_schemas()[name]
    assert "schema_version" in schema["required"]
    assert schema["properties"]["schema_version"] == {
        "const": 1,
        "title": "Schema Version",
        "type": "integer",
    }


def test_spec_kind_is_required_and_discriminates() -> None:
    defs = json_schemas()["command"]["$defs"]
    for spec, kind in (
        ("ReloadWeightsSpec", "reload_weights"),
        ("UpdateConfigSpec", "update_config"),
    ):
        assert "kind" in defs[spec]["required"]
        assert defs[spec]["properties"]["kind"]["const"] == kind


# --------------------------------------------------------------------------- schema vs decoder


@pytest.mark.parametrize(("name", "message"), VALID, ids=VALID_IDS)
def test_valid_messages_validate_against_their_schema(name: str, message: Message) -> None:
    instance = json.loads(encode(message))
    assert schema_errors(SCHEMA_NAME[type(message)], instance) == []


def test_hand_written_command_validates() -> None:
    instance = command_dict(
        selector={"worker_ids": None, "labels": {"model": "llama-70b"}},
        timeout_s=30,
        signature=None,
    )
    assert schema_errors("command", instance) == []
    config = command_dict(spec={"kind": "update_config", "overrides": {"x": [1, {"y": None}]}})
    assert schema_errors("command", config) == []


_DROP = object()


def _spec(**fields: Any) -> dict[str, Any]:
    """A command whose reload spec has these fields changed (or dropped, with _DROP)."""
    spec: dict[str, Any] = {"kind": "reload_weights", "path": "/ckpt", "version": "v1"}
    spec.update(fields)
    return command_dict(spec={k: v for k, v in spec.items() if v is not _DROP})


def _drop(key: str, name: str = "command") -> dict[str, Any]:
    raw = json.loads(encode(MINIMAL[name]))
    del raw[key]
    return raw


def _with(name: str, **fields: Any) -> dict[str, Any]:
    raw = json.loads(encode(MINIMAL[name]))
    raw.update(fields)
    return raw


INVALID: list[tuple[str, str, dict[str, Any]]] = [
    ("no-schema-version", "command", _drop("schema_version")),
    ("schema-version-2", "command", command_dict(schema_version=2)),
    ("schema-version-true", "command", command_dict(schema_version=True)),
    ("schema-version-string", "command", command_dict(schema_version="1")),
    ("no-spec-kind", "command", _spec(kind=_DROP)),
    ("unknown-spec-kind", "command", _spec(kind="restart")),
    ("spec-of-the-other-kind", "command", _spec(overrides={"a": 1})),
    ("empty-overrides", "command", command_dict(spec={"kind": "update_config", "overrides": {}})),
    ("sha256-uppercase", "command", _spec(sha256={"m.safetensors": "AB" * 32})),
    ("strict-as-string", "command", _spec(strict="false")),
    ("version-bad-id", "command", _spec(version="v 1")),
    ("extra-field", "command", command_dict(priority="high")),
    ("extra-selector-field", "command", command_dict(selector={"namespaces": []})),
    ("bad-label-key", "command", command_dict(selector={"labels": {"-x": "y"}})),
    ("long-label-value", "command", command_dict(selector={"labels": {"x": "y" * 64}})),
    ("bad-command-id", "command", command_dict(command_id="a b")),
    ("empty-issuer", "command", command_dict(issuer="")),
    ("timeout-as-string", "command", command_dict(timeout_s="30")),
    ("timeout-zero", "command", command_dict(timeout_s=0)),
    ("unix-timestamp", "command", command_dict(issued_at=1748779200)),
    ("naive-datetime", "command", command_dict(issued_at="2025-06-01T12:00:00")),
    ("space-separated-datetime", "command", command_dict(issued_at="2025-06-01 12:00:00Z")),
    ("impossible-date", "command", command_dict(issued_at="2025-02-30T12:00:00Z")),
    ("unknown-ack-state", "ack", _with("ack", state="done")),
    ("ack-error-not-object", "ack", _with("ack", state="failed", error="boom")),
    ("ack-attempt-zero", "ack", _with("ack", attempt=0)),
    ("ack-extra", "ack", _with("ack", note="x")),
    ("ack-no-timings", "ack", _drop("timings", "ack")),
    ("heartbeat-negative-seq", "heartbeat", _with("heartbeat", seq=-1)),
    ("heartbeat-seq-string", "heartbeat", _with("heartbeat", seq="1")),
    ("heartbeat-zero-interval", "heartbeat", _with("heartbeat", interval_s=0)),
    ("heartbeat-huge-interval", "heartbeat", _with("heartbeat", interval_s=1e300)),
    ("heartbeat-huge-seq", "heartbeat", _with("heartbeat", seq=2**53 + 1)),
    ("heartbeat-huge-incarnation", "heartbeat", _with("heartbeat", incarnation=2**64)),
    ("ack-huge-attempt", "ack", _with("ack", attempt=2**53 + 1)),
    ("timeout-past-a-day", "command", command_dict(timeout_s=86400.5)),
    ("heartbeat-unknown-status", "heartbeat", _with("heartbeat", status="sleeping")),
    ("heartbeat-bad-label", "heartbeat", _with("heartbeat", labels={"a b": "c"})),
    ("heartbeat-no-schema-version", "heartbeat", _drop("schema_version", "heartbeat")),
]


@pytest.mark.parametrize(("case", "name", "instance"), INVALID, ids=[c for c, _, _ in INVALID])
def test_invalid_messages_are_refused_by_schema_and_decoder(
    case: str, name: str, instance: dict[str, Any]
) -> None:
    assert schema_errors(name, instance), f"the {name} schema accepted {case}"
    with pytest.raises(ProtocolError) as caught:
        DECODERS[name](json.dumps(instance).encode())
    assert caught.value.code in (WireCode.SCHEMA_INVALID, WireCode.UNSUPPORTED_SCHEMA_VERSION)


def test_rules_beyond_a_schema_are_the_decoders() -> None:
    """expires_at after issued_at cannot be said in JSON Schema: the decoder alone refuses it."""
    instance = command_dict(expires_at="2025-06-01T11:00:00Z")
    assert schema_errors("command", instance) == []
    with pytest.raises(ProtocolError) as caught:
        DECODERS["command"](json.dumps(instance).encode())
    assert caught.value.code is WireCode.SCHEMA_INVALID
