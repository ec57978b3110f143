"""The model runner interface, the registry of runners, and the small types they share.

No torch here: the agent imports this on any machine; runner modules are imported lazily by name.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.messages import WEIGHTS_DIGEST_PATTERN
from controlplane.wire.protocol import ReloadWeightsSpec
from controlplane.wire.validation import summarize
from workers.weights.stats import LoadStats

#: Runner name -> "module:class", imported only when that runner is created.
RUNNERS: Final[Mapping[str, str]] = {
    "torch": "workers.runners.torch_runner:TorchRunner",
    "xla": "workers.runners.xla_runner:XlaRunner",
    "fake": "workers.runners.fake_runner:FakeRunner",
    "vllm": "workers.runners.vllm_runner:VllmRunner",
}


@dataclass(frozen=True)
class DegradedInfo:
    """A reload failed after copying began: the model holds a mix of two versions."""

    code: str
    message: str
    from_version: str | None
    to_version: str
    since: datetime

    @classmethod
    def of(cls, error: WeightsCorrupted) -> DegradedInfo:
        """The state ``error`` leaves a runner in, from now on."""
        return cls(
            code=error.code.value,
            message=error.message,
            from_version=error.from_version,
            to_version=error.to_version,
            since=datetime.now(UTC),
        )


@dataclass(frozen=True)
class RunnerDescription:
    """What a runner reports about itself; the agent turns it into heartbeats and acks."""

    runner: str
    device: str
    model_loaded: bool
    weights_version: str | None
    config: dict[str, JsonValue]
    config_digest: str
    accepts: dict[str, str]
    degraded: DegradedInfo | None = None
    extra: dict[str, JsonValue] = field(default_factory=dict)

    @property
    def weights_digest(self) -> str | None:
        """The digest of the weights the model holds now, as its succeeded reload acks report it
        (``extra["weights_digest"]``, every runner the same way); None: not known (degraded,
        not loaded, or a runner that cannot tell)."""
        digest = self.extra.get("weights_digest")
        if isinstance(digest, str) and _WEIGHTS_DIGEST.fullmatch(digest):
            return digest
        return None  # what a heartbeat could not carry is not reported


_WEIGHTS_DIGEST: Final = re.compile(WEIGHTS_DIGEST_PATTERN)


@dataclass(frozen=True)
class ReloadResult(LoadStats):
    """Facts about one successful reload (they go into the ack's ``result``).

    ``weights_digest``: a fingerprint of the weights the model holds after it (see
    ``workers.weights.digest``; the fake runner's is of the version), in the result only when set.
    """

    weights_digest: str | None = None

    @classmethod
    def of(cls, stats: LoadStats, *, weights_digest: str | None = None) -> ReloadResult:
        fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(LoadStats)}
        return cls(**fields, weights_digest=weights_digest)

    def as_dict(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {
            "version": self.version,
            "files": self.files,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "validate_s": round(self.validate_s, 6),
            "copy_s": round(self.copy_s, 6),
            "duration_s": round(self.duration_s, 6),
            "gbps": round(self.gbps, 3),
        }
        if self.weights_digest is not None:
            out["weights_digest"] = self.weights_digest
        return out


@dataclass(frozen=True)
class ProbeResult:
    """What a probe generated: greedy token ids, and the mean over them of the log-probability
    of each chosen token (it goes into the succeeded ack as ``result["probe"]``)."""

    tokens: tuple[int, ...]
    mean_logprob: float

    @classmethod
    def of(cls, tokens: Sequence[int], logprobs: Sequence[float]) -> ProbeResult:
        """From each generated token and its log-probability; RunnerError when one is not a
        finite number (NaN or infinity in the logits: an ack cannot carry it)."""
        if not tokens or len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} tokens and {len(logprobs)} log-probabilities")
        mean = math.fsum(logprobs) / len(logprobs)
        if not math.isfinite(mean):
            raise RunnerError(
                f"probe: the log-probabilities of the generated tokens are not finite ({mean})",
                code=WireCode.RUNNER_FAILED,
            )
        return cls(tuple(int(t) for t in tokens), mean)

    def as_dict(self) -> dict[str, JsonValue]:
        return {"tokens": list(self.tokens), "mean_logprob": round(self.mean_logprob, 6)}


@runtime_checkable
class Runner(Protocol):
    """One model on one device. Methods are synchronous; the agent calls them off the event loop.

    ``describe`` must be cheap and must not wait for a reload in progress (heartbeats call it).
    """

    name: str

    def load(self) -> None:
        """Build the model and its initial weights (seeded init or an initial checkpoint)."""

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        """Validate the checkpoint at ``path`` (already resolved and root-checked), then copy it in.

        Raises RunnerError (model untouched) or WeightsCorrupted (copy began; runner degraded).
        """

    def update_config(self, overrides: dict[str, JsonValue]) -> RunnerDescription:
        """Apply overrides all or nothing; RunnerError CONFIG_KEY_REJECTED / CONFIG_VALUE_INVALID."""

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        """Greedy-decode ``max_tokens`` tokens after ``prompt`` with the weights in force.

        Deterministic for the same weights, in any process. None: this runner cannot probe.
        Raises RunnerError (no model, degraded weights, a prompt the model cannot read).
        """

    def describe(self) -> RunnerDescription: ...

    def close(self) -> None:
        """Release the model; idempotent."""


# --------------------------------------------------------------------------- config


class RunnerConfig(BaseModel):
    """Base of a runner's runtime config: strict JSON types (a bool is not an int), no extras."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


ConfigT = TypeVar("ConfigT", bound=RunnerConfig)
OptionsT = TypeVar("OptionsT", bound=BaseModel)


def config_digest(config: Mapping[str, JsonValue]) -> str:
    """First 16 hex digits of the sha256 of the canonical JSON of ``config``."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def accepted_keys(model: type[RunnerConfig]) -> dict[str, str]:
    """Config key -> JSON type name ("integer", "number", "boolean", "string", "integer|null")."""
    return dict(_accepted_keys(model))


@functools.cache
def _accepted_keys(model: type[RunnerConfig]) -> dict[str, str]:  # describe() runs often
    properties: dict[str, Any] = model.model_json_schema().get("properties", {})
    out: dict[str, str] = {}
    for key, prop in properties.items():
        if "type" in prop:
            out[key] = str(prop["type"])
        elif "anyOf" in prop:
            out[key] = "|".join(str(p.get("type", "any")) for p in prop["anyOf"])
        else:
            out[key] = "any"
    return out


def apply_overrides(current: ConfigT, overrides: Mapping[str, Any]) -> ConfigT:
    """A new config with ``overrides`` applied, or RunnerError; ``current`` is never changed."""
    model = type(current)
    unknown = sorted(k for k in overrides if k not in model.model_fields)
    if unknown:
        raise RunnerError(
            f"unknown config key(s) {unknown}; accepted: {sorted(model.model_fields)}",
            code=WireCode.CONFIG_KEY_REJECTED,
        )
    try:
        return model.model_validate({**current.model_dump(), **overrides})
    except ValidationError as exc:
        raise RunnerError(
            f"invalid config value(s): {summarize_validation(exc)}",
            code=WireCode.CONFIG_VALUE_INVALID,
        ) from None


def parse_options(model: type[OptionsT], options: Mapping[str, Any], runner: str) -> OptionsT:
    """Validate a runner's construction options (from CLI/env JSON); ValueError when bad."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        raise ValueError(
            f"invalid options for runner {runner!r}: {summarize_validation(exc)}"
        ) from None


def summarize_validation(exc: ValidationError, limit: int = 5) -> str:
    """The first ``limit`` errors, each with the input it refused."""
    return summarize(exc, limit=limit, show_input=True)


# --------------------------------------------------------------------------- registry


def create_runner(name: str, options: Mapping[str, Any] | None = None) -> Runner:
    """Import and construct the runner called ``name``; the model is built later by ``load()``.

    Raises ValueError for an unknown name or invalid options, and RunnerError with code
    RUNNER_LOAD_FAILED when the runner's libraries cannot be imported here (``xla`` without
    torch_xla): a worker asked for a runner never silently runs another.
    """
    target = RUNNERS.get(name)
    if target is None:
        raise ValueError(f"unknown runner {name!r}; choose one of: {', '.join(sorted(RUNNERS))}")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RunnerError(
            f"runner {name!r} is not available here: {exc}", code=WireCode.RUNNER_LOAD_FAILED
        ) from exc
    cls = getattr(module, attr)
    runner: Runner = cls(dict(options or {}))
    return runner
