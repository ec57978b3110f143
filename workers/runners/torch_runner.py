"""A runner that holds one PyTorch model on a CPU or CUDA device and reloads it in place.

It owns the model, its lock and its drain gate; checkpoint parsing and copying live in
loaders.py. It never touches Kafka or asyncio: the agent calls it from a worker thread.

Requests (``generate``, ``probe``, ``forward_logits``) run concurrently under the drain gate,
shared. A reload checks the checkpoint while they go on (``prepare_checkpoint``), then holds the
gate alone for the copy, after draining them by the spec's drain policy
(:class:`~workers.runners.base.DrainGate`): every request runs wholly on one version, and
requests wait for the copy only. A dry run (``validate_reload``) is the checks alone.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from workers.runners.base import (
    DegradedInfo,
    DrainGate,
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
from workers.runners.tiny_lm import build_model, encode_text
from workers.weights.digest import weights_digest
from workers.weights.loaders import (
    DEFAULT_STAGING_BYTES,
    CopiedBytesMismatch,
    PreparedCheckpoint,
    load_checkpoint,
    module_targets,
    prepare_checkpoint,
)
from workers.weights.oms import ModelTrust, SignedDigests, load_model_trust
from workers.weights.stats import LoadStats

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class TorchRunnerOptions(BaseModel):
    """How to build the model; fixed for the runner's life (from CLI flags or env JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "cpu"
    factory: str = Field(
        default="workers.runners.tiny_lm:tiny_lm", pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
    )
    model_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    seed: int = 0
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    initial_checkpoint: str | None = None
    initial_version: str = Field(default="init", min_length=1, max_length=128)
    config: dict[str, JsonValue] = Field(default_factory=dict, description="Initial overrides.")
    slow_copy_s: float = Field(default=0.0, ge=0, description="Test knob: sleep per tensor copied.")
    staging_bytes: int = Field(default=DEFAULT_STAGING_BYTES, ge=1024 * 1024)
    read_threads: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Threads reading each tensor into host memory; default min(torch threads, 4).",
    )
    host_alias: bool = Field(
        default=True,
        description="Read straight into device buffers that are host memory (XLA on PJRT's CPU).",
    )
    model_trust: list[str] = Field(
        default_factory=list,
        description="Trusted model keys (ECDSA public keys, PEM files): a checkpoint's model.sig"
        " must verify with one of them (workers/weights/oms.py).",
    )
    require_model_signature: bool = Field(
        default=False, description="Refuse checkpoints without a model.sig (needs model_trust)."
    )

    @field_validator("device")
    @classmethod
    def _parseable_device(cls, value: str) -> str:
        try:
            torch.device(value)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        return value


@dataclass(frozen=True)
class _InForce:
    """The checkpoint the weights in force came from, and what they were verified against:
    loaded again, checked the same way, when a reload fails its check after copying began."""

    path: Path
    version: str
    strict: bool
    sha256: Mapping[str, str] | None
    signed: SignedDigests | None


class TorchConfig(RunnerConfig):
    """Runtime settings the torch runner accepts in update_config."""

    max_new_tokens: int = Field(default=32, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0, le=100)
    top_k: int = Field(default=0, ge=0, le=1_000_000, description="0 disables top-k.")
    sampling_seed: int = Field(default=0, ge=0, le=2**63 - 1)


