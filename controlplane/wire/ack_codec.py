"""A compiled decoder for acks (msgspec), for the coordinator's fold of the acks topic.

:func:`decode_ack_fast` accepts a subset of what :func:`controlplane.wire.codec.decode_ack` accepts
and gives equal values for it; anything else goes to ``decode_ack``. What it guards and why:
docs/wire.md ("The fast ack decoder"); ``tests/unit/test_ack_codec_*.py`` show each guard.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, Protocol, TypeAlias

import msgspec

from controlplane.wire.codec import decode_ack
from controlplane.wire.messages import (
    EARLIEST_TIME,
    IDENTIFIER,
    LATEST_TIME,
    MAX_COUNTER,
    MAX_MESSAGE_BYTES,
    Ack,
    AckError,
    AckState,
    CommandKind,
)

# --------------------------------------------------------------------------- the read-only shape


class AckErrorLike(Protocol):
    """What the fold reads of an ack's error: :class:`AckError` or :class:`FastAckError`."""

    @property
    def code(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def retryable(self) -> bool: ...


class TimingsLike(Protocol):
    @property
    def received_at(self) -> datetime: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def finished_at(self) -> datetime | None: ...


class AckLike(Protocol):
    """An ack as the fold reads it: the pydantic :class:`Ack` or the fast :class:`FastAck`."""

    @property
    def schema_version(self) -> int: ...
    @property
    def command_id(self) -> str: ...
    @property
    def rollout_id(self) -> str: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def kind(self) -> CommandKind | None: ...
    @property
    def state(self) -> AckState: ...
    @property
    def weights_version(self) -> str | None: ...
    @property
    def config_digest(self) -> str | None: ...
    @property
    def error(self) -> AckErrorLike | None: ...
    @property
    def timings(self) -> TimingsLike: ...
    @property
    def attempt(self) -> int: ...
    @property
    def sent_at(self) -> datetime: ...
    @property
    def result(self) -> Mapping[str, Any]: ...


# --------------------------------------------------------------------------- the structs

#: Containers nested in ``result`` at most this deep on the fast path (pydantic: about 200).
#: msgspec builds a node per union member, 2**depth of them: keep it small.
MAX_RESULT_DEPTH: Final = 8

_Scalar: TypeAlias = str | int | float | bool | None
if TYPE_CHECKING:
    _JsonValue: TypeAlias = Any
else:
    # Bounded-depth JSON values: msgspec refuses anything deeper, and the canonical decoder decides.
    _JsonValue = _Scalar
    for _ in range(MAX_RESULT_DEPTH):
        _JsonValue = _Scalar | list[_JsonValue] | dict[str, _JsonValue]

_Aware = Annotated[datetime, msgspec.Meta(tz=True)]


# Every field is required here, defaults included: the duplicate-key guard counts on knowing
# which keys a message wrote (see the module's docstring). Our producers write them all.


class FastAckError(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    code: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    retryable: bool


class FastTimings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    received_at: _Aware
    started_at: _Aware | None
    finished_at: _Aware | None

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class FastAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """An :class:`Ack` as msgspec decodes it; not tracked by the garbage collector (no cycles)."""

    schema_version: Literal[1]
    command_id: str
    rollout_id: str
    worker_id: str
    state: AckState
    timings: FastTimings
    sent_at: _Aware
    kind: CommandKind | None
    weights_version: str | None
    config_digest: str | None
    error: FastAckError | None
    attempt: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNTER)]
    result: dict[str, _JsonValue]

    @classmethod
    def of(cls, ack: Ack) -> FastAck:
        """The same ack as a FastAck (for what only the canonical decoder accepted)."""
        t, e = ack.timings, ack.error
        return cls(
            schema_version=1,
            command_id=ack.command_id,
            rollout_id=ack.rollout_id,
            worker_id=ack.worker_id,
            state=ack.state,
            timings=FastTimings(t.received_at, t.started_at, t.finished_at),
            sent_at=ack.sent_at,
            kind=ack.kind,
            weights_version=ack.weights_version,
            config_digest=ack.config_digest,
            error=None if e is None else FastAckError(e.code, e.message, e.retryable),
            attempt=ack.attempt,
            result=dict(ack.result),
        )


def as_model_error(error: AckErrorLike) -> AckError:
    """The pydantic AckError of either kind of error (status models are pydantic)."""
    if isinstance(error, AckError):
        return error
    return AckError(code=error.code, message=error.message, retryable=error.retryable)


# --------------------------------------------------------------------------- the decoder

