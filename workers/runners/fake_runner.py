"""A runner without a model, for agent and benchmark tests: it records what it was told.

No torch. Scripted outcomes by version name: "fail-*" fails (RUNNER_FAILED), "corrupt-*" raises
WeightsCorrupted and degrades it, "badshape-*" is refused as a checkpoint whose shapes are not the
model's (WEIGHTS_SHAPE_MISMATCH, nothing changed). A reload still needs its path to exist. With
``load_error`` set its model never loads (a worker that must report RUNNER_LOAD_FAILED).

Its dry run (``validate_reload``) makes the checks a reload makes before it would change
anything: a model loaded, the path's files, "badshape-*"; "fail-*" and "corrupt-*" are failures of
applying, which a dry run cannot see, so they validate. Dry runs are recorded in ``validations``
and ``config_validations``, never in ``reloads``, ``history`` or ``config_updates``.

Its probe (:func:`fake_probe`) is a function of the version in force and the prompt: workers on
the same version agree. A version "badprobe-*" applies fine but probes with other tokens and a
mean log-probability of -50 (a checkpoint that validates, with wrong numbers); after a version
"probefail-*" the probe raises RUNNER_FAILED.

Its weights digest (:func:`fake_weights_digest`) is of the version in force, mixed with the
``digest_salt`` option: two workers on one version disagree when their salts differ. It has no
tensors, so not the torch runners' fingerprint; like theirs, ``describe()`` reports the digest in
force (``extra["weights_digest"]``, from load on; None while degraded), as do its acks.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from workers.runners.base import (
    DegradedInfo,
    ProbeResult,
    ReloadResult,
    RunnerConfig,
    RunnerDescription,
    accepted_keys,
    apply_overrides,
    config_digest,
    config_facts,
    parse_options,
)


class FakeRunnerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "fake"
    initial_version: str = Field(default="init", min_length=1, max_length=128)
    load_delay_s: float = Field(default=0.0, ge=0)
    load_error: str | None = Field(
        default=None, description="If set, load() fails with this message (nothing is loaded)."
    )
    reload_delay_s: float = Field(default=0.0, ge=0, description="Sleep per reload (cancellable).")
    fail_prefix: str = "fail-"
    corrupt_prefix: str = "corrupt-"
    shape_mismatch_prefix: str = Field(
        default="badshape-", description="Versions refused WEIGHTS_SHAPE_MISMATCH (checked)."
    )
    bad_probe_prefix: str = Field(
        default="badprobe-", description="Versions whose probe says the weights are wrong."
    )
    probe_fail_prefix: str = Field(
        default="probefail-", description="Versions whose probe raises RUNNER_FAILED."
    )
    probe_unsupported: bool = Field(default=False, description="probe() returns None.")
    probe_delay_s: float = Field(default=0.0, ge=0, description="Sleep per probe (until close).")
    config: dict[str, JsonValue] = Field(default_factory=dict, description="Initial overrides.")
    digest_salt: str = Field(
        default="", description="Mixed into the weights digest: a worker that disagrees."
    )


class FakeConfig(RunnerConfig):
    """The same keys as the torch runner, so agent tests exercise real validation."""

    max_new_tokens: int = Field(default=32, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0, le=100)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    sampling_seed: int = Field(default=0, ge=0, le=2**63 - 1)


class FakeRunner:
    name = "fake"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = parse_options(FakeRunnerOptions, options or {}, self.name)
        try:
            self._config = apply_overrides(FakeConfig(), self.options.config)
        except RunnerError as exc:
            raise ValueError(f"invalid initial config for runner 'fake': {exc}") from None
        self._lock = threading.Lock()
        self._loaded = False
        self._version: str | None = None
        self._degraded: DegradedInfo | None = None
        self._digest: str | None = None  # of the version in force; None while degraded
        #: Every version applied successfully, in order (the initial one first).
        self.history: list[str] = []
        #: Every reload spec received, applied or not.
        self.reloads: list[ReloadWeightsSpec] = []
        self.config_updates: list[dict[str, JsonValue]] = []
        #: Every dry run asked for: reload specs, and config overrides.
        self.validations: list[ReloadWeightsSpec] = []
        self.config_validations: list[dict[str, JsonValue]] = []
        #: Every probe asked for: (version in force, prompt, max_tokens).
        self.probes: list[tuple[str | None, str, int]] = []
        self._closed = threading.Event()  # ends a probe's delay

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            time.sleep(self.options.load_delay_s)
            if self.options.load_error is not None:
                raise RunnerError(f"cannot build the model: {self.options.load_error}")
            self._loaded = True
            self._closed.clear()
            self._version = self.options.initial_version
            self._digest = fake_weights_digest(self._version, self.options.digest_salt)
            self.history.append(self._version)

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        started = time.perf_counter()
        with self._lock:
            self.reloads.append(spec)
            files = self._check(spec, path)
            delay = self.options.reload_delay_s
            if cancel is not None:
                if cancel.wait(delay):
                    raise RunnerError("reload cancelled", code=WireCode.COMMAND_TIMEOUT)
            elif delay:
                time.sleep(delay)
            if spec.version.startswith(self.options.fail_prefix):
                raise RunnerError(f"scripted failure for {spec.version!r}")
            if spec.version.startswith(self.options.corrupt_prefix):
                error = WeightsCorrupted(
                    f"scripted corruption while copying {spec.version!r}",
                    from_version=self._version,
                    to_version=spec.version,
                )
                self._degraded = DegradedInfo.of(error)
                self._digest = None
                raise error
            self._version = spec.version
            self._degraded = None
            self._digest = digest = fake_weights_digest(spec.version, self.options.digest_salt)
            self.history.append(spec.version)
        size = sum(f.stat().st_size for f in files)
        stats = ReloadResult.measured(
            spec.version,
            files=len(files),
            tensors=0,
            nbytes=size,
            started=started,
            copy_started=started,  # nothing is checked: all of it counts as the copy
            finished=time.perf_counter(),
        )
        return ReloadResult.of(stats, weights_digest=digest)

    def validate_reload(self, spec: ReloadWeightsSpec, path: Path) -> dict[str, JsonValue]:
        with self._lock:
            self.validations.append(spec)
            files = self._check(spec, path)
        return {"files": len(files), "tensors": 0, "bytes": sum(f.stat().st_size for f in files)}

    def validate_config(self, overrides: dict[str, JsonValue]) -> dict[str, JsonValue]:
        with self._lock:
            self.config_validations.append(dict(overrides))
            apply_overrides(self._config, overrides)
        return config_facts(overrides)

    def _check(self, spec: ReloadWeightsSpec, path: Path) -> list[Path]:
        """A reload's checks before it would change anything (the lock held): its files."""
        if not self._loaded:
            raise RunnerError("no model is loaded", code=WireCode.MODEL_NOT_LOADED)
        files = _files(path)
        if spec.version.startswith(self.options.shape_mismatch_prefix):
            raise RunnerError(
                f"scripted shape mismatch for {spec.version!r} (checkpoint vs model)",
                code=WireCode.WEIGHTS_SHAPE_MISMATCH,
            )
        return files

    def update_config(self, overrides: dict[str, JsonValue]) -> RunnerDescription:
        with self._lock:
            self._config = apply_overrides(self._config, overrides)
            self.config_updates.append(dict(overrides))
        return self.describe()

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        with self._lock:
            self.probes.append((self._version, prompt, max_tokens))
            if not self._loaded or self._version is None:
                raise RunnerError("no model is loaded", code=WireCode.MODEL_NOT_LOADED)
            if self._degraded is not None:
                raise RunnerError(
                    f"refusing to probe: weights are degraded ({self._degraded.message})",
                    code=WireCode.WEIGHTS_CORRUPTED,
                )
            version = self._version
        if self.options.probe_delay_s:
            self._closed.wait(self.options.probe_delay_s)
        if self.options.probe_unsupported:
            return None
        if version.startswith(self.options.probe_fail_prefix):
            raise RunnerError(f"scripted probe failure for {version!r}")
        return fake_probe(
            version, prompt, max_tokens, bad=version.startswith(self.options.bad_probe_prefix)
        )

    def describe(self) -> RunnerDescription:
        config = self._config.model_dump(mode="json")
        return RunnerDescription(
            runner=self.name,
            device=self.options.device,
            model_loaded=self._loaded,
            weights_version=self._version if self._loaded else None,
            config=config,
            config_digest=config_digest(config),
            accepts=accepted_keys(FakeConfig),
            degraded=self._degraded,
            extra={"reloads": len(self.reloads), "weights_digest": self._digest},
        )

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._loaded = False


