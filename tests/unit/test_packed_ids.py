"""Long lists of worker ids go packed on the wire (controlplane/wire/packed.py): a command pinned
to 50,000 workers stays well under the 1 MiB a message may have, reads back the same, and a
packed list that does not hold together is refused with a coded error."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from datetime import UTC, datetime

import pytest

from controlplane.wire.control import ControlPhase, RolloutState, decode_control
from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.packed import PACK_MIN_IDS, pack, unpack
from controlplane.wire.protocol import MAX_MESSAGE_BYTES, decode_command, encode
from tests.factories import command
from tests.unit.test_schemas import schema_errors

FLEET = [f"worker-{i:05d}" for i in range(50_000)]


def _command(ids: list[str]) -> bytes:
    return encode(command(workers=ids))


def test_a_command_pinned_to_50000_workers_is_well_under_the_message_limit() -> None:
    raw = _command(FLEET)
    assert len(raw) < MAX_MESSAGE_BYTES / 4
    plain = len(json.dumps(FLEET))
    assert plain > MAX_MESSAGE_BYTES * 3 / 4  # as a JSON array it nearly filled a message
    command = decode_command(raw)
    assert command.selector.worker_ids == FLEET
    assert command.selector.matches("worker-49999", {}) and not command.selector.matches("x", {})
    body = json.loads(raw)["selector"]["worker_ids"]
    assert body["count"] == 50_000 and body["packed"] == "gzip"
    assert body["sha256"] == hashlib.sha256("\n".join(FLEET).encode()).hexdigest()
    assert not schema_errors("command", json.loads(raw))


def test_short_lists_stay_plain_arrays() -> None:
    ids = FLEET[:PACK_MIN_IDS]
    assert json.loads(_command(ids))["selector"]["worker_ids"] == ids
    assert isinstance(
        json.loads(_command(FLEET[: PACK_MIN_IDS + 1]))["selector"]["worker_ids"], dict
    )


def test_order_is_kept_and_a_rollout_state_packs_its_waves() -> None:
    waves = [FLEET[:1], FLEET[1:5000][::-1], FLEET[5000:]]
    now = datetime(2026, 1, 1, tzinfo=UTC)
    state = RolloutState(
        rollout_id="r1",
        target="big",
        revision=0,
        phase=ControlPhase.PROGRESSING,
        waves=waves,
        failed=FLEET[:2000],
        started_at=now,
        updated_at=now,
    )
    raw = encode(state)
    assert len(raw) < MAX_MESSAGE_BYTES / 4
    back = decode_control(raw)
    assert isinstance(back, RolloutState)
    assert back.waves == waves and back.failed == FLEET[:2000]


def _tampered(**change: object) -> bytes:
    body = json.loads(_command(FLEET[:2000]))
    body["selector"]["worker_ids"].update(change)
    return json.dumps(body).encode()


def _gz(text: str) -> str:
    return base64.b64encode(zlib.compress(text.encode(), wbits=31)).decode()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"sha256": "0" * 64}, "sha256 does not match"),
        ({"count": 1999}, "count says 1999, data holds 2000"),
        ({"data": "not base64!"}, "not base64"),
        ({"data": base64.b64encode(b"plain bytes").decode()}, "not gzip"),
        ({"packed": "zstd"}, "packed ids"),
        ({"extra": 1}, "packed ids"),
    ],
)
def test_a_packed_list_that_does_not_hold_together_is_refused(
    change: dict[str, object], why: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_command(_tampered(**change))
    assert caught.value.code is WireCode.SCHEMA_INVALID
    assert why in str(caught.value)


def test_a_gzip_bomb_stops_at_what_its_count_allows() -> None:
    """One id said, 50 MB of data inflated: refused after at most 129 bytes."""
    bomb = base64.b64encode(zlib.compress(b"a" * 50_000_000, 9, wbits=31)).decode()
    with pytest.raises(ProtocolError) as caught:
        decode_command(_tampered(count=1, data=bomb, sha256="0" * 64))
    assert "does not inflate to 1 ids" in str(caught.value)


def test_ids_inside_a_packed_list_are_validated_like_listed_ones() -> None:
    ids = [*FLEET[:1500], "not an id!"]
    joined = "\n".join(ids)
    packed = {"count": len(ids), "sha256": hashlib.sha256(joined.encode()).hexdigest()}
    with pytest.raises(ProtocolError) as caught:
        decode_command(_tampered(data=_gz(joined), **packed))
    assert caught.value.code is WireCode.SCHEMA_INVALID


def test_pack_and_unpack_are_inverse() -> None:
    for ids in ([], ["a"], FLEET[:3], FLEET):
        assert unpack(pack(ids)) == ids


def test_packing_again_answers_from_the_last_lists_packed_and_only_for_the_same_ids() -> None:
    from controlplane.wire import packed as packed_module

    lists = [[f"w-{n}-{i}" for i in range(1_500)] for n in range(packed_module._PACKED_MAX + 3)]
    first = [packed_module.pack(ids) for ids in lists]
    assert len(packed_module._PACKED) == packed_module._PACKED_MAX
    assert packed_module.pack(lists[-1]) is first[-1]  # held
    for ids, made in zip(lists, first, strict=True):
        again = packed_module.pack(list(ids))
        assert again == made and packed_module.unpack(again) == ids
