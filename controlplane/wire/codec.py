"""The codec of the wire messages: :func:`encode`, and ``decode_*`` for untrusted bytes.

Decoding returns one of our models or raises :class:`~controlplane.wire.errors.ProtocolError`
with a code, never anything else: a refusal says why (size, malformed JSON and where, duplicate
keys, schema version, the first validation errors) and keeps the ids a worker needs to NACK the
message where they are plainly readable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

from pydantic import ValidationError
from pydantic_core import from_json

from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.messages import (
    IDENTIFIER_RE,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Ack,
    Command,
    Heartbeat,
    WireModel,
)
from controlplane.wire.validation import Location, clip_text, dotted, summarize

M = TypeVar("M", bound=WireModel)

_UTF8_BOM: Final = b"\xef\xbb\xbf"
#: A ProtocolError's message fits in an ack's error message (AckError allows 4096 characters).
_MAX_ERROR_CHARS: Final = 1024
#: How much of a message too large to decode is read for its ids.
_SNIFF_BYTES: Final = 4096
#: Containers nest at most this deep in a message (the limit of pydantic's JSON parser).
MAX_JSON_DEPTH: Final = 201
_JSON_ERROR_AT: Final = re.compile(r"(.*) at line ([0-9]+) column ([0-9]+)", re.DOTALL)
_NON_FINITE: Final = re.compile(rb"-?(?:NaN|Infinity)")
#: Raw control characters (JSON whitespace aside) become U+FFFD when reading ids from a broken
#: message: a string holding one still parses, and is no identifier.
_CONTROLS_TO_REPLACEMENT: Final = {c: "\ufffd" for c in range(0x20) if chr(c) not in "\t\n\r"}


def encode(message: WireModel) -> bytes:
    """Compact UTF-8 JSON, as it goes on the wire."""
    return message.model_dump_json(exclude_none=False).encode("utf-8")


def _decode(model: type[M], data: bytes, max_bytes: int) -> M:
    if len(data) > max_bytes:
        command_id, rollout_id = _readable_ids(data[:_SNIFF_BYTES])
        raise _error(
            f"{model.__name__} of {len(data)} bytes exceeds the {max_bytes}-byte limit",
            WireCode.MESSAGE_TOO_LARGE,
            command_id,
            rollout_id,
        )
    offset = 0
    if data[:3] == _UTF8_BOM:  # RFC 8259 section 8.1: a parser may ignore it.
        data, offset = data[3:], 3
    # Strict JSON-mode validation accepts exactly what the exported schemas describe: no "true"
    # for a bool, no "30" for a number, no unix time for a date-time. One parse on the happy path,
    # then a scan for duplicate keys (pydantic's parser keeps the last value of a duplicate key).
    invalid: ValidationError | None = None
    try:
        message = model.model_validate_json(data, strict=True)
    except ValidationError as exc:
        invalid = exc
    except RecursionError:
        raise _error(
            "message nested too deeply", WireCode.SCHEMA_INVALID, *_readable_ids(data)
        ) from None
    else:
        # schema_version has a Python default for our own producers, but the wire requires it.
        if "schema_version" in message.model_fields_set:
            duplicate = _duplicate_key_refusal(model, data)
            if duplicate is not None:
                raise duplicate
            return message
    raise _refusal(model, data, invalid, offset)


def _refusal(
    model: type[WireModel], data: bytes, invalid: ValidationError | None, offset: int
) -> ProtocolError:
    """Why ``data`` was refused, with the ids a worker needs to NACK it where they are readable."""
    try:
        raw: Any = from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        return _malformed(data, str(exc), offset)
    if invalid is not None:
        first = invalid.errors(include_url=False)[0]
        if first["type"] == "json_invalid":  # pragma: no cover - both are pydantic's parser
            return _malformed(data, first["msg"].removeprefix("Invalid JSON: "), offset)
    if not isinstance(raw, dict):
        return ProtocolError(
            f"expected a JSON object, got {type(raw).__name__}", code=WireCode.SCHEMA_INVALID
        )
    duplicate = _duplicate_key_refusal(model, data)
    if duplicate is not None:
        return duplicate
    version = raw.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION or invalid is None:
        code = WireCode.UNSUPPORTED_SCHEMA_VERSION
        shown = _clip(repr(version), 64)
        text = f"unsupported schema_version {shown}; this build speaks {SCHEMA_VERSION}"
    else:
        code = WireCode.SCHEMA_INVALID
        text = f"invalid {model.__name__}: {_summarize(invalid)}"
    return _error(
        text,
        code,
        _identifier_or_none(raw.get("command_id")),
        _identifier_or_none(raw.get("rollout_id")),
    )


def decode_model(model: type[M], data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """Any wire model, refused as the three channels' messages are (a coded ProtocolError)."""
    return _decode(model, data, max_bytes)


