"""The controller topic's records (controlplane/wire/control.py): each one round-trips through
``decode_control`` and the ``CONTROL`` channel, bad ones are refused with a code, and every record
has its compaction key. Pure: no Kafka.
"""

from __future__ import annotations

import codecs
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from controlplane.wire.channels import CONTROL
from controlplane.wire.codec import encode
from controlplane.wire.control import (
    MAX_ROLLOUT_ID,
    ActionKind,
    ControlPhase,
    Desired,
    GateResult,
    LeaderRecord,
    ProbeGate,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    Strategy,
    TargetSpec,
    WeightsRef,
    control_key,
    decode_control,
    step_count,
)
from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.messages import WireModel
from controlplane.wire.topics import Topics
from tests.unit.strategies import Pairs, containers, dump, fuzz, mutate, wire_bytes

T0 = datetime(2025, 1, 1, tzinfo=UTC)
V1 = Desired(
    weights=WeightsRef(path="/ckpt/v1", version="v1", sha256={"model.safetensors": "ab" * 32})
)
V2 = Desired(weights=WeightsRef(path="/ckpt/v2", version="v2"))

TARGET = TargetSpec(
    name="llama", selector={"model": "llama"}, stable=V1, issued_at=T0, issuer="ops"
)
ROLLOUT = RolloutSpec(
    rollout_id="r-2025.01/a",
    target="llama",
    desired=V2,
    strategy=Strategy(
        canary=1,
        steps=["10%", "5", "100%"],
        max_unavailable=2,
        pause="manual",
        max_failures="10%",
        bake_s=5.0,
        progress_deadline_s=60.0,
        command_timeout_s=30.0,
        probe=ProbeGate(
            prompt="The capital of France is", expect_tokens=[1, 2], min_mean_logprob=-3
        ),
    ),
    rollback=False,
    undo_of="r0",
    issued_at=T0,
    issuer="ops",
)
ACTION = RolloutAction(
    rollout_id="r-2025.01/a",
    action_id="act-1",
    action=ActionKind.ABORT,
    rollback=True,
    reason="bad numbers",
    issued_at=T0,
    issuer="ops",
)
STATE = RolloutState(
    rollout_id="r-2025.01/a",
    target="llama",
    revision=7,
    phase=ControlPhase.ROLLING_BACK,
    waves=[["w0"], ["w1", "w2"]],
    wave=1,
    batch=1,
    wave_done_at=T0,
    wave_started_at=T0,
    promoted=1,
    failed=["w2"],
    gates=[GateResult(wave=0, gate="probe", passed=False, message="disagree")],
    previous=V1,
    rollback=[["w0", "w1"]],
    rollback_batch=0,
    code="GATE_FAILED",
    message="probe gate: disagree",
    started_at=T0,
    updated_at=T0,
)
LEADER = LeaderRecord(member="coordinator-1", generation=3, producer_epoch=5, since=T0)
RECORDS: list[WireModel] = [TARGET, ROLLOUT, ACTION, STATE, LEADER]
KEYS = [
    f"target/llama/stable@{T0.isoformat()}".encode(),  # a declared stable state: a key of its own
    b"rollout/r-2025.01/a",
    b"action/r-2025.01/a/act-1",
    b"state/r-2025.01/a",
    b"leader",
]


