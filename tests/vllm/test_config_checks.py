"""The vLLM runner's pure parts: override checks, error translation, options (no engine)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from controlplane.wire.errors import RunnerError, WireCode
from workers.runners.vllm_config import check_overrides, normalize_overrides, translate_config_error
from workers.runners.vllm_runner import VllmRunnerOptions
from workers.runners.vllm_sidecar import SidecarError, is_loopback_url, worker_message

FIELDS = {
    "load_config": {"load_format": "auto", "ignore_patterns": [], "use_tqdm_on_load": True},
    "model_config": {"max_logprobs": 20, "_hf_config_revision": None},
}


def code_of(overrides: dict[str, object], *, model_config_ok: bool = True) -> WireCode | None:
    try:
        check_overrides(normalize_overrides(overrides), FIELDS, model_config_ok=model_config_ok)
    except RunnerError as exc:
        return exc.code
    return None


def test_nested_and_dotted_forms_merge_and_a_later_key_wins() -> None:
    nested = normalize_overrides(
        {"load_config": {"load_format": "auto", "use_tqdm_on_load": False},
         "load_config.load_format": "safetensors"}
    )  # fmt: skip
    assert nested == {"load_config": {"load_format": "safetensors", "use_tqdm_on_load": False}}


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"foo_config": {}}, WireCode.CONFIG_KEY_REJECTED),
        ({"foo_config.x": 1}, WireCode.CONFIG_KEY_REJECTED),
        ({"load_config": {"no_such_field": 1}}, WireCode.CONFIG_KEY_REJECTED),
        ({"model_config": {"_hf_config_revision": "x"}}, WireCode.CONFIG_KEY_REJECTED),
        ({"load_config": 5}, WireCode.CONFIG_VALUE_INVALID),
        ({"load_config": [1]}, WireCode.CONFIG_VALUE_INVALID),
        ({"load_config": {"load_format": "bogus"}}, WireCode.CONFIG_VALUE_INVALID),
        ({"load_config": {"load_format": "dummy"}}, WireCode.CONFIG_VALUE_INVALID),
        ({"load_config": {"ignore_patterns": ["*.safetensors"]}}, WireCode.CONFIG_KEY_REJECTED),
        ({"load_config": {"load_format": "safetensors"}}, None),
        ({"load_config.use_tqdm_on_load": False}, None),
        ({"model_config": {"max_logprobs": 3}}, None),
    ],
)
def test_checks_before_vllm(overrides: dict[str, object], code: WireCode | None) -> None:
    assert code_of(overrides) == code


def test_model_config_is_refused_where_vllm_cannot_apply_it() -> None:
    assert code_of({"model_config": {"max_logprobs": 3}}, model_config_ok=False) == (
        WireCode.CONFIG_KEY_REJECTED
    )
    assert code_of({"model_config": {}}, model_config_ok=False) is None


def test_non_mapping_overrides_are_invalid() -> None:
    with pytest.raises(RunnerError) as caught:
        normalize_overrides(5)  # type: ignore[arg-type]
    assert caught.value.code is WireCode.CONFIG_VALUE_INVALID


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("Config override 'foo_config' is not supported. Supported configs: load_config, "
         "model_config", WireCode.CONFIG_KEY_REJECTED),
        ("LoadConfig.no_such_field is not a valid config field", WireCode.CONFIG_KEY_REJECTED),
        ("'int' object has no attribute 'items'", WireCode.CONFIG_VALUE_INVALID),
        ("Field '_hf_config_revision' not found in ModelConfig.", WireCode.CONFIG_KEY_REJECTED),
        ("something else entirely", WireCode.RUNNER_FAILED),
    ],
)  # fmt: skip
def test_vllm_messages_translate_raw_and_wrapped(message: str, code: WireCode) -> None:
    wrapped = (
        f"Call to collective_rpc method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause"
    )
    assert worker_message(wrapped) == message
    assert translate_config_error(ValueError(message), "0.32.0", dry_run=False).code is code
    over_http = SidecarError("HTTP 500", code=WireCode.RUNNER_FAILED, status=500, detail=wrapped)
    assert translate_config_error(over_http, "0.32.0", dry_run=False).code is code


def test_a_transport_failure_keeps_its_code() -> None:
    timeout = SidecarError("timed out", code=WireCode.COMMAND_TIMEOUT)
    assert translate_config_error(timeout, "0.32.0", dry_run=False) is timeout


def test_sidecar_must_be_on_loopback_unless_allowed() -> None:
    assert is_loopback_url("http://127.0.0.1:8000") and is_loopback_url("http://[::1]:8000")
    assert is_loopback_url("http://localhost:8000") and not is_loopback_url("http://10.0.0.5:80")
    with pytest.raises(ValueError, match="not loopback"):
        VllmRunnerOptions(mode="sidecar", model="/m", base_url="http://10.0.0.5:8000")
    VllmRunnerOptions(
        mode="sidecar", model="/m", base_url="http://10.0.0.5:8000", allow_remote=True
    )
