"""The model runner interface, the registry of runners, and the small types they share.

No torch here: the agent imports this on any machine; runner modules are imported lazily by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.messages import WEIGHTS_DIGEST_PATTERN, DrainPolicy
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
    ``drain``: what the reload's drain policy did to requests in flight, likewise.
    """

    weights_digest: str | None = None
    drain: DrainReport | None = None

    @classmethod
    def of(
        cls,
        stats: LoadStats,
        *,
        weights_digest: str | None = None,
        drain: DrainReport | None = None,
    ) -> ReloadResult:
        fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(LoadStats)}
        return cls(**fields, weights_digest=weights_digest, drain=drain)

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
        if self.drain is not None:
            out["drain"] = self.drain.as_dict()
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

    def validate_reload(self, spec: ReloadWeightsSpec, path: Path) -> dict[str, JsonValue]:
        """Every check reload_weights makes before it would touch the model (signature, files,
        every header's names/shapes/dtypes against the model, the sha256 manifest), the model
        untouched and serving. Raises RunnerError with the code reload_weights would raise.
        Returns facts: tensors, bytes, files. (A dry run; ``path`` is resolved and contained.)"""

    def validate_config(self, overrides: dict[str, JsonValue]) -> dict[str, JsonValue]:
        """update_config's checks (keys, values), config untouched. RunnerError
        CONFIG_KEY_REJECTED / CONFIG_VALUE_INVALID. Returns facts: keys."""

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        """Greedy-decode ``max_tokens`` tokens after ``prompt`` with the weights in force.

        Deterministic for the same weights, in any process. None: this runner cannot probe.
        Raises RunnerError (no model, degraded weights, a prompt the model cannot read).
        """

    def describe(self) -> RunnerDescription: ...

    def close(self) -> None:
        """Release the model; idempotent."""


# --------------------------------------------------------------------------- drain


class GenerationAborted(RunnerError):
    """A request in flight was aborted by a reload with the ``abort`` drain policy: it returned
    no tokens (none of them generated with the new weights). Retry it: it runs on the new ones."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=WireCode.RUNNER_FAILED)


@dataclass(frozen=True)
class DrainReport:
    """What a reload's drain did: the mode applied, how long new requests were held off
    (``paused_s``: from asking for the gate to releasing it: the wait for the requests in
    flight, then the copy; the checks run before it, while serving), how many requests were in
    flight, and how many it aborted."""

    mode: str
    paused_s: float
    in_flight: int
    aborted: int

    def as_dict(self) -> dict[str, JsonValue]:
        return {
            "mode": self.mode,
            "paused_s": round(self.paused_s, 6),
            "in_flight": self.in_flight,
            "aborted": self.aborted,
        }


#: How often a drain waiting for requests looks at the command's cancel event.
_CANCEL_POLL_S: Final = 0.05


@dataclass
class DrainHold:
    """A reload holding the gate alone (:meth:`DrainGate.exclusive`): what its drain did, and
    when it asked for the gate and released it (``time.monotonic()``)."""

    mode: str
    in_flight: int
    aborted: int
    asked: float
    released: float | None = None

    @property
    def report(self) -> DrainReport:
        """The drain's report; ``paused_s`` up to the release (up to now while still held)."""
        end = self.released if self.released is not None else time.monotonic()
        return DrainReport(self.mode, end - self.asked, self.in_flight, self.aborted)