def fake_probe(version: str, prompt: str, max_tokens: int, *, bad: bool = False) -> ProbeResult:
    """The fake runner's probe of ``prompt`` on ``version``: byte tokens from a sha256 of both,
    and a mean log-probability in [-2, -0.5]; ``bad`` weights give other tokens and -50."""
    seed = f"{'bad' if bad else 'ok'}\0{version}\0{prompt}".encode()
    stream = b""
    counter = 0
    while len(stream) < max_tokens + 1:
        stream += hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        counter += 1
    tokens = list(stream[1 : max_tokens + 1])
    mean = -50.0 if bad else -0.5 - 1.5 * stream[0] / 255
    return ProbeResult.of(tokens, [mean] * len(tokens))


def fake_weights_digest(version: str, salt: str = "") -> str:
    """The fake runner's weights digest: the sha256 (64 lowercase hex digits) of ``version``,
    or of ``version``, a NUL and ``salt`` when a salt is set."""
    data = version if not salt else f"{version}\0{salt}"
    return hashlib.sha256(data.encode()).hexdigest()


def _files(path: Path) -> list[Path]:
    try:
        if path.is_file():
            return [path]
        if path.is_dir():
            return sorted(p for p in path.iterdir() if p.is_file())
    except OSError as exc:
        raise RunnerError(
            f"cannot read {str(path)!r}: {exc}", code=WireCode.WEIGHTS_UNREADABLE
        ) from None
    raise RunnerError(f"checkpoint {str(path)!r} does not exist", code=WireCode.WEIGHTS_UNREADABLE)
