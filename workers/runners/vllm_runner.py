"""A runner that drives a real vLLM engine's reload_weights and update_config RPCs.

Two shapes: a ``vllm.LLM`` in this process, or a ``vllm serve`` sidecar on loopback (HTTP, see
vllm_sidecar.py). Every checkpoint is checked against the loaded one's manifest (loaders.py)
before vLLM sees it, and the prefix cache is reset after a reload. Never imports ``vllm._C``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from controlplane.wire.errors import ErrorCode, RunnerError, WeightsCorrupted
from controlplane.wire.protocol import ReloadWeightsSpec
from workers.runners.base import (
    DegradedInfo,
    ReloadResult,
    RunnerDescription,
    config_digest,
    parse_options,
)
from workers.runners.vllm_config import (
    CONFIG_SECTIONS,
    check_overrides,
    json_type,
    merge_overrides,
    normalize_overrides,
    translate_config_error,
)
from workers.runners.vllm_sidecar import SidecarClient, SidecarEngine, is_loopback_url
from workers.weights.checks import DTYPES, OpenCheckpoint, TensorEntry, plan_copy, verify_sha256
from workers.weights.loaders import open_checkpoint
from workers.weights.paths import checkpoint_files

#: The index name vLLM's default loader honours; with none it reads every *.safetensors file.
VLLM_INDEX_NAME = "model.safetensors.index.json"
#: Set (unless already set) before an in-process engine imports vllm.
IN_PROCESS_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
_RESET_TRIES = 5
#: Snapshot directories inside the snapshot root are named with this prefix (and only they are
#: ever removed from a root the operator named).
SNAPSHOT_PREFIX = "v-"
_COPY_CHUNK = 8 * 1024 * 1024


class VllmRunnerOptions(BaseModel):
    """How to reach the engine; fixed for the runner's life (from CLI flags or env JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["in_process", "sidecar"] = "in_process"
    model: str = Field(min_length=1, description="Checkpoint directory the engine starts from.")
    initial_version: str = Field(default="init", min_length=1, max_length=128)
    engine_args: dict[str, JsonValue] = Field(
        default_factory=dict, description="in_process: keyword arguments of vllm.LLM."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="in_process: environment set before vllm is imported."
    )
    base_url: str = Field(default="http://127.0.0.1:8000", pattern=r"^https?://")
    served_model_name: str | None = None
    api_key: str | None = None
    allow_remote: bool = Field(
        default=False, description="Allow a non-loopback base_url (its dev endpoints are open)."
    )
    pause_mode: Literal["wait", "abort"] = "wait"
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=60.0, gt=0)
    reload_timeout_s: float = Field(default=600.0, gt=0)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    snapshot_dir: str | None = Field(
        default=None,
        description="Directory this runner owns for the private, verified copies of the "
        "checkpoints vLLM loads (default: a new private directory under the system temp dir). "
        "A sidecar must be able to read it at the same path.",
    )

    @model_validator(mode="after")
    def _loopback(self) -> VllmRunnerOptions:
        if self.mode == "sidecar" and not self.allow_remote and not is_loopback_url(self.base_url):
            raise ValueError(
                f"base_url {self.base_url!r} is not loopback: vLLM's dev endpoints are "
                "unauthenticated; bind vllm serve to 127.0.0.1 (or set allow_remote)"
            )
        return self