def _refusal(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_control(data)
    return info.value


def _raw(record: WireModel, **changes: Any) -> bytes:
    """``record`` as JSON with some fields replaced (``None`` removes one)."""
    obj = json.loads(encode(record))
    for name, value in changes.items():
        if value is None:
            obj.pop(name, None)
        else:
            obj[name] = value
    return json.dumps(obj).encode()


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_decode_control(record: WireModel) -> None:
    decoded = decode_control(encode(record))
    assert type(decoded) is type(record)
    assert decoded == record
    assert encode(decoded) == encode(record)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_the_control_channel(record: WireModel) -> None:
    topics = Topics()
    topic, key, value = CONTROL.record(topics, record)
    assert topic == topics.controller.name
    assert key == control_key(record)
    assert CONTROL.decode(value) == record
    assert CONTROL.reader(value) == record


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_after_a_utf8_bom_decodes_as_on_the_other_channels(record: WireModel) -> None:
    """The codec ignores a leading BOM (RFC 8259 8.1) on every channel; so must the sniffing of
    a controller record's ``type`` (it read no type and decoded a TargetSpec)."""
    assert decode_control(codecs.BOM_UTF8 + encode(record)) == record


def test_minimal_records_take_their_defaults() -> None:
    spec = decode_control(
        json.dumps(
            {
                "type": "rollout",
                "schema_version": 1,
                "rollout_id": "r1",
                "target": "llama",
                "desired": {"config": {"top_k": 4}},
                "issued_at": "2025-01-01T00:00:00Z",
                "issuer": "ops",
            }
        ).encode()
    )
    assert isinstance(spec, RolloutSpec)
    assert spec.strategy == Strategy()
    assert spec.strategy.steps == ["100%"] and spec.strategy.canary == 0
    assert spec.strategy.max_unavailable is None and not spec.strategy.manual
    assert spec.rollback is True and spec.desired.version is None


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    ("record", "key"), list(zip(RECORDS, KEYS, strict=True)), ids=[k.decode() for k in KEYS]
)
def test_control_key_per_record(record: WireModel, key: bytes) -> None:
    assert control_key(record) == key
    assert CONTROL.key(record) == key


def test_control_key_refuses_another_message() -> None:
    with pytest.raises(TypeError, match="not a controller record"):
        control_key(V1)


def test_records_of_two_rollouts_or_actions_have_distinct_keys() -> None:
    other = ACTION.model_copy(update={"action_id": "act-2"})
    assert control_key(other) != control_key(ACTION)
    assert control_key(STATE.model_copy(update={"revision": 8})) == control_key(STATE)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kind", ["nope", "Target", "", 3, None, ["target"]])
def test_an_unknown_type_is_schema_invalid(kind: object) -> None:
    error = _refusal(_raw(TARGET, type=kind) if kind is not None else _raw(TARGET, type=None))
    assert error.code is WireCode.SCHEMA_INVALID
    assert "unknown controller record type" in str(error)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"{", WireCode.MALFORMED_JSON),
        (b"[1]", WireCode.SCHEMA_INVALID),
        (b"", WireCode.MALFORMED_JSON),
    ],
)
def test_bytes_that_are_no_record_are_refused_with_a_code(data: bytes, code: WireCode) -> None:
    assert _refusal(data).code is code


def test_an_oversized_record_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_control(encode(TARGET), max_bytes=16)
    assert info.value.code is WireCode.MESSAGE_TOO_LARGE


@pytest.mark.parametrize("step", ["150%", "0%", "101%", "-1", "1.5", "10 %", "%", "1234567"])
def test_a_bad_step_is_schema_invalid(step: str) -> None:
    strategy = json.loads(encode(Strategy()))
    strategy["steps"] = [step, "100%"]
    error = _refusal(_raw(ROLLOUT, strategy=strategy))
    assert error.code is WireCode.SCHEMA_INVALID
    assert "steps" in str(error)


def test_a_bad_max_failures_is_schema_invalid() -> None:
    strategy = json.loads(encode(Strategy()))
    strategy["max_failures"] = "150%"
    assert _refusal(_raw(ROLLOUT, strategy=strategy)).code is WireCode.SCHEMA_INVALID


@pytest.mark.parametrize("steps", [["10%", "50%"], ["1"], ["100%", "50%"], ["10"], []])
def test_a_last_step_other_than_100_percent_is_schema_invalid(steps: list[str]) -> None:
    strategy = json.loads(encode(Strategy()))
    strategy["steps"] = steps
    error = _refusal(_raw(ROLLOUT, strategy=strategy))
    assert error.code is WireCode.SCHEMA_INVALID
    with pytest.raises(ValidationError):
        Strategy(steps=steps)


def test_a_rollout_that_changes_nothing_is_schema_invalid() -> None:
    error = _refusal(_raw(ROLLOUT, desired={"config": {}}))
    assert error.code is WireCode.SCHEMA_INVALID
    assert "must change the weights or the config" in str(error)
    with pytest.raises(ValidationError, match="must change"):
        ROLLOUT.model_validate({**ROLLOUT.model_dump(), "desired": Desired()})


