"""Long lists of worker ids, packed on the wire.

A command pinned to 10,000 workers listed them as a JSON array: 90 KB to 160 KB, and at 50,000
workers close to the 1 MiB a message may have (``MAX_MESSAGE_BYTES``). Worker ids share long
prefixes (``worker-00017``, ``gpu-node-3.rack-9:0``), so a list of more than
:data:`PACK_MIN_IDS` ids goes on the wire as one object instead::

    {"packed": "gzip", "count": 50000, "sha256": "<hex of the joined ids>", "data": "<base64>"}

``data`` is the base64 of the gzip of the ids joined by ``\\n``, in the list's order; ``sha256``
is that of the joined ids before compression (a reader checks it; an operator can compare two
sets by it), ``count`` is how many (shown by kcat without decoding anything). Short lists stay
plain arrays, as before. Readers accept both forms for any such field; in Python the field is
always the plain list. 50,000 ids of 12 characters pack into ~160 KB.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Lists longer than this are packed on the wire; shorter ones stay readable JSON arrays.
PACK_MIN_IDS: Final = 1000
#: The most ids one packed list may hold, and the longest an id may be (``IDENTIFIER``): with
#: the separators, what a packed list may decompress to at most (a gzip bomb stops there).
MAX_PACKED_IDS: Final = 1_000_000
_MAX_ID_BYTES: Final = 128


class PackedIds(BaseModel):
    """A long list of ids, packed: the base64 of the gzip of the ids joined by newlines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    packed: Literal["gzip"]
    count: int = Field(ge=0, le=MAX_PACKED_IDS, description="How many ids.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="sha256 of the ids joined by newlines."
    )
    data: str = Field(description="base64 of the gzip of the ids joined by newlines.")


def _joined(ids: list[str]) -> bytes:
    return "\n".join(ids).encode("utf-8")


#: zlib's default level: within 1 % of level 9's size for lists of ids, 3x faster on random ids.
_LEVEL: Final = 6
#: The last few lists packed, by their ids: an API serving one pinned rollout over and over (its
#: status, its stream) packs the same 10,000 ids each time otherwise (2-9 ms).
_PACKED: dict[tuple[str, ...], PackedIds] = {}
_PACKED_MAX: Final = 16


def pack(ids: list[str]) -> PackedIds:
    key = tuple(ids)
    held = _PACKED.get(key)
    if held is not None:
        return held
    joined = _joined(ids)
    compressed = zlib.compress(joined, _LEVEL, wbits=31)  # wbits 31: the gzip container
    packed = PackedIds(
        packed="gzip",
        count=len(ids),
        sha256=hashlib.sha256(joined).hexdigest(),
        data=base64.b64encode(compressed).decode("ascii"),
    )
    if len(_PACKED) >= _PACKED_MAX:
        del _PACKED[next(iter(_PACKED))]  # the oldest
    _PACKED[key] = packed
    return packed


def unpack(packed: PackedIds) -> list[str]:
    """The ids of a packed list; ValueError saying why when it does not hold together."""
    try:
        compressed = base64.b64decode(packed.data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"packed ids: data is not base64 ({exc})") from exc
    limit = max(1, packed.count * (_MAX_ID_BYTES + 1))
    inflate = zlib.decompressobj(wbits=31)
    try:
        joined = inflate.decompress(compressed, limit)
    except zlib.error as exc:
        raise ValueError(f"packed ids: data is not gzip ({exc})") from exc
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(
            f"packed ids: data does not inflate to {packed.count} ids within {limit} bytes"
        )
    if hashlib.sha256(joined).hexdigest() != packed.sha256:
        raise ValueError("packed ids: sha256 does not match the ids")
    ids = joined.decode("utf-8").split("\n") if joined else []
    if len(ids) != packed.count:
        raise ValueError(f"packed ids: count says {packed.count}, data holds {len(ids)}")
    return ids


def unpack_wire(value: Any) -> Any:
    """A field's wire value as the plain list (a before-validator): a packed object becomes its
    ids (each then validated as the field's items are), anything else is left to the field."""
    if isinstance(value, dict) and "packed" in value:
        try:
            packed = PackedIds.model_validate(value)
        except ValidationError as exc:
            raise ValueError(f"packed ids: {exc.errors()[0]['msg']}") from exc
        return unpack(packed)
    return value


def pack_wire(ids: list[str]) -> list[str] | dict[str, Any]:
    """A field's value for the wire: packed once it is longer than :data:`PACK_MIN_IDS`."""
    if len(ids) <= PACK_MIN_IDS:
        return ids
    return pack(ids).model_dump()


def json_schema(items: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of such a field: an array of ``items``, or a packed object."""
    packed = PackedIds.model_json_schema()
    packed.pop("title", None)
    return {"anyOf": [{"type": "array", "items": items}, packed]}