class InProcessEngine:
    """A ``vllm.LLM`` in this process; the runner's lock serializes generation and reloads."""

    def __init__(self, options: VllmRunnerOptions) -> None:
        self.options = options
        self.vllm_version = "unknown"
        self.device = "unknown"
        self.dtype = "unknown"
        self._llm: Any = None

    def start(self) -> bool:
        for key, value in IN_PROCESS_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.update(self.options.env)
        import vllm
        from vllm.platforms import current_platform

        self._llm = vllm.LLM(model=self.options.model, **self.options.engine_args)
        self.vllm_version = str(vllm.__version__)
        self.device = str(current_platform.device_type)
        self.dtype = str(self._vllm_config().model_config.dtype).removeprefix("torch.")
        return False

    def _vllm_config(self) -> Any:
        return self._llm.llm_engine.vllm_config

    def config_fields(self) -> dict[str, dict[str, Any]]:
        config = self._vllm_config()
        out: dict[str, dict[str, Any]] = {}
        for section in CONFIG_SECTIONS:
            current = getattr(config, section)
            out[section] = {
                f.name: getattr(current, f.name, None) for f in dataclasses.fields(current)
            }
        return out

    def dry_run_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """vLLM's own (pure) override function on the live configs: raises what the worker would."""
        from vllm.config.utils import update_config

        config = self._vllm_config()
        for section, values in overrides.items():
            update_config(getattr(config, section), values)

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        self._llm.collective_rpc("update_config", args=(overrides,))

    def pause(self) -> None:
        pass  # generation runs only under the runner's lock

    def resume(self) -> None:
        pass

    def reload(self, weights_dir: str) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})

    def reset_prefix_cache(self) -> bool:
        return bool(self._llm.reset_prefix_cache())

    def generate(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self._llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        return [int(t) for t in outputs[0].outputs[0].token_ids]

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm


Engine = InProcessEngine | SidecarEngine  # one interface: start, reload, reset_prefix_cache, ...


class VllmRunner:
    """One vLLM engine, reloaded through its RPCs; every command serialized by one lock."""

    name = "vllm"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = parse_options(VllmRunnerOptions, options or {}, self.name)
        if self.options.mode == "in_process" and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "runner 'vllm' in_process needs vllm in this environment "
                "(scripts/setup-vllm.sh builds one); mode 'sidecar' does not"
            )
        self._lock = threading.Lock()  # the engine: generate, reload, config, close
        self._state = threading.Lock()  # the facts describe() reads, never held for long
        self._engine: Engine | None = None
        self._fields: dict[str, dict[str, Any]] = {}
        self._reference: dict[str, torch.Tensor] = {}  # the loaded checkpoint's manifest
        self._weights_dir: Path | None = None
        self._version: str | None = None
        self._overrides: dict[str, dict[str, Any]] = {}
        self._model_config_ok = True
        self._degraded: DegradedInfo | None = None
        self._phase = "idle"
        self._last_reload: ReloadResult | None = None
        self._started_s: float | None = None
        self._snapshots: SnapshotRoot | None = None
        self._loaded_dir: Path | None = None  # the directory vLLM last loaded (a snapshot)

    # ------------------------------------------------------------------ lifecycle

    def _make_engine(self) -> Engine:
        if self.options.mode == "in_process":
            return InProcessEngine(self.options)
        client = SidecarClient(
            self.options.base_url,
            api_key=self.options.api_key,
            connect_timeout_s=self.options.connect_timeout_s,
            request_timeout_s=self.options.request_timeout_s,
        )
        return SidecarEngine(
            client,
            model=self.options.model,
            served_model_name=self.options.served_model_name,
            startup_timeout_s=self.options.startup_timeout_s,
            reload_timeout_s=self.options.reload_timeout_s,
            pause_mode=self.options.pause_mode,
        )

    def load(self) -> None:
        with self._lock:
            if self._engine is not None:
                return
            weights_dir = Path(self.options.model).resolve()
            # The operator's own path (vLLM loads it by name at start): contained nowhere.
            with open_checkpoint(weights_dir, roots=[Path("/")]) as ckpt:
                reference = _manifest(ckpt.entries)
            snapshots = SnapshotRoot.create(self.options.snapshot_dir)
            started = time.perf_counter()
            engine = self._make_engine()
            try:
                was_paused = engine.start()
                fields = engine.config_fields()
            except Exception:
                engine.close()
                snapshots.close()
                raise
            try:  # a no-op override: vLLM 0.32 fails every model_config one, before any change
                engine.dry_run_config({"model_config": {}})
                if self.options.mode == "sidecar":
                    engine.update_config({"model_config": {}})
            except Exception:
                self._model_config_ok = False
            with self._state:
                self._engine, self._fields, self._reference = engine, fields, reference
                self._weights_dir, self._version = weights_dir, self.options.initial_version
                self._snapshots, self._loaded_dir = snapshots, weights_dir
                self._started_s = time.perf_counter() - started
                if was_paused:
                    self._degraded = self._degraded_info(
                        "the sidecar was found paused: an earlier reload did not finish; "
                        "reload a version to recover",
                        self._version,
                        self._version,
                    )

    def close(self) -> None:
        with self._lock, self._state:
            engine, self._engine = self._engine, None
            if engine is not None:
                engine.close()
            snapshots, self._snapshots = self._snapshots, None
            if snapshots is not None:
                snapshots.close()

    # ------------------------------------------------------------------ reload

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        with self._lock:
            engine = self._engine
            if engine is None:
                raise RunnerError(
                    f"cannot reload {spec.version!r}: no vLLM engine is loaded",
                    code=ErrorCode.MODEL_NOT_LOADED,
                )
            snapshots = self._snapshots
            assert snapshots is not None
            started = time.perf_counter()
            self._set_phase("validating")
            snapshot: Path | None = None
            try:
                weights_dir, entries, files, snapshot = self._validate(spec, path, cancel)
                if cancel is not None and cancel.is_set():
                    raise RunnerError(
                        "reload cancelled before vLLM was called", code=ErrorCode.COMMAND_TIMEOUT
                    )
                self._set_phase("reloading")
                rpc_started = time.perf_counter()
                self._apply(engine, spec.version, snapshot)
            except BaseException:
                if snapshot is not None:
                    snapshots.remove(snapshot)  # vLLM serves the previous one (or nothing)
                raise
            finally:
                self._set_phase("idle")
            finished = time.perf_counter()
            nbytes = sum(e.nbytes for e in entries.values())
            rpc_s = finished - rpc_started
            result = ReloadResult(
                version=spec.version,
                files=files,
                tensors=len(entries),
                bytes=nbytes,
                validate_s=rpc_started - started,
                copy_s=rpc_s,
                duration_s=finished - started,
                gbps=nbytes / rpc_s / 1e9 if rpc_s > 0 else 0.0,
            )
            with self._state:
                self._reference, self._weights_dir = _manifest(entries), weights_dir
                self._version, self._degraded, self._last_reload = spec.version, None, result
                previous, self._loaded_dir = self._loaded_dir, snapshot
            if previous is not None and previous != snapshot:
                snapshots.remove(previous)  # only ever one of ours; never the operator's model
            return result

    def _validate(
        self, spec: ReloadWeightsSpec, path: Path, cancel: threading.Event | None
    ) -> tuple[Path, dict[str, TensorEntry], int, Path]:
        """Check the checkpoint and make the private snapshot vLLM will load; touch no weights.

        Headers, index and manifest (vs the loaded checkpoint) are checked on the files as
        opened (contained, ``O_NOFOLLOW``, identity-checked); each is then copied from that same
        descriptor into a new snapshot directory only this runner writes, hashed while it is
        copied; the sha256 manifest is checked against those hashes, and the snapshot's own
        headers must be the ones checked. vLLM reads the snapshot: exactly the bytes verified.
        Returns the checkpoint's directory, its entries, its file count and the snapshot.
        """
        snapshots = self._snapshots
        assert snapshots is not None
        weights_dir = path if path.is_dir() else path.parent
        with open_checkpoint(path) as ckpt:
            ours = {f.resolve() for f in ckpt.files.files}
            theirs = {f.resolve() for f in _files_vllm_reads(weights_dir, ckpt.files.within)}
            if ours != theirs:
                raise RunnerError(
                    f"vLLM loads whole directories: {str(weights_dir)!r} holds "
                    f"{sorted(f.name for f in theirs)}, the checkpoint named is "
                    f"{sorted(f.name for f in ours)}; give each checkpoint its own directory",
                    code=ErrorCode.WEIGHTS_UNREADABLE,
                )
            # Always strict: a partial layerwise reload leaves vLLM's parameters on the meta device.
            plan_copy(ckpt.entries, self._reference, strict=True, aliases={})
            snapshot = snapshots.new()
            try:
                digests = snapshot_checkpoint(
                    ckpt,
                    snapshot,
                    hash_files=bool(spec.sha256),
                    cancel=cancel,
                    file_mode=snapshots.file_mode,
                )
                if spec.sha256:
                    verify_sha256(ckpt, spec.sha256, cancel, digests=digests)
                with open_checkpoint(snapshot) as copy:
                    if _layout(copy.entries) != _layout(ckpt.entries):
                        raise RunnerError(
                            f"checkpoint {str(path)!r} changed while it was being copied; "
                            "write new versions to new directories",
                            code=ErrorCode.WEIGHTS_UNREADABLE,
                        )
                    entries = dict(copy.entries)
            except BaseException:
                snapshots.remove(snapshot)
                raise
            return weights_dir, entries, len(ckpt.files.files), snapshot

    def _apply(self, engine: Engine, version: str, weights_dir: Path) -> None:
        """Pause, reload, reset the prefix cache, resume; restore the old weights on failure."""
        from_version, from_dir = self._version, self._loaded_dir  # what vLLM loaded last
        try:
            engine.pause()
        except Exception:
            with contextlib.suppress(Exception):
                engine.resume()  # a pause that timed out may still have taken effect
            raise
        try:
            engine.reload(str(weights_dir))
        except Exception as exc:
            reason = _reason(exc)
            if from_dir is not None and self._restore(engine, from_dir):
                raise RunnerError(
                    f"vLLM failed to reload {version!r} ({reason}); restored {from_version!r}",
                    code=ErrorCode.RUNNER_FAILED,
                ) from exc
            raise self._corrupted(
                f"vLLM failed to reload {version!r} ({reason}) and restoring {from_version!r} "
                "failed too; the engine is left paused",
                from_version,
                version,
            ) from exc
        if not self._reset_prefix_cache(engine):
            raise self._corrupted(
                f"reloaded {version!r} but vLLM did not reset its prefix cache: it would serve "
                "KV blocks of the old weights; the engine is left paused",
                from_version,
                version,
            )
        try:
            engine.resume()
        except Exception as exc:
            raise self._corrupted(
                f"reloaded {version!r} but could not resume serving ({_reason(exc)}); "
                "reload again to recover",
                from_version,
                version,
            ) from exc

    def _restore(self, engine: Engine, from_dir: Path) -> bool:
        try:
            engine.reload(str(from_dir))
            if not self._reset_prefix_cache(engine):
                return False
            engine.resume()
        except Exception:
            return False
        return True

    def _reset_prefix_cache(self, engine: Engine) -> bool:
        for attempt in range(_RESET_TRIES):
            try:
                if engine.reset_prefix_cache():
                    return True
            except RunnerError:
                pass
            time.sleep(0.05 * (attempt + 1))
        return False

    def _corrupted(self, message: str, from_version: str | None, to_version: str) -> RunnerError:
        info = self._degraded_info(message, from_version, to_version)
        with self._state:
            self._degraded = info
        return WeightsCorrupted(message, from_version=from_version, to_version=to_version)

    @staticmethod
    def _degraded_info(message: str, from_version: str | None, to_version: str) -> DegradedInfo:
        return DegradedInfo(
            code=ErrorCode.WEIGHTS_CORRUPTED.value,
            message=message,
            from_version=from_version,
            to_version=to_version,
            since=datetime.now(UTC),
        )

    # ------------------------------------------------------------------ config

    def update_config(self, overrides: dict[str, JsonValue]) -> RunnerDescription:
        with self._lock:
            engine = self._engine
            if engine is None:
                raise RunnerError("no vLLM engine is loaded", code=ErrorCode.MODEL_NOT_LOADED)
            nested = normalize_overrides(overrides)
            check_overrides(nested, self._fields, model_config_ok=self._model_config_ok)
            version = engine.vllm_version
            try:
                engine.dry_run_config(nested)
            except Exception as exc:
                raise translate_config_error(exc, version, dry_run=True) from exc
            # model_config first: vLLM 0.32 cannot apply it, and then fails before any change.
            ordered = {s: nested[s] for s in CONFIG_SECTIONS if s in nested}
            try:
                engine.update_config(ordered)
            except Exception as exc:
                error = translate_config_error(exc, version, dry_run=False)
                if "_hf_config_revision" in error.message:
                    self._model_config_ok = False
                raise error from exc
            with self._state:
                self._overrides = merge_overrides(self._overrides, ordered)
                for section, values in ordered.items():
                    self._fields.setdefault(section, {}).update(values)
        return self.describe()

    # ------------------------------------------------------------------ describe / serve

    def describe(self) -> RunnerDescription:
        with self._state:
            engine = self._engine
            config: dict[str, JsonValue] = {s: dict(v) for s, v in self._overrides.items()}
            accepts = {
                f"{section}.{name}": json_type(value)
                for section, values in self._fields.items()
                if section != "model_config" or self._model_config_ok
                for name, value in values.items()
                if not name.startswith("_")
            }
            extra: dict[str, JsonValue] = {
                "mode": self.options.mode,
                "model": self.options.served_model_name or self.options.model,
                "weights_path": str(self._weights_dir) if self._weights_dir else None,
                "weights_snapshot": str(self._loaded_dir) if self._loaded_dir else None,
                "phase": self._phase,
                "last_reload": self._last_reload.as_dict() if self._last_reload else None,
                "engine_start_s": round(self._started_s, 3) if self._started_s else None,
                "model_config_overrides": self._model_config_ok,
                "tensors": len(self._reference),
            }
            if self.options.mode == "sidecar":
                extra["base_url"] = self.options.base_url
                if isinstance(engine, SidecarEngine) and engine.server_info_error:
                    extra["server_info_error"] = engine.server_info_error
            if engine is not None:
                extra.update(vllm_version=engine.vllm_version, dtype=engine.dtype)
            return RunnerDescription(
                runner=self.name,
                device=engine.device if engine is not None else "unknown",
                model_loaded=engine is not None,
                weights_version=self._version if engine is not None else None,
                config=config,
                config_digest=config_digest(config),
                accepts=accepts,
                degraded=self._degraded,
                extra=extra,
            )

    def generate(self, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy new token ids for ``prompt_ids`` (EOS ignored); refused while degraded."""
        with self._lock:
            if self._engine is None:
                raise RunnerError("no vLLM engine is loaded", code=ErrorCode.MODEL_NOT_LOADED)
            if self._degraded is not None:
                raise RunnerError(
                    f"refusing to serve: {self._degraded.message}",
                    code=ErrorCode.WEIGHTS_CORRUPTED,
                )
            return self._engine.generate(list(prompt_ids), max_tokens)

    def _set_phase(self, phase: str) -> None:
        with self._state:
            self._phase = phase


# --------------------------------------------------------------------------- helpers


def _manifest(entries: Mapping[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """Shape-and-dtype stand-ins (meta tensors, no memory) for plan_copy's comparison."""
    return {
        name: torch.empty(
            e.shape, dtype=getattr(torch, DTYPES[e.dtype][0], torch.uint8), device="meta"
        )
        for name, e in entries.items()
    }


def _files_vllm_reads(weights_dir: Path, within: Sequence[Path]) -> list[Path]:
    index = weights_dir / VLLM_INDEX_NAME
    if index.is_file():
        return checkpoint_files(index, within).files
    return sorted(p for p in weights_dir.glob("*.safetensors") if p.is_file())


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RunnerError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


def _layout(
    entries: Mapping[str, TensorEntry],
) -> dict[str, tuple[str, str, tuple[int, ...], int, int]]:
    """What a header says, per tensor, independent of where the file is."""
    return {n: (e.file.name, e.dtype, e.shape, e.offset, e.nbytes) for n, e in entries.items()}


class SnapshotRoot:
    """The directory where this runner keeps the private copies vLLM loads.

    Created private (0700) when the runner makes it; one the operator names must be owned by
    this user and writable by nobody else. Snapshots inside it get the root's read permissions
    (so a sidecar running as another user of the root's group can read them), never write ones.
    """

    def __init__(self, root: Path, *, owned: bool) -> None:
        self.root = root
        self._owned = owned  # made by us: removed whole at close
        mode = stat.S_IMODE(os.stat(root).st_mode)
        self._dir_mode = mode & 0o755
        self._file_mode = mode & 0o444

    @classmethod
    def create(cls, configured: str | None) -> SnapshotRoot:
        if configured is None:
            return cls(Path(tempfile.mkdtemp(prefix="fleet-vllm-snapshots-")), owned=True)
        root = Path(configured)
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(root, follow_symlinks=False)
        except OSError as exc:
            raise RunnerError(f"snapshot_dir {configured!r}: {exc}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise RunnerError(
                f"snapshot_dir {configured!r} must be a directory owned by this user and "
                "writable by no one else (the copies vLLM loads live there)"
            )
        made = cls(root.resolve(), owned=False)
        for leftover in root.glob(f"{SNAPSHOT_PREFIX}*"):  # from an earlier run of this runner
            made.remove(leftover)
        return made

    def new(self) -> Path:
        path = Path(tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=self.root))
        os.chmod(path, self._dir_mode)
        return path

    def remove(self, path: Path) -> None:
        if path.parent != self.root or not path.name.startswith(SNAPSHOT_PREFIX):
            return  # not one of ours (the model the engine started from)
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            for leftover in self.root.glob(f"{SNAPSHOT_PREFIX}*"):
                self.remove(leftover)

    @property
    def file_mode(self) -> int:
        return self._file_mode


