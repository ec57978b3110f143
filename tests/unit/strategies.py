"""Hypothesis strategies for the wire protocol: valid commands, acks and heartbeats, JSON values,
and mutants of valid messages (raw fragments, duplicate keys, retyped values, broken bytes).

Shared by the property tests (test_protocol_fuzz) and the fast ack decoder's differential tests
(test_ack_codec). ``fuzz(n)``: derandomized settings, no example database; FUZZ_SCALE multiplies
every example count.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from controlplane.wire.errors import LocalCode, WireCode
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Degraded,
    Heartbeat,
    InFlight,
    ReloadWeightsSpec,
    Selector,
    Signature,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
    encode,
)

_SCALE = float(os.environ.get("FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=max(1, round(examples * _SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --------------------------------------------------------------------------- valid messages


_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _pattern(first: str, rest: str, max_rest: int) -> st.SearchStrategy[str]:
    """Like st.from_regex("[first][rest]{0,max_rest}"), several times faster to draw."""
    return st.builds(str.__add__, st.sampled_from(first), st.text(alphabet=rest, max_size=max_rest))


identifiers = _pattern(_ALNUM, _ALNUM + "._:@/-", 127)


label_keys = _pattern(_ALNUM, _ALNUM + "._/-", 62)


sha256_hex = st.binary(min_size=32, max_size=32).map(bytes.hex)


label_values = st.text(max_size=63)


# RFC 3339 offsets are whole minutes within a day.
offsets = st.integers(-(24 * 60 - 1), 24 * 60 - 1).map(lambda m: timezone(timedelta(minutes=m)))


# Within the protocol's range (1970..9000 UTC) whatever the offset.
timestamps = st.datetimes(
    min_value=datetime(1970, 1, 2), max_value=datetime(2200, 1, 1), timezones=offsets
)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)


json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=16,
)


@st.composite
def commands(draw: st.DrawFn) -> Command:
    issued = draw(timestamps)
    spec: ReloadWeightsSpec | UpdateConfigSpec
    if draw(st.booleans()):
        spec = ReloadWeightsSpec(
            path=draw(st.text(min_size=1, max_size=200)),
            version=draw(identifiers),
            sha256=draw(
                st.dictionaries(
                    st.text(min_size=1, max_size=60),
                    sha256_hex,
                    max_size=3,
                )
            ),
            strict=draw(st.booleans()),
        )
    else:
        spec = UpdateConfigSpec(
            overrides=draw(
                st.dictionaries(
                    st.text(min_size=1, max_size=30), json_values, min_size=1, max_size=5
                )
            )
        )
    return Command(
        command_id=draw(identifiers),
        rollout_id=draw(identifiers),
        issued_at=issued,
        expires_at=issued
        + draw(st.timedeltas(min_value=timedelta(microseconds=1), max_value=timedelta(days=3650))),
        issuer=draw(st.text(min_size=1, max_size=256)),
        selector=Selector(
            worker_ids=draw(st.none() | st.lists(identifiers, max_size=4)),
            labels=draw(st.dictionaries(label_keys, label_values, max_size=4)),
        ),
        spec=spec,
        timeout_s=draw(st.none() | st.floats(min_value=0, max_value=86400, exclude_min=True)),
        signature=draw(
            st.none()
            | st.builds(Signature, key_id=identifiers, value=st.text(min_size=1, max_size=512))
        ),
    )


@st.composite
def acks(draw: st.DrawFn) -> Ack:
    state = draw(st.sampled_from(AckState))
    needs_error = state in (AckState.FAILED, AckState.REJECTED)
    may_error = state is not AckState.SUCCEEDED
    error = None
    if needs_error or (may_error and draw(st.booleans())):
        error = AckError(
            code=draw(st.sampled_from([*WireCode, *LocalCode])),
            message=draw(st.text(max_size=200)),
            retryable=draw(st.booleans()),
        )
    optional_time = st.none() | timestamps
    return Ack(
        command_id=draw(identifiers),
        rollout_id=draw(identifiers),
        worker_id=draw(identifiers),
        kind=draw(st.none() | st.sampled_from(CommandKind)),
        state=state,
        weights_version=draw(st.none() | st.text(max_size=40)),
        config_digest=draw(st.none() | st.text(max_size=40)),
        error=error,
        timings=Timings(
            received_at=draw(timestamps),
            started_at=draw(optional_time),
            finished_at=draw(optional_time),
        ),
        attempt=draw(st.integers(min_value=1, max_value=2**53)),
        sent_at=draw(timestamps),
        result=draw(st.dictionaries(st.text(max_size=20), json_values, max_size=4)),
    )


@st.composite
def heartbeats(draw: st.DrawFn) -> Heartbeat:
    return Heartbeat(
        worker_id=draw(identifiers),
        labels=draw(st.dictionaries(label_keys, label_values, max_size=4)),
        runner=draw(st.text(max_size=20)),
        device=draw(st.text(max_size=20)),
        status=draw(st.sampled_from(WorkerStatus)),
        weights_version=draw(st.none() | st.text(max_size=40)),
        config_digest=draw(st.none() | st.text(max_size=40)),
        in_flight=draw(
            st.none()
            | st.builds(
                InFlight,
                command_id=identifiers,
                rollout_id=identifiers,
                kind=st.sampled_from(CommandKind),
                since=timestamps,
            )
        ),
        degraded=draw(
            st.none()
            | st.builds(
                Degraded,
                code=st.text(max_size=30),
                message=st.text(max_size=100),
                from_version=st.none() | st.text(max_size=20),
                to_version=st.text(max_size=20),
                since=timestamps,
            )
        ),
        seq=draw(st.integers(min_value=0, max_value=2**53)),
        incarnation=draw(st.integers(min_value=0, max_value=2**53)),
        sent_at=draw(timestamps),
        started_at=draw(timestamps),
        interval_s=draw(st.floats(min_value=0, max_value=3600, exclude_min=True)),
        agent_version=draw(st.text(max_size=20)),
    )


MESSAGES = {"command": commands(), "ack": acks(), "heartbeat": heartbeats()}


# --------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Raw:
    """A fragment written into the JSON text verbatim (possibly not JSON at all)."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """An object written with these key/value pairs in order, duplicate keys included."""

    items: tuple[tuple[str, Any], ...]


def dump(node: Any) -> str:
    if isinstance(node, Raw):
        return node.text
    if isinstance(node, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in node.items) + "}"
    if isinstance(node, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in node.items()) + "}"
    if isinstance(node, list):
        return "[" + ",".join(dump(v) for v in node) + "]"
    return json.dumps(node)  # NaN and Infinity come out as such: not JSON, on purpose


FIELD_NAMES = sorted(
    {
        name
        for model in (
            Command,
            Ack,
            Heartbeat,
            Selector,
            ReloadWeightsSpec,
            UpdateConfigSpec,
            Timings,
        )
        for name in model.model_fields
    }
)


nasty = st.one_of(
    json_values,
    st.floats(),  # NaN, Infinity, -0.0, subnormals
    st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from(
        [
            Raw("NaN"),
            Raw("-Infinity"),
            Raw("1e400"),
            Raw("-1e-400"),
            Raw("1.0"),
            Raw("true"),
            Raw('"\\ud800"'),
            Raw('"\\u0000"'),
            Raw("01"),
            Raw("'x'"),
            Raw(""),
            "",
            "0",
            "1748779200",
            "2025-06-01T12:00:00",
            "2025-06-01T12:00:00Z",
            "2025-06-01T12:00:00+02:00",
            "2099-01-01T00:00:00-23:59",
            "2025-06-01 12:00:00Z",
            "reload_weights",
            "update_config",
            "succeeded",
            "failed",
            "ready",
            "a" * 129,
            "\U0001f680",
        ]
    ),
    st.integers(1, 6000).map(lambda n: Raw("9" * n)),  # big ints, past Python's 4300-digit limit
    st.sampled_from([2**53, 2**53 + 1, 2**63, 2**64, 1e300, -1e300, 3600.5, 86400.5]),
    st.sampled_from(["0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "1969-12-31T23:59:59Z"]),
    st.integers(1, 5000).map(lambda n: Raw("[" * n + "]" * n)),  # deep nesting
    st.integers(1, 3000).map(lambda n: Raw('{"a":' * n + "1" + "}" * n)),
    st.sampled_from([1_000, 70_000, 1_100_000]).map(lambda n: "x" * n),  # huge strings
    identifiers,
)


def containers(node: Any) -> list[Any]:
    found = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list):
            found.append(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


@st.composite
def mutate(draw: st.DrawFn, tree: Any) -> Any:
    """Apply one random edit somewhere in ``tree`` (in place; Pairs nodes are left alone)."""
    target = draw(st.sampled_from(containers(tree)))
    if isinstance(target, dict):
        keys = list(target)
        op = draw(
            st.sampled_from(["drop", "replace", "add", "retype", "duplicate"] if keys else ["add"])
        )
        if op == "add":
            key = draw(st.sampled_from(FIELD_NAMES) | st.text(max_size=20))
            target[key] = draw(nasty)
            return tree
        key = draw(st.sampled_from(keys))
        if op == "drop":
            del target[key]
        elif op == "replace":
            target[key] = draw(nasty)
        elif op == "retype":
            target[key] = retype(draw, target[key])
        else:
            items = [*target.items(), (key, draw(nasty))]
            if draw(st.booleans()):
                items.reverse()
            return replace_node(tree, target, Pairs(tuple(items)))
    else:
        op = draw(st.sampled_from(["drop", "replace", "add", "retype"] if target else ["add"]))
        if op == "add":
            target.insert(draw(st.integers(0, len(target))), draw(nasty))
            return tree
        index = draw(st.integers(0, len(target) - 1))
        if op == "drop":
            del target[index]
        elif op == "replace":
            target[index] = draw(nasty)
        else:
            target[index] = retype(draw, target[index])
    return tree


def retype(draw: st.DrawFn, value: Any) -> Any:
    """The same value in another JSON type."""
    choices: list[Any] = [
        [value],
        {"value": value},
        None,
        json.dumps(value, default=str),
        len(json.dumps(value, default=str)),
        float(len(str(value))),
        bool(value),
    ]
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) < 300:
        choices.append(int(value))
    return draw(st.sampled_from(choices))


def replace_node(tree: Any, old: Any, new: Any) -> Any:
    if tree is old:
        return new
    for parent in containers(tree):
        pairs = parent.items() if isinstance(parent, dict) else enumerate(parent)
        for key, child in list(pairs):
            if child is old:
                parent[key] = new
                return tree
    raise AssertionError("node not found")


@st.composite
def wire_bytes(draw: st.DrawFn, text: str) -> bytes:
    """The JSON text as a producer might (mis)send it."""
    how = draw(
        st.sampled_from(
            [
                "utf-8",
                "utf-8",
                "utf-8",
                "bom",
                "utf-16",
                "latin-1",
                "truncate",
                "flip",
                "insert",
                "pad",
            ]
        )
    )
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    if how == "utf-16":
        return text.encode("utf-16", "surrogatepass")
    if how == "latin-1":
        return text.encode("latin-1", "replace")
    data = text.encode("utf-8", "surrogatepass")
    if how == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if how in ("flip", "insert"):
        at = draw(st.integers(0, len(data)))
        junk = draw(
            st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x00", b'"', b"}", b"\\"])
        )
        return data[:at] + junk + data[at + (how == "flip") :]
    if how == "pad":
        return b" \t\r\n" * draw(st.integers(0, 4)) + data + b"\n"
    return data


@st.composite
def mutants(draw: st.DrawFn, name: str) -> bytes:
    tree: Any = json.loads(encode(draw(MESSAGES[name])))
    for _ in range(draw(st.integers(1, 3))):
        if isinstance(tree, Pairs) or not containers(tree):
            break
        tree = draw(mutate(tree))
    return draw(wire_bytes(dump(tree)))