class TorchRunner:
    """One ``torch.nn.Module`` on one device, reloaded in place.

    Reloads, config changes, load and close are serialized by a lock; requests are not (see
    the module's docstring), except where ``_one_request_at_a_time`` says so.
    """

    name = "torch"
    options_model: type[TorchRunnerOptions] = TorchRunnerOptions
    config_model: type[TorchConfig] = TorchConfig

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = parse_options(self.options_model, options or {}, self.name)
        try:
            self._config = apply_overrides(self.config_model(), self.options.config)
        except RunnerError as exc:
            raise ValueError(f"invalid initial config for runner {self.name!r}: {exc}") from None
        self._lock = threading.Lock()  # the model: load, reload, config, close
        self._gate = DrainGate()  # requests shared, a reload's copy alone
        self._serial = threading.Lock()  # requests one at a time, where the device needs it
        self._state = threading.Lock()  # the facts describe() reads, never held for long
        self._model: torch.nn.Module | None = None
        self._device: torch.device | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._aliases: dict[str, str] = {}
        self._version: str | None = None
        self._degraded: DegradedInfo | None = None
        self._phase = "idle"
        self._progress = (0, 0)
        self._last_reload: ReloadResult | None = None
        self._digest: str | None = None  # of the weights in force; None while degraded
        self._in_force: _InForce | None = None  # None: seeded weights, nothing to restore
        try:
            self._trust: ModelTrust | None = load_model_trust(
                self.options.model_trust, required=self.options.require_model_signature
            )
        except ValueError as exc:
            raise ValueError(f"runner {self.name!r}: {exc}") from None

    # ------------------------------------------------------------------ hardware hooks

    def _resolve_device(self) -> torch.device:
        device = torch.device(self.options.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RunnerError(f"device {device} requested but CUDA is not available")
        return device

    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _device_label(self) -> str:
        return str(self._device if self._device is not None else self.options.device)

    def _pad_to(self, model: torch.nn.Module) -> int | None:
        return None

    #: Whether requests run one at a time (a device whose tracing is not safe across threads).
    _one_request_at_a_time = False

    def _to_host(self, samples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``samples`` (small device tensors) on the host, in order: one copy each by default."""
        return [s.cpu() for s in samples]

    def _weights_digest(self, targets: Mapping[str, torch.Tensor]) -> str:
        """The fingerprint of ``targets`` as the device holds them (``weights_digest``)."""
        with torch.no_grad():
            return weights_digest(targets, to_host=self._to_host)

    def _host_alias(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A CPU tensor sharing ``tensor``'s memory, for a device whose buffers are host memory.

        Called under the model lock, with no computation in flight, just before a copy; the
        loader then reads the file straight into the alias. None (the default): copy to the
        device through the device's own path.
        """
        return None

    def _copy_targets(self, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the loader writes: each target, or its host alias where the device offers one."""
        if not self.options.host_alias:
            return targets
        out: dict[str, torch.Tensor] = {}
        for name, tensor in targets.items():
            alias = self._host_alias(tensor)
            out[name] = tensor if alias is None else alias
        return out

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        with self._lock:
            if self._model is not None:
                return
            device = self._resolve_device()
            model = self._build_model()
            if self.options.dtype is not None:
                model = model.to(DTYPE_NAMES[self.options.dtype])
            model = model.to(device).eval().requires_grad_(False)
            tie = getattr(model, "tie_weights", None)
            if callable(tie):
                tie()  # moving to XLA unties shared parameters
            self._device = device
            targets, aliases = module_targets(model)
            in_force = None
            if self.options.initial_checkpoint is not None:
                self._sync()  # nothing may still be writing the buffers aliased below
                initial = Path(self.options.initial_checkpoint)
                stats = load_checkpoint(
                    initial,
                    self._copy_targets(targets),
                    version=self.options.initial_version,
                    from_version=None,
                    aliases=aliases,
                    staging_bytes=self.options.staging_bytes,
                    sync=self._sync,
                    read_threads=self.options.read_threads,
                    model_trust=self._trust,
                )
                in_force = _InForce(initial, self.options.initial_version, True, None, stats.signed)
            else:
                self._sync()
            digest = self._weights_digest(targets)
            with self._state:
                self._model, self._targets, self._aliases = model, targets, aliases
                self._version = self.options.initial_version
                self._degraded = None
                self._digest = digest
                self._in_force = in_force

    def _build_model(self) -> torch.nn.Module:
        try:
            return build_model(self.options.factory, self.options.model_kwargs, self.options.seed)
        except (ValueError, TypeError) as exc:
            raise RunnerError(f"cannot build the model: {exc}") from exc

    def close(self) -> None:
        with self._lock, self._state:
            self._model = None
            self._targets, self._aliases = {}, {}

    # ------------------------------------------------------------------ commands

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        """Prepare (every check, the model serving meanwhile), then drain by the spec's policy
        and copy: requests are held off for the copy only (``result.drain.paused_s``)."""
        with self._lock:
            self._require_loaded(spec.version)
            from_version = self._version
            try:
                self._set_phase("validating", (0, 0))  # requests are served meanwhile
                with self._prepare(spec, path, cancel) as prepared:
                    if self._in_force is None and not prepared.bytes_verified:
                        prepared.verify_bytes(cancel)  # nothing to restore: hashed first
                    self._set_phase("draining", (0, 0))  # requests in flight hold it off
                    with self._gate.exclusive(spec.drain_policy, cancel=cancel) as hold:
                        stats = self._copy_drained(spec, path, prepared, from_version, cancel)
            finally:
                self._set_phase("idle", (0, 0))
            result = ReloadResult.of(stats, weights_digest=self._digest, drain=hold.report)
            with self._state:
                self._last_reload = result
            return result

    def validate_reload(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> dict[str, JsonValue]:
        """A dry run of :meth:`reload_weights`: the same checks, then every byte the copy would
        hash is hashed from the files (the manifest's, the signed spans); nothing is copied and
        requests are served throughout. Raises the RunnerError the reload would raise."""
        started = time.perf_counter()
        with self._lock:
            self._require_loaded(spec.version)
            try:
                self._set_phase("validating", (0, 0))
                with self._prepare(spec, path, cancel, dry_run=True) as prepared:
                    prepared.verify_bytes(cancel)
                    facts = prepared.facts()
            finally:
                self._set_phase("idle", (0, 0))
        facts["validate_s"] = round(time.perf_counter() - started, 6)
        return facts

    def validate_config(self, overrides: dict[str, JsonValue]) -> dict[str, JsonValue]:
        apply_overrides(self._config, overrides)  # raises; the config in force is not changed
        return config_facts(overrides)

    def _require_loaded(self, version: str) -> None:
        if self._model is None:
            raise RunnerError(
                f"cannot reload {version!r}: no model is loaded", code=WireCode.MODEL_NOT_LOADED
            )

    def _prepare(
        self,
        spec: ReloadWeightsSpec,
        path: Path,
        cancel: threading.Event | None,
        *,
        dry_run: bool = False,
    ) -> contextlib.AbstractContextManager[PreparedCheckpoint]:
        """The checkpoint checked against the model (the model lock held; the targets only
        read, so requests go on). A reload hashes the manifest's data files as it copies when
        what is in force can be restored; a dry run hashes them all now."""
        return prepare_checkpoint(
            path,
            self._targets,
            strict=spec.strict,
            sha256=spec.sha256,
            aliases=self._aliases,
            cancel=cancel,
            model_trust=self._trust,
            sha256_while_copying=self._in_force is not None and not dry_run,
        )

    def _copy_drained(
        self,
        spec: ReloadWeightsSpec,
        path: Path,
        prepared: PreparedCheckpoint,
        from_version: str | None,
        cancel: threading.Event | None,
    ) -> LoadStats:
        """The copy, once no request is in flight (the model lock and the gate held); the
        weights in force are what was copied, or restored, or degraded."""
        try:
            stats = prepared.copy(
                self._copy_targets(self._targets),
                version=spec.version,
                from_version=from_version,
                cancel=cancel,
                staging_bytes=self.options.staging_bytes,
                progress=lambda done, total: self._on_copy_progress(done, total, cancel),
                sync=self._sync,
                read_threads=self.options.read_threads,
                verify_first=self._in_force is None,
            )
        except CopiedBytesMismatch as exc:
            self._restore_or_degrade(exc)  # raises
        except WeightsCorrupted as exc:
            self._mark_degraded(exc)
            raise
        # The copy succeeded: the fingerprint is read back from the model itself.
        digest = self._weights_digest(self._targets)
        with self._state:
            self._version = spec.version
            self._degraded = None
            self._digest = digest
            self._in_force = _InForce(path, spec.version, spec.strict, spec.sha256, stats.signed)
        return stats

    def _mark_degraded(self, exc: WeightsCorrupted) -> None:
        with self._state:
            self._degraded = DegradedInfo.of(exc)
            self._digest = None

    def _restore_or_degrade(self, exc: CopiedBytesMismatch) -> None:
        """The bytes copied were not the signed ones: load the checkpoint in force before again,
        verified against the digests it was loaded with, and NACK CHECKSUM_MISMATCH (or
        COMMAND_TIMEOUT, cancelled while hashing) with the version unchanged. Degraded
        (WeightsCorrupted) when there is none (seeded weights) or it cannot be restored.
        Always raises."""
        before = self._in_force
        if before is None:
            self._mark_degraded(exc)
            raise exc
        self._set_phase("restoring", (0, 0))
        try:
            self._load_in_force(before, failed=exc.to_version)
        except RunnerError as restore_failed:
            corrupted = WeightsCorrupted(
                f"{exc.message}; restoring {before.version!r} from {str(before.path)!r} failed"
                f" too ({restore_failed.message})",
                from_version=before.version,
                to_version=exc.to_version,
            )
            self._mark_degraded(corrupted)
            raise corrupted from exc
        raise RunnerError(
            f"{exc.message}; {before.version!r} was restored from {str(before.path)!r}",
            code=exc.nack_code,
        ) from exc

    def _load_in_force(self, before: _InForce, *, failed: str) -> LoadStats:
        return load_checkpoint(
            before.path,
            self._copy_targets(self._targets),
            version=before.version,
            from_version=failed,
            strict=before.strict,
            sha256=before.sha256,
            aliases=self._aliases,
            staging_bytes=self.options.staging_bytes,
            sync=self._sync,
            read_threads=self.options.read_threads,
            model_trust=self._trust,
            signed=before.signed,
        )

    def _on_copy_progress(self, done: int, total: int, cancel: threading.Event | None) -> None:
        self._set_phase("copying", (done, total))
        if self.options.slow_copy_s > 0 and 0 < done < total:
            if cancel is not None:
                cancel.wait(self.options.slow_copy_s)
            else:
                time.sleep(self.options.slow_copy_s)

    def _set_phase(self, phase: str, progress: tuple[int, int]) -> None:
        with self._state:
            self._phase, self._progress = phase, progress

    def update_config(self, overrides: dict[str, JsonValue]) -> RunnerDescription:
        with self._lock:
            config = apply_overrides(self._config, overrides)
            with self._state:
                self._config = config
        return self.describe()

    def describe(self) -> RunnerDescription:
        with self._state:
            model = self._model
            config = self._config.model_dump(mode="json")
            extra: dict[str, JsonValue] = {
                "factory": self.options.factory,
                "phase": self._phase,
                "progress": list(self._progress),
                "last_reload": self._last_reload.as_dict() if self._last_reload else None,
                "weights_digest": self._digest,
            }
            if model is not None:
                extra["tensors"] = len(self._targets)
                extra["parameters"] = sum(t.numel() for t in self._targets.values())
                extra["bytes"] = sum(t.numel() * t.element_size() for t in self._targets.values())
            return RunnerDescription(
                runner=self.name,
                device=self._device_label(),
                model_loaded=model is not None,
                weights_version=self._version if model is not None else None,
                config=config,
                config_digest=config_digest(config),
                accepts=accepted_keys(self.config_model),
                degraded=self._degraded,
                extra=extra,
            )

    # ------------------------------------------------------------------ serving

    @property
    def drain_gate(self) -> DrainGate:
        """The gate requests and reloads pass (see :class:`~workers.runners.base.DrainGate`)."""
        return self._gate

    @contextlib.contextmanager
    def _request(self) -> Iterator[threading.Event]:
        """Admitted through the drain gate (and one at a time where the device needs it);
        yields the request's abort flag."""
        with self._gate.request() as aborted:
            if not self._one_request_at_a_time:
                yield aborted
                return
            with self._serial:
                yield aborted

    def generate(self, prompt: str | Sequence[int]) -> list[int]:
        """New token ids for ``prompt`` (text is byte-tokenized) under the current config, all
        generated with one version of the weights: a reload waits for it or, with the drain
        policy ``abort``, makes it raise GenerationAborted (RUNNER_FAILED) with no tokens."""
        ids = encode_text(prompt) if isinstance(prompt, str) else list(prompt)
        with self._request() as aborted:
            model = self._serving_model()
            generate = getattr(model, "generate", None)
            if not callable(generate):
                raise RunnerError(f"model {type(model).__name__} has no generate()")
            config = self._config
            # A model's generate that takes ``stop`` ends at its next token when aborted; one
            # that does not runs to its end (the reload waits for it), and fails all the same.
            stop = {"stop": aborted} if _takes_stop(generate) else {}
            out: list[int] = generate(
                ids,
                config.max_new_tokens,
                temperature=config.temperature,
                top_k=config.top_k,
                seed=config.sampling_seed,
                pad_to=self._pad_to(model),
                **stop,
            )
            DrainGate.check(aborted)
            return out

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        """Greedy tokens after ``prompt`` (byte-tokenized) and their mean log-probability,
        whatever the sampling config; None when the model has no ``next_logits`` (a factory's
        model that is not the built-in one)."""
        ids = encode_text(prompt)
        with self._request() as aborted:
            model = self._serving_model()
            next_logits = getattr(model, "next_logits", None)
            if not callable(next_logits):
                return None
            vocab = getattr(model, "vocab_size", None)
            if isinstance(vocab, int) and max(ids, default=0) >= vocab:
                raise RunnerError(
                    f"probe: the prompt's byte tokens exceed the model's vocabulary of {vocab}",
                    code=WireCode.RUNNER_FAILED,
                )
            pad_to = self._pad_to(model)
            tokens: list[int] = []
            logprobs: list[float] = []
            with torch.no_grad():
                for _ in range(max_tokens):
                    DrainGate.check(aborted)
                    logits: torch.Tensor = next_logits(ids, pad_to=pad_to)
                    # The log-softmax in float64 on the host: no rounding of its own to speak of.
                    logp = torch.log_softmax(logits.double(), dim=-1)
                    token = int(torch.argmax(logp))
                    tokens.append(token)
                    logprobs.append(float(logp[token]))
                    ids.append(token)
        return ProbeResult.of(tokens, logprobs)

    def forward_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Float32 CPU logits ``[len(ids), vocab]``; a diagnostic that works even when degraded."""
        with self._request():
            model = self._require_model()
            length = len(ids)
            pad_to = self._pad_to(model)
            window = list(ids) + [0] * ((pad_to or length) - length)
            batch = torch.tensor([window], dtype=torch.long, device=self._device)
            with torch.no_grad():
                logits: torch.Tensor = model(batch)[0].float().cpu()[:length]
            return logits

    def _require_model(self) -> torch.nn.Module:
        if self._model is None:
            raise RunnerError("no model is loaded", code=WireCode.MODEL_NOT_LOADED)
        return self._model

    def _serving_model(self) -> torch.nn.Module:
        model = self._require_model()
        if self._degraded is not None:
            raise RunnerError(
                f"refusing to serve: weights are degraded ({self._degraded.message})",
                code=WireCode.WEIGHTS_CORRUPTED,
            )
        return model


def _takes_stop(generate: Callable[..., Any]) -> bool:
    """Whether a model's ``generate`` takes ``stop`` (an event: end at the next token)."""
    try:
        return "stop" in inspect.signature(generate).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False