_decode: Final = msgspec.json.Decoder(FastAck).decode  # strict: no "1" for 1, no 1.0 for 1
_UTF8_BOM: Final = b"\xef\xbb\xbf"
_IDENTIFIER_FULLMATCH: Final = re.compile(IDENTIFIER).fullmatch
#: "-DD HH:" of a date-time with a space separator.
_SPACED_DATETIME: Final = re.compile(rb"-[0-9]{2} [0-9]{2}:")
#: The tail of a date-time whose offset lacks its colon: ":MM:SS[.fff]+HHMM" and the quote.
_COLONLESS_OFFSET: Final = re.compile(rb":[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?[+-][0-9]{4}\"")
_FAILED, _REJECTED, _SUCCEEDED = AckState.FAILED, AckState.REJECTED, AckState.SUCCEEDED
#: Date-times in these years are surely in the protocol's range, whatever their offset.
_SAFE_YEARS: Final = range(EARLIEST_TIME.year + 1, LATEST_TIME.year - 1)
_FIRST_SAFE_YEAR, _LAST_SAFE_YEAR = _SAFE_YEARS[0], _SAFE_YEARS[-1]
#: Distinct keys of an ack without its result: 13 fields, 3 in timings (3 more in an error).
_ACK_KEYS: Final = 16
#: Colons inside sent_at and received_at, at least.
_TWO_STAMPS: Final = 4

#: Identifiers known to fullmatch the protocol's pattern. Cleared when it reaches the bound.
_valid_ids: set[str] = set()
_MAX_VALID_IDS: Final = 1 << 16


def decode_ack_fast(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> FastAck:
    """Decode an ack: equal in value to ``decode_ack(data)``, and refused exactly when it is
    (with its ProtocolError), only faster for the acks our producers write."""
    if len(data) <= max_bytes:
        try:
            ack = _decode(data[3:] if data.startswith(_UTF8_BOM) else data)
        except Exception:  # any refusal is the canonical decoder's to explain
            pass
        else:
            if _plausible(ack, data):
                return ack
    return FastAck.of(decode_ack(data, max_bytes=max_bytes))


def _plausible(ack: FastAck, data: bytes) -> bool:
    """Whether msgspec's acceptance is also pydantic's, with equal values (the module's guards).

    The raw-bytes checks are single C scans of the message; the precise regexes run only when
    a scan finds something (an error message with spaces, a non-UTC offset)."""
    if data.find(b"\\") != -1:  # find: a memchr, twice as fast as `in` here
        return False
    if data.find(b" ") != -1 and _SPACED_DATETIME.search(data) is not None:
        return False
    # No object repeats a key: every key is followed by one colon outside strings, so the
    # colons, less those known to be inside strings, bound the keys written; they must not
    # exceed the distinct keys decoded (whitespace anywhere changes nothing).
    t = ack.timings
    started, finished = t.started_at, t.finished_at
    error = ack.error
    keys = data.count(b":") - _TWO_STAMPS
    if started is not None:
        keys -= 2  # a date-time msgspec takes holds at least 2 colons (HH:MM:SS)
    if finished is not None:
        keys -= 2
    if error is not None:
        keys -= 3 + error.code.count(":") + error.message.count(":")
    result = ack.result
    if keys != _ACK_KEYS + len(result):  # rarely: colons in other strings, a nested result
        keys -= _colons_in_other_strings(ack)
        if keys != _ACK_KEYS + len(result) and keys != _ACK_KEYS + _count_keys(result):
            return False
    if not (
        _FIRST_SAFE_YEAR <= ack.sent_at.year <= _LAST_SAFE_YEAR
        and _FIRST_SAFE_YEAR <= t.received_at.year <= _LAST_SAFE_YEAR
        and (started is None or _FIRST_SAFE_YEAR <= started.year <= _LAST_SAFE_YEAR)
        and (finished is None or _FIRST_SAFE_YEAR <= finished.year <= _LAST_SAFE_YEAR)
    ):
        return False
    # A colonless offset: a datetime not in UTC, or one in UTC written +0000 or -0000.
    if (
        ack.sent_at.tzinfo is not UTC
        or t.received_at.tzinfo is not UTC
        or (started is not None and started.tzinfo is not UTC)
        or (finished is not None and finished.tzinfo is not UTC)
        or data.find(b'0000"') != -1
    ) and _COLONLESS_OFFSET.search(data) is not None:
        return False
    state = ack.state
    if error is None:
        if state is _FAILED or state is _REJECTED:
            return False
    elif state is _SUCCEEDED:
        return False
    ids = _valid_ids
    command_id, rollout_id, worker_id = ack.command_id, ack.rollout_id, ack.worker_id
    if command_id in ids and rollout_id in ids and worker_id in ids:
        return True
    for value in (command_id, rollout_id, worker_id):
        if value not in ids:
            if _IDENTIFIER_FULLMATCH(value) is None:
                return False
            if len(ids) >= _MAX_VALID_IDS:
                ids.clear()
            ids.add(value)
    return True


def _count_keys(value: Any) -> int:
    """Keys in every object of a decoded JSON value."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += len(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _colons_in_other_strings(ack: FastAck) -> int:
    """Colons surely inside the strings of ``ack`` that the first count left out: its ids,
    versions and date-time offsets (+hh:mm; a colonless one is refused by its own guard)."""
    t = ack.timings
    count = ack.command_id.count(":") + ack.rollout_id.count(":") + ack.worker_id.count(":")
    for text in (ack.weights_version, ack.config_digest):
        if text is not None:
            count += text.count(":")
    for stamp in (ack.sent_at, t.received_at, t.started_at, t.finished_at):
        if stamp is not None and stamp.tzinfo is not UTC:
            count += 1
    return count
