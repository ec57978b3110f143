"""Checks and error translation for vLLM's update_config overrides; pure, no vllm import.

It refuses up front what vLLM would refuse or apply wrongly, and maps vLLM's errors to our codes.
It never calls the engine (the runner does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.wire.errors import RunnerError, WireCode
from workers.runners.vllm_sidecar import SidecarError, worker_message

#: The sections vLLM's worker accepts in update_config, in the order this runner applies them.
CONFIG_SECTIONS = ("model_config", "load_config")
_CLASS_NAMES = {"model_config": "ModelConfig", "load_config": "LoadConfig"}
#: Load formats that read the safetensors files this runner validated (others read other files,
#: or none: "dummy" would load random weights).
SAFE_LOAD_FORMATS = frozenset({"auto", "safetensors"})
#: load_config fields that would change which files vLLM reads.
UNSAFE_LOAD_FIELDS = frozenset({"ignore_patterns", "download_dir"})


def normalize_overrides(overrides: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"load_config": {"f": v}}`` or ``{"load_config.f": v}`` -> ``{"load_config": {"f": v}}``."""
    if not isinstance(overrides, Mapping):
        raise RunnerError(
            f"overrides must be an object, got {type(overrides).__name__}",
            code=WireCode.CONFIG_VALUE_INVALID,
        )
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, dot, name = key.partition(".")
        if section not in CONFIG_SECTIONS:
            raise RunnerError(
                f"config override {section!r} is not supported; vLLM accepts "
                f"{', '.join(CONFIG_SECTIONS)} (as {{section: {{field: value}}}} or 'section.field')",
                code=WireCode.CONFIG_KEY_REJECTED,
            )
        if dot:
            items: dict[str, Any] = {name: value}
        elif isinstance(value, dict):
            items = value
        else:
            raise RunnerError(
                f"override {key!r} must be an object of {_CLASS_NAMES[section]} fields, "
                f"got {type(value).__name__}",
                code=WireCode.CONFIG_VALUE_INVALID,
            )
        nested.setdefault(section, {}).update(items)  # a later key wins, as in a dict update
    return nested


def check_overrides(
    nested: Mapping[str, Mapping[str, Any]],
    fields: Mapping[str, Mapping[str, Any]],
    *,
    model_config_ok: bool,
) -> None:
    """Refuse, before vLLM sees them, overrides it would refuse or apply wrongly."""
    for section, values in nested.items():
        if section == "model_config" and values and not model_config_ok:
            raise RunnerError(
                "this vLLM cannot apply model_config overrides (vLLM 0.32 fails every one with "
                "\"Field '_hf_config_revision' not found in ModelConfig\")",
                code=WireCode.CONFIG_KEY_REJECTED,
            )
        known = fields.get(section)
        if known is None:  # fields unknown (a sidecar whose /server_info failed): vLLM judges
            unknown = sorted(n for n in values if n.startswith("_"))
        else:
            unknown = sorted(n for n in values if n not in known or n.startswith("_"))
        if unknown:
            names = ", ".join(f"{_CLASS_NAMES[section]}.{n}" for n in unknown)
            raise RunnerError(
                f"{names}: not a valid config field", code=WireCode.CONFIG_KEY_REJECTED
            )
    load = nested.get("load_config", {})
    unsafe = sorted(UNSAFE_LOAD_FIELDS & set(load))
    if unsafe:
        raise RunnerError(
            f"load_config {unsafe} would change which files vLLM reads; this runner validates "
            "exactly the files it names",
            code=WireCode.CONFIG_KEY_REJECTED,
        )
    if "load_format" in load and load["load_format"] not in SAFE_LOAD_FORMATS:
        raise RunnerError(
            f"load_config.load_format {load['load_format']!r} is refused: the next reload would "
            f"fail or read unvalidated files; choose one of {sorted(SAFE_LOAD_FORMATS)}",
            code=WireCode.CONFIG_VALUE_INVALID,
        )


def translate_config_error(exc: BaseException, vllm_version: str, *, dry_run: bool) -> RunnerError:
    """vLLM's update_config error as our code (``dry_run``: nothing was applied)."""
    if isinstance(exc, SidecarError) and exc.status is None:
        return exc  # no answer (timeout, connection): keep the transport's code
    message = worker_message(exc.detail if isinstance(exc, SidecarError) else str(exc))
    if "_hf_config_revision" in message:
        return RunnerError(
            f"vLLM {vllm_version} cannot apply model_config overrides: {message}",
            code=WireCode.CONFIG_KEY_REJECTED,
        )
    if "is not supported. Supported configs" in message or "not a valid config field" in message:
        return RunnerError(message, code=WireCode.CONFIG_KEY_REJECTED)
    invalid = ("has no attribute 'items'", "must be a mapping", "validation error")
    if dry_run or any(marker in message for marker in invalid):
        return RunnerError(
            f"vLLM refused the overrides: {message}", code=WireCode.CONFIG_VALUE_INVALID
        )
    return RunnerError(f"vLLM failed to apply the overrides: {message}")


def merge_overrides(
    current: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    merged = {section: dict(values) for section, values in current.items()}
    for section, values in new.items():
        merged.setdefault(section, {}).update(values)
    return merged


def json_type(value: object) -> str:
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return name
    if isinstance(value, Mapping):
        return "object"
    return "array" if isinstance(value, list | tuple) else "any"
