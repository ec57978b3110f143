"""The runners' validation messages, byte for byte: every error with its input, then how many more."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, create_model, model_validator

from controlplane.wire.errors import RunnerError, WireCode
from workers.runners.base import RunnerConfig, apply_overrides, parse_options

#: Seven integer keys, a to g: two more than a message lists.
SEVEN_KEYS: dict[str, Any] = {k: (int, 0) for k in "abcdefg"}
Seven = create_model("Seven", __base__=RunnerConfig, **SEVEN_KEYS)


def test_config_values_past_the_fifth_are_counted() -> None:
    with pytest.raises(RunnerError) as refused:
        apply_overrides(Seven(), {k: "x" for k in "abcdefg"})
    assert refused.value.code is WireCode.CONFIG_VALUE_INVALID
    got = "Input should be a valid integer (got 'x')"
    assert refused.value.message == (
        f"invalid config value(s): a: {got}; b: {got}; c: {got}; d: {got}; e: {got}; ... and 2 more"
    )


def test_a_model_level_error_is_named_root() -> None:
    class Options(BaseModel):
        low: int = 0
        high: int = 0

        @model_validator(mode="after")
        def _ordered(self) -> Options:
            if self.low > self.high:
                raise ValueError("low is above high")
            return self

    with pytest.raises(ValueError) as refused:
        parse_options(Options, {"low": 2, "high": 1}, "torch")
    assert str(refused.value) == (
        "invalid options for runner 'torch': <root>: Value error, low is above high "
        "(got {'low': 2, 'high': 1})"
    )