def snapshot_checkpoint(
    ckpt: OpenCheckpoint,
    dest: Path,
    *,
    hash_files: bool,
    cancel: threading.Event | None = None,
    file_mode: int = 0o400,
) -> dict[Path, str]:
    """Copy every data file of ``ckpt`` from its open descriptor into ``dest`` (new files,
    ``file_mode``), and an index when it has one; return each file's sha256 when ``hash_files``
    (taken of the bytes written, so what is checked is what the copy holds).

    Without hashing the kernel copies (``copy_file_range``: a reflink where the filesystem
    can). Raises RunnerError (WEIGHTS_UNREADABLE; COMMAND_TIMEOUT when cancelled).
    """
    base = ckpt.files.base_dir
    digests: dict[Path, str] = {}
    for file in ckpt.files.files:
        relative = file.relative_to(base)
        if len(relative.parts) != 1:
            raise RunnerError(
                f"vLLM reads only the files directly in a checkpoint's directory, not {str(relative)!r}",
                code=ErrorCode.WEIGHTS_UNREADABLE,
            )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            out = os.open(dest / relative, flags, file_mode)
        except OSError as exc:
            raise RunnerError(
                f"cannot create the snapshot of {file.name!r} in {str(dest)!r}: {exc}"
            ) from None
        try:
            digest = _copy_fd(ckpt.fds[file], out, hash_files, cancel, file.name)
        finally:
            os.close(out)
        if digest is not None:
            digests[file] = digest
    if ckpt.files.weight_map is not None:
        weight_map = {t: f.relative_to(base).as_posix() for t, f in ckpt.files.weight_map.items()}
        body: dict[str, object] = {"weight_map": weight_map}
        if ckpt.files.metadata is not None:
            body["metadata"] = ckpt.files.metadata
        index = dest / VLLM_INDEX_NAME
        index.write_text(json.dumps(body))
        os.chmod(index, file_mode)
    return digests