class DrainGate:
    """A reader/writer gate between requests (generate, probe: shared) and reloads (exclusive),
    so a request runs wholly before or wholly after a reload, never across one.

    A reload asking for the gate stops admitting requests at once (they wait, they are not
    refused), then, by its :class:`~controlplane.wire.messages.DrainPolicy`:

    - ``wait``: lets the requests in flight finish, up to ``timeout_s``. Past it the reload
      gives up with COMMAND_TIMEOUT before touching any weight, and requests are admitted again.
    - ``abort``: flags every request in flight; each stops at its next token and raises
      :class:`GenerationAborted`. The reload waits for them to stop (bounded by ``timeout_s``:
      a model that cannot be interrupted runs to its end, as for wait).
    - ``keep``: as ``wait``. A request here cannot be paused mid-generation and resumed on the
      new weights without its tokens mixing both versions, which this gate exists to prevent.

    The command's ``cancel`` event (its own timeout, a shutdown) ends a drain the same way as
    its deadline. Requests never wait for each other; reloads wait for each other.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests: set[threading.Event] = set()  # one per admitted request: set = abort it
        self._draining = False  # a reload holds the gate or is draining for it

    @contextlib.contextmanager
    def request(self) -> Iterator[threading.Event]:
        """Admit one request (waiting while a reload drains or runs); yields its abort flag,
        which the request checks between tokens (:meth:`check`)."""
        with self._cond:
            while self._draining:
                self._cond.wait()
            flag = threading.Event()
            self._requests.add(flag)
        try:
            yield flag
        finally:
            with self._cond:
                self._requests.discard(flag)
                self._cond.notify_all()

    @staticmethod
    def check(flag: threading.Event) -> None:
        """Raise GenerationAborted when a reload aborted the request holding ``flag``."""
        if flag.is_set():
            raise GenerationAborted(
                "aborted: the weights are being reloaded (drain policy abort); retry it"
            )

    @contextlib.contextmanager
    def exclusive(
        self, policy: DrainPolicy, *, cancel: threading.Event | None = None
    ) -> Iterator[DrainHold]:
        """Hold the gate alone, draining requests in flight by ``policy`` first; the hold's
        :attr:`~DrainHold.report` covers the drain and the body, once the block ends.

        Raises RunnerError COMMAND_TIMEOUT when they are still running at the policy's deadline
        or ``cancel`` is set first: nothing was touched, requests are admitted again."""
        started = time.monotonic()
        deadline = started + policy.timeout_s
        with self._cond:
            while self._draining:  # another reload: wait for it, under the same deadline
                self._wait(deadline, cancel, policy, "another reload")
            self._draining = True
            self._cond.notify_all()  # wait_draining
            in_flight = len(self._requests)
            aborted = 0
            try:
                if policy.mode == "abort":
                    for flag in self._requests:
                        flag.set()
                    aborted = in_flight
                while self._requests:
                    self._wait(deadline, cancel, policy, f"{len(self._requests)} request(s)")
            except BaseException:
                self._draining = False
                self._cond.notify_all()
                raise
        hold = DrainHold(policy.mode, in_flight, aborted, started)
        try:
            yield hold
        finally:
            with self._cond:
                self._draining = False
                hold.released = time.monotonic()
                self._cond.notify_all()

    def wait_draining(self, timeout: float | None = None) -> bool:
        """Block until a reload drains for the gate or holds it (no request is admitted from
        then on); False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._draining, timeout)

    def _wait(
        self, deadline: float, cancel: threading.Event | None, policy: DrainPolicy, what: str
    ) -> None:
        """One wait on the condition (lock held); RunnerError COMMAND_TIMEOUT once it is over."""
        left = deadline - time.monotonic()
        if cancel is not None and cancel.is_set():
            raise RunnerError(
                f"drain ({policy.mode}) cancelled while {what} still ran; weights untouched",
                code=WireCode.COMMAND_TIMEOUT,
            )
        if left <= 0:
            raise RunnerError(
                f"drain ({policy.mode}): {what} still running after {policy.timeout_s:g} s"
                " (the drain deadline); weights untouched",
                code=WireCode.COMMAND_TIMEOUT,
            )
        self._cond.wait(min(left, _CANCEL_POLL_S) if cancel is not None else left)


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


def config_facts(overrides: Mapping[str, Any]) -> dict[str, JsonValue]:
    """What a config dry run checked (``validate_config``'s facts): the keys."""
    keys: list[JsonValue] = [str(key) for key in sorted(overrides)]
    return {"keys": keys}


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
