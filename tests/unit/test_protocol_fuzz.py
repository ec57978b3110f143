"""Property tests: decoding untrusted bytes yields one of our models or a ProtocolError, never
anything else, and every valid message survives the wire unchanged.

Derandomized, with no example database, so a run is repeatable and writes nothing to the tree.
Set FUZZ_SCALE (say 20) to multiply every example count for a deeper run. The strategies are
in tests/unit/strategies.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.protocol import (
    encode,
)
from tests.unit.conftest import DECODERS, PROTOCOL_CODES, SCHEMA_NAME, Message, assert_nackable
from tests.unit.strategies import (
    FIELD_NAMES,
    MESSAGES,
    Pairs,
    Raw,
    containers,
    dump,
    fuzz,
    json_scalars,
    json_values,
    mutants,
    replace_node,
)
from tests.unit.test_schemas import schema_errors

# --------------------------------------------------------------------------- the property


def assert_model_or_protocol_error(name: str, data: bytes) -> Message | None:
    """Decode ``data``: a model that survives the wire again, or a ProtocolError a worker can NACK."""
    try:
        message: Message = DECODERS[name](data)
    except ProtocolError as err:
        event(f"refused: {err.code}")
        assert isinstance(err.code, WireCode)
        assert err.code in PROTOCOL_CODES
        assert isinstance(err.message, str)
        assert len(err.message) <= 1024
        assert_nackable(err)
        return None
    # Anything else (ValidationError, UnicodeDecodeError, RecursionError, ...) fails the test.
    event("accepted")
    assert SCHEMA_NAME[type(message)] == name
    again = encode(message)
    assert DECODERS[name](again) == message
    return message


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(500)
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes(name: str, data: bytes) -> None:
    assert_model_or_protocol_error(name, data)


any_json = st.recursive(
    json_scalars | st.floats(),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=12,
)


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(150)
@given(value=any_json)
def test_arbitrary_json(name: str, value: Any) -> None:
    assert_model_or_protocol_error(name, json.dumps(value).encode())


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(100)
@given(value=st.data())
def test_arbitrary_objects_with_our_field_names(name: str, value: st.DataObject) -> None:
    keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=10)
    obj = value.draw(st.dictionaries(keys, any_json, max_size=8))
    if value.draw(st.booleans()):
        obj["schema_version"] = 1
    assert_model_or_protocol_error(name, json.dumps(obj).encode())


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    assert len({key for key, _ in pairs}) == len(pairs), pairs
    return dict(pairs)


# --------------------------------------------------------------------------- mutations


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(250)
@given(st.data())
def test_mutated_messages(name: str, data: st.DataObject) -> None:
    wire = data.draw(mutants(name))
    message = assert_model_or_protocol_error(name, wire)
    if message is not None:
        # What the decoder accepts, the published schema accepts too, and no key repeats in it.
        assert schema_errors(name, json.loads(wire, object_pairs_hook=_no_duplicates)) == []


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(150)
@given(st.data())
def test_a_repeated_key_anywhere_is_refused(name: str, data: st.DataObject) -> None:
    """Any object of a valid message, any of its keys written twice (same value or another,
    first or last): refused with DUPLICATE_KEY, and the ids kept only when unambiguous."""
    message = data.draw(MESSAGES[name])
    tree: Any = json.loads(encode(message))
    objects = [node for node in containers(tree) if isinstance(node, dict) and node]
    target = data.draw(st.sampled_from(objects))
    key = data.draw(st.sampled_from(sorted(target)))
    again = data.draw(st.just(target[key]) | json_values)
    items = [*target.items(), (key, again)]
    if data.draw(st.booleans()):
        items.reverse()
    wire = dump(replace_node(tree, target, Pairs(tuple(items)))).encode()
    with pytest.raises(ProtocolError) as caught:
        DECODERS[name](wire)
    err = caught.value
    assert err.code is WireCode.DUPLICATE_KEY, err
    assert json.dumps(key, ensure_ascii=False)[:60] in err.message
    assert_nackable(err)
    if target is tree and key == "command_id" and again != tree[key]:
        assert err.command_id is None


NUMERIC_FIELDS = {
    "command": ["timeout_s"],
    "ack": ["attempt"],
    "heartbeat": ["seq", "incarnation", "interval_s"],
}


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(100)
@given(st.data())
def test_huge_numbers_are_refused(name: str, data: st.DataObject) -> None:
    """Valid JSON numbers past a field's bound: refused, never a model a reader overflows on."""
    raw: dict[str, Any] = json.loads(encode(data.draw(MESSAGES[name])))
    field = data.draw(st.sampled_from(NUMERIC_FIELDS[name]))
    number = data.draw(
        st.sampled_from([2**53 + 1, 2**64, 1e300, 1.7976931348623157e308, 86400.001])
        | st.integers(min_value=2**53 + 1)
        | st.floats(min_value=86400, exclude_min=True, allow_infinity=False)
        | st.integers(4300, 5000).map(lambda n: Raw("9" * n))
        | st.integers(309, 400).map(lambda n: Raw(f"1e{n}"))
    )
    raw[field] = number
    with pytest.raises(ProtocolError) as caught:
        DECODERS[name](dump(raw).encode())
    assert caught.value.code in (WireCode.SCHEMA_INVALID, WireCode.MALFORMED_JSON)
    assert_nackable(caught.value)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz(150)
@given(st.data())
def test_valid_messages_round_trip_exactly(name: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGES[name])
    wire = encode(message)
    decoded = DECODERS[name](wire)
    assert decoded == message
    assert encode(decoded) == wire
    assert schema_errors(name, json.loads(wire)) == []
