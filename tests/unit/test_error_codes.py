"""Every error code is emitted somewhere and tested, or it does not exist.

A code that nothing emits is a promise to CI scripts and dashboards that nothing keeps. Plain
text checks over the tree: the source (``controlplane/``, ``workers/``, outside ``errors.py``
itself) must write ``WireCode.NAME`` or ``LocalCode.NAME`` somewhere, and some test must name
its value.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controlplane.wire.errors import (
    REJECTION_CODES,
    RETRYABLE_CODES,
    CommandRejected,
    LocalCode,
    WireCode,
)
from controlplane.wire.protocol import AckError

ROOT = Path(__file__).resolve().parents[2]
ERRORS_PY = ROOT / "controlplane" / "wire" / "errors.py"


def _read(paths: list[Path]) -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted(paths))


SOURCE = _read(
    [
        path
        for top in ("controlplane", "workers")
        for path in (ROOT / top).rglob("*.py")
        if path != ERRORS_PY
    ]
)
TESTS = _read([path for path in (ROOT / "tests").rglob("*.py") if path != Path(__file__)])
CODES: list[WireCode | LocalCode] = [*WireCode, *LocalCode]


@pytest.mark.parametrize("code", CODES, ids=str)
def test_every_code_is_emitted_by_the_source(code: WireCode | LocalCode) -> None:
    assert re.search(rf"\b{type(code).__name__}\.{code.name}\b", SOURCE), (
        f"nothing in controlplane/ or workers/ emits {code.value}: emit it or remove it"
    )


@pytest.mark.parametrize("code", CODES, ids=str)
def test_every_code_is_named_by_a_test(code: WireCode | LocalCode) -> None:
    assert re.search(rf"\b{code.value}\b", TESTS), f"no test names {code.value}"


def test_the_module_that_defines_the_codes_is_the_one_left_out() -> None:
    """The exclusion above must name the real module, or its own sets would count as emitting."""
    assert ERRORS_PY.is_file()


def test_no_code_is_both_wire_and_local() -> None:
    """One value, one meaning: a code either travels in messages or stays with its tool."""
    assert not {code.value for code in WireCode} & {code.value for code in LocalCode}
    assert all(code.name == code.value for code in CODES)


@pytest.mark.parametrize(
    ("code", "typed"),
    [
        ("EXPIRED", WireCode),
        (WireCode.RUNNER_FAILED, WireCode),
        (LocalCode.KAFKA_ERROR, str),  # not a code of the wire: as another producer's would be
        ("SOMEONE_ELSES", str),
    ],
)
def test_an_ack_error_code_is_a_wire_code_or_kept_as_a_str(code: str, typed: type) -> None:
    error = AckError(code=code, message="m")
    assert type(error.code) is typed and error.code == code
    again = AckError.model_validate_json(error.model_dump_json())
    assert again == error and type(again.code) is typed
    assert error.model_dump_json() == f'{{"code":"{code}","message":"m","retryable":false}}'


def test_the_code_sets_hold_only_codes_that_exist() -> None:
    assert set(RETRYABLE_CODES) <= set(CODES)
    assert set(REJECTION_CODES) <= set(CODES)
    assert not RETRYABLE_CODES & {WireCode.MALFORMED_JSON, WireCode.DUPLICATE_KEY}


SIGNATURE_CODES = (
    "SIGNATURE_MISSING",
    "SIGNATURE_INVALID",
    "KEY_UNKNOWN",
    "KEY_REVOKED",
    "SCOPE_DENIED",
)


@pytest.mark.parametrize("name", SIGNATURE_CODES)
def test_signature_codes_came_back_with_their_emitter_as_rejections(name: str) -> None:
    """Signing's codes exist since the worker emits them (workers/agent/trust.py): refused
    before anything changed, and retrying the same command cannot succeed."""
    code = WireCode(name)
    assert code in REJECTION_CODES and code not in RETRYABLE_CODES


def test_a_refused_command_always_says_why() -> None:
    """CommandRejected has no default code: each raise names the reason."""
    with pytest.raises(TypeError):
        CommandRejected("refused")  # type: ignore[call-arg]
    err = CommandRejected("expired", code=WireCode.EXPIRED)
    assert (err.code, err.is_rejection, err.retryable) == (WireCode.EXPIRED, True, False)


def test_codes_without_an_emitter_are_gone() -> None:
    """UNSUPPORTED_COMMAND had none: the command kinds are a closed union the decoder enforces."""
    assert "UNSUPPORTED_COMMAND" not in {code.name for code in CODES}