def decode_command(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Command:
    return _decode(Command, data, max_bytes)


def decode_ack(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Ack:
    return _decode(Ack, data, max_bytes)


def decode_heartbeat(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Heartbeat:
    return _decode(Heartbeat, data, max_bytes)


def _error(
    text: str, code: WireCode, command_id: str | None, rollout_id: str | None
) -> ProtocolError:
    err = ProtocolError(_clip(text), code=code, command_id=command_id)
    err.rollout_id = rollout_id
    return err


# ---------------------------------------------------------------- duplicate keys


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Pairs(list[tuple[str, Any]]):
    """An object's members in order, duplicates kept (what the JSON text says, not a parser)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    if len(pairs) > 1 and len(dict(pairs)) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return pairs


def _parse_pairs(data: bytes, hook: Callable[[list[tuple[str, Any]]], Any]) -> Any:
    """Parse JSON that pydantic's parser accepted, numbers left as text (no digit limit)."""
    return json.loads(
        data.decode("utf-8"),
        object_pairs_hook=hook,
        parse_int=str,
        parse_float=str,
        parse_constant=str,
    )


def _duplicate_key_refusal(model: type[WireModel], data: bytes) -> ProtocolError | None:
    """DUPLICATE_KEY when an object anywhere in ``data`` (valid JSON) repeats a key.

    Parsers disagree on which value a repeated key means (pydantic, msgspec and Python keep the
    last, others the first or refuse): a message that two readers could read differently is
    refused. Its ids are kept only where every occurrence of them agrees.
    """
    try:
        _parse_pairs(data, _unique_pairs)
    except _DuplicateKey as dup:
        key = dup.key
    except (ValueError, RecursionError) as exc:  # pragma: no cover - pydantic's parser accepted
        return _error(f"not valid JSON: {exc}", WireCode.MALFORMED_JSON, None, None)
    else:
        return None
    top = _parse_pairs(data, _Pairs)
    ids: dict[str, str | None] = {"command_id": None, "rollout_id": None}
    if isinstance(top, _Pairs):
        for name in ids:
            values = {json.dumps(v) for k, v in top if k == name}
            if len(values) == 1:
                ids[name] = _identifier_or_none(json.loads(values.pop()))
    return _error(
        f"duplicate key {_clip(json.dumps(key, ensure_ascii=False), 80)} in a {model.__name__}: "
        "every key may appear once per object",
        WireCode.DUPLICATE_KEY,
        ids["command_id"],
        ids["rollout_id"],
    )


# ---------------------------------------------------------------- malformed JSON


def _malformed(data: bytes, detail: str, offset: int) -> ProtocolError:
    """MALFORMED_JSON saying what is wrong and where (byte offsets count from the message's
    first byte), with the ids where they are readable despite the damage."""
    match = _JSON_ERROR_AT.fullmatch(detail)
    position = None if match is None else _byte_offset(data, int(match[2]), int(match[3]))
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if position is None or exc.start <= position:
            position, text = exc.start, f"invalid UTF-8 at byte {offset + exc.start}"
        else:
            text = _describe(data, match[1] if match else detail, position, offset)
    else:
        text = _describe(data, match[1] if match else detail, position, offset)
    return _error(text, WireCode.MALFORMED_JSON, *_readable_ids(data))


def _describe(data: bytes, what: str, position: int | None, offset: int) -> str:
    if position is None:
        return f"invalid JSON: {what}"
    at = f"at byte {offset + position}"
    if what in ("expected value", "invalid number"):
        start = position - 1 if data[position - 1 : position] == b"-" else position
        literal = _NON_FINITE.match(data, start)
        if literal is not None:
            return f"{literal[0].decode()} is not a JSON number ({at})"
    if what.startswith("EOF while parsing"):
        return f"truncated JSON: {what} {at}"
    if what.startswith("recursion limit exceeded"):
        return f"nested more than {MAX_JSON_DEPTH} levels deep ({at})"
    if position < len(data) and data[position] < 0x20:
        where = "in a string " if what.startswith("control character") else ""
        return (
            f"raw control character U+{data[position]:04X} {where}{at} (JSON requires it escaped)"
        )
    return f"invalid JSON: {what} {at}"


def _byte_offset(data: bytes, line: int, column: int) -> int:
    """The offset of pydantic's "line L column C" (1-based, columns in bytes)."""
    start = 0 if line <= 1 else len(data) - len(data.split(b"\n", line - 1)[-1])
    return max(0, min(len(data), start + column - 1))


def _readable_ids(data: bytes) -> tuple[str | None, str | None]:
    """The top-level command_id and rollout_id of a message that did not decode, where they are
    plainly readable: whole strings that are identifiers, in the part of the message before the
    damage (bytes that are not UTF-8 and raw control characters count as damage inside a string
    only), each the same as the first such member written in the bytes.

    Never a guess: a cut-off value, a value with a broken byte, or an id written twice with two
    values gives None.
    """
    repaired = data.decode("utf-8", "replace").translate(_CONTROLS_TO_REPLACEMENT).encode()
    try:
        raw: Any = from_json(repaired, allow_inf_nan=True, allow_partial=True)
    except ValueError as exc:
        match = _JSON_ERROR_AT.fullmatch(str(exc))
        if match is None:
            return None, None
        prefix = repaired[: _byte_offset(repaired, int(match[2]), int(match[3]))]
        try:
            raw = from_json(prefix, allow_inf_nan=True, allow_partial=True)
        except ValueError:
            return None, None
    if not isinstance(raw, dict):
        return None, None
    return _first_id(data, raw, "command_id"), _first_id(data, raw, "rollout_id")


def _first_id(data: bytes, raw: dict[str, Any], name: str) -> str | None:
    value = _identifier_or_none(raw.get(name))
    if value is None:
        return None
    first = re.search(rb'"%s"\s*:\s*"([^"\\]*)"' % name.encode(), data)
    return value if first is not None and first[1] == value.encode() else None


def _identifier_or_none(value: object) -> str | None:
    """Only an id that an ack could carry: anything else would make the NACK itself invalid."""
    return value if isinstance(value, str) and IDENTIFIER_RE.fullmatch(value) else None


def _clip(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return clip_text(text, limit)


def _summarize(exc: ValidationError, limit: int = 5) -> str:
    return summarize(exc, limit=limit, clip=192, name=_short_location)


def _short_location(loc: Location) -> str:
    return dotted(loc, part_clip=64)