def _copy_fd(
    src: int, dst: int, hash_files: bool, cancel: threading.Event | None, name: str
) -> str | None:
    def cancelled() -> None:
        if cancel is not None and cancel.is_set():
            raise RunnerError("reload cancelled while copying", code=ErrorCode.COMMAND_TIMEOUT)

    offset = 0
    if not hash_files:
        try:
            while n := os.copy_file_range(src, dst, _COPY_CHUNK, offset, offset):
                offset += n
                cancelled()
            return None
        except OSError as exc:
            if exc.errno not in (
                errno.EXDEV,
                errno.EINVAL,
                errno.ENOSYS,
                errno.EOPNOTSUPP,
                errno.EPERM,
            ):
                raise RunnerError(
                    f"cannot copy {name!r}: {exc}", code=ErrorCode.WEIGHTS_UNREADABLE
                ) from None
            # Not supported between these files: copy the rest through memory.
    digest = hashlib.sha256() if hash_files else None
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    try:
        while n := os.preadv(src, [view], offset):
            cancelled()
            chunk = view[:n]
            if digest is not None:
                digest.update(chunk)
            written = 0
            while written < n:
                written += os.pwrite(dst, chunk[written:], offset + written)
            offset += n
    except OSError as exc:
        raise RunnerError(
            f"cannot copy {name!r}: {exc}", code=ErrorCode.WEIGHTS_UNREADABLE
        ) from None
    return digest.hexdigest() if digest is not None else None