def test_a_probe_gate_on_a_config_rollout_is_schema_invalid() -> None:
    """Only a reload asks the workers for the probe (ReloadWeightsSpec.probe): a config rollout
    with a probe gate would get no answer and fail its gate every time."""
    strategy = json.loads(encode(Strategy(probe=ProbeGate(prompt="p"))))
    error = _refusal(_raw(ROLLOUT, desired={"config": {"top_k": 4}}, strategy=strategy))
    assert error.code is WireCode.SCHEMA_INVALID
    assert "probe gate needs a rollout of weights" in str(error)
    weights_too = _raw(ROLLOUT, desired=json.loads(encode(V2)), strategy=strategy)
    assert isinstance(decode_control(weights_too), RolloutSpec)


def test_rollout_ids_are_at_most_96_characters() -> None:
    longest = "r" * MAX_ROLLOUT_ID
    assert decode_control(_raw(ROLLOUT, rollout_id=longest)).rollout_id == longest  # type: ignore[union-attr]
    for record in (ROLLOUT, ACTION, STATE):
        error = _refusal(_raw(record, rollout_id=longest + "r"))
        assert error.code is WireCode.SCHEMA_INVALID
        assert "rollout_id" in str(error)


@pytest.mark.parametrize(
    ("record", "field", "value"),
    [
        (TARGET, "selector", {}),
        (TARGET, "name", "-llama"),
        (TARGET, "surprise", 1),
        (ROLLOUT, "target", "a" * 64),
        (ACTION, "action", "restart"),
        (STATE, "phase", "done"),
        (STATE, "revision", -1),
        (LEADER, "member", ""),
    ],
)
def test_bad_fields_are_schema_invalid(record: WireModel, field: str, value: object) -> None:
    assert _refusal(_raw(record, **{field: value})).code is WireCode.SCHEMA_INVALID


def test_a_record_missing_its_issued_at_is_schema_invalid() -> None:
    assert _refusal(_raw(ACTION, issued_at=None)).code is WireCode.SCHEMA_INVALID


@pytest.mark.parametrize("version", [99, None])
def test_a_newer_or_missing_schema_version_is_refused(version: int | None) -> None:
    error = _refusal(_raw(TARGET, schema_version=version))
    assert error.code is WireCode.UNSUPPORTED_SCHEMA_VERSION


# --------------------------------------------------------------------------- strategy helpers


@pytest.mark.parametrize(
    ("step", "total", "count"),
    [
        ("10%", 5, 1),  # rounded up, never 0
        ("10%", 10, 1),
        ("10%", 11, 2),
        ("50%", 10, 5),
        ("100%", 7, 7),
        ("3", 10, 3),
        ("30", 10, 10),  # a count is capped at the total
        ("0", 10, 0),
        ("1%", 0, 0),
    ],
)
def test_step_count(step: str, total: int, count: int) -> None:
    assert step_count(step, total) == count


def test_pause_is_seconds_or_manual() -> None:
    assert Strategy(pause="manual").manual and Strategy(pause="manual").pause_s == 0.0
    assert Strategy(pause=30).pause_s == 30.0 and not Strategy(pause=30).manual
    with pytest.raises(ValidationError):
        Strategy.model_validate({"pause": "auto"})


def test_phases_that_end_a_rollout() -> None:
    ended = {p for p in ControlPhase if p.terminal}
    assert ended == {
        ControlPhase.SUCCEEDED,
        ControlPhase.ABORTED,
        ControlPhase.ROLLED_BACK,
        ControlPhase.REJECTED,
    }


# --------------------------------------------------------------------------- fuzz


@st.composite
def control_mutants(draw: st.DrawFn) -> bytes:
    """A valid record of each kind, mutated as the protocol fuzz mutates messages."""
    tree: Any = json.loads(encode(draw(st.sampled_from(RECORDS))))
    for _ in range(draw(st.integers(1, 3))):
        if isinstance(tree, Pairs) or not containers(tree):
            break
        tree = draw(mutate(tree))
    return draw(wire_bytes(dump(tree)))


@fuzz(200)
@given(data=control_mutants() | st.binary(max_size=200))
def test_any_bytes_decode_to_a_record_or_a_coded_refusal(data: bytes) -> None:
    try:
        record = decode_control(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, WireCode), exc
    else:
        assert decode_control(encode(record)) == record
        assert control_key(record)
