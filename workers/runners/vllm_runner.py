"""A runner that drives a real vLLM engine's reload_weights and update_config RPCs.

Two shapes: a ``vllm.LLM`` in this process, or a ``vllm serve`` sidecar on loopback (HTTP, see
vllm_sidecar.py; the in-process engine and the options are in vllm_engine.py). Every checkpoint is
checked against the loaded one's manifest (weights/checks.py) and copied to a private snapshot
(weights/snapshot.py) before vLLM sees it. A reload drains generation per the command's policy
(vLLM's pause modes wait/abort/keep; in process, between engine steps), resets the prefix cache
unless told not to, labels vLLM's weight version with ours and resumes. Never imports ``vllm._C``.

Its weights digest (``workers.weights.digest.weights_digest``, the torch runners' fingerprint) is
of the tensors in the files vLLM was told to load (the verified snapshot, or the operator's model
at start), read through a memory map (only the sampled elements): vLLM's own parameters live in
its worker processes, fused and renamed, and neither engine shape offers them cheaply. So it
says which checkpoint vLLM loaded, not what its GPUs hold after that load.
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import JsonValue

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.messages import DrainPolicy
from controlplane.wire.protocol import ReloadWeightsSpec
from workers.runners.base import (
    DegradedInfo,
    DrainReport,
    GenerationAborted,
    ProbeResult,
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
from workers.runners.vllm_engine import Engine, InProcessEngine, VllmRunnerOptions
from workers.runners.vllm_sidecar import Generation, SidecarClient, SidecarEngine
from workers.weights.checks import (
    DTYPES,
    OpenCheckpoint,
    TensorEntry,
    failure_reason,
    plan_copy,
    stand_ins,
    verify_sha256,
)
from workers.weights.digest import weights_digest
from workers.weights.loaders import open_checkpoint
from workers.weights.snapshot import (
    SnapshotRoot,
    files_vllm_reads,
    layout,
    snapshot_checkpoint,
)

__all__ = [
    "DEGRADED_MARK",
    "GenerationAborted",
    "VllmRunner",
    "VllmRunnerOptions",
    "degraded_label",
    "snapshot_checkpoint",  # tests patch it here
]

_RESET_TRIES = 5
#: Appended to vLLM's weight version when a failed reload could not restore the old weights:
#: ``!`` is never in a version (an Identifier), so no response can pass for a real version.
DEGRADED_MARK = "!degraded"


def degraded_label(version: str) -> str:
    """vLLM's weight version while degraded: the worker's version, marked as not it."""
    return f"{version}{DEGRADED_MARK}"


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
        self._command = threading.Lock()  # load, reload, config, close: one at a time
        self._state = threading.Lock()  # the facts describe() reads, never held for long
        self._drain: DrainReport | None = None  # what the last drain did
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
        self._digest: str | None = None  # of the files vLLM last loaded (checkpoint_digest)

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
        )

    def load(self) -> None:
        with self._command:
            if self._engine is not None:
                return
            weights_dir = Path(self.options.model).resolve()
            # The operator's own path (vLLM loads it by name at start): contained nowhere.
            with open_checkpoint(weights_dir, roots=[Path("/")]) as ckpt:
                reference = stand_ins(ckpt.entries)
                digest = checkpoint_digest(ckpt)
            snapshots = SnapshotRoot.create(self.options.snapshot_dir)
            started = time.perf_counter()
            engine = self._make_engine()
            try:
                was_paused = engine.start()
                fields = engine.config_fields()
                # vLLM labels outputs with its weight version: ours, from the start.
                engine.set_weight_version(self.options.initial_version)
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
                self._digest = digest
                self._started_s = time.perf_counter() - started
                if was_paused:
                    paused = WeightsCorrupted(
                        "the sidecar was found paused: an earlier reload did not finish; "
                        "reload a version to recover",
                        from_version=self._version,
                        to_version=self._version,
                    )
                    self._degraded = DegradedInfo.of(paused)

    def close(self) -> None:
        with self._command, self._state:
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
        """Validate and snapshot (serving goes on), drain per ``spec``'s policy, reload, reset
        the prefix cache (unless ``reset_cache`` is false), label vLLM's weight version, resume.
        A failure after the drain restores the previous weights and still resumes serving."""
        with self._command:
            engine = self._engine
            if engine is None:
                raise RunnerError(
                    f"cannot reload {spec.version!r}: no vLLM engine is loaded",
                    code=WireCode.MODEL_NOT_LOADED,
                )
            snapshots = self._snapshots
            assert snapshots is not None
            started = time.perf_counter()
            self._set_phase("validating")
            snapshot: Path | None = None
            try:
                weights_dir, entries, files, snapshot, digest = self._validate(spec, path, cancel)
                if cancel is not None and cancel.is_set():
                    raise RunnerError(
                        "reload cancelled before vLLM was called", code=WireCode.COMMAND_TIMEOUT
                    )
                self._set_phase("draining")
                with self._drained(engine, self._policy(spec), spec.version):
                    self._set_phase("reloading")
                    rpc_started = time.perf_counter()
                    self._apply(engine, spec, snapshot)
            except BaseException:
                if snapshot is not None:
                    snapshots.remove(snapshot)  # vLLM serves the previous one (or nothing)
                raise
            finally:
                self._set_phase("idle")
            finished = time.perf_counter()
            stats = ReloadResult.measured(
                spec.version,
                files=files,
                tensors=len(entries),
                nbytes=sum(e.nbytes for e in entries.values()),
                started=started,
                copy_started=rpc_started,  # vLLM's own load counts as the copy
                finished=finished,
            )
            result = ReloadResult.of(stats, weights_digest=digest, drain=self._drain)
            with self._state:
                self._reference, self._weights_dir = stand_ins(entries), weights_dir
                self._version, self._degraded, self._last_reload = spec.version, None, result
                self._digest = digest
                previous, self._loaded_dir = self._loaded_dir, snapshot
            if previous is not None and previous != snapshot:
                snapshots.remove(previous)  # only ever one of ours; never the operator's model
            return result

    def _policy(self, spec: ReloadWeightsSpec) -> DrainPolicy:
        if spec.drain is None and self.options.pause_mode is not None:
            return DrainPolicy(mode=self.options.pause_mode)  # the deprecated runner option
        return spec.drain_policy

    @contextlib.contextmanager
    def _drained(self, engine: Engine, policy: DrainPolicy, version: str) -> Iterator[None]:
        """Hold generation off per ``policy`` for the body; serve again after it, whatever it
        raised (corrupted weights too: vLLM's weight version then says so, see ``_apply``)."""
        asked = time.perf_counter()
        try:
            in_flight, aborted = engine.pause(policy.mode, policy.timeout_s)
        except Exception as exc:
            with contextlib.suppress(Exception):
                engine.resume()  # a pause that timed out may still have taken effect
            if isinstance(exc, RunnerError) and exc.code is WireCode.COMMAND_TIMEOUT:
                raise RunnerError(
                    f"vLLM did not pause (drain mode {policy.mode}) within "
                    f"{policy.timeout_s:g}s; {version!r} not loaded, weights untouched, "
                    f"still serving ({exc.message})",
                    code=WireCode.COMMAND_TIMEOUT,
                ) from exc
            raise
        try:
            yield
        finally:
            try:
                engine.resume()  # whatever the body raised: a failure never leaves it paused
            except Exception as exc:
                raise self._corrupted(
                    f"reloading {version!r}: could not resume serving "
                    f"({failure_reason(exc)}); reload again to recover",
                    self._version,
                    version,
                ) from exc
            finally:  # paused_s: from asking for the drain to serving again
                paused_s = time.perf_counter() - asked
                self._drain = DrainReport(policy.mode, paused_s, in_flight, aborted)

    def _validate(
        self, spec: ReloadWeightsSpec, path: Path, cancel: threading.Event | None
    ) -> tuple[Path, dict[str, TensorEntry], int, Path, str]:
        """Check the checkpoint and make the private snapshot vLLM will load; touch no weights.

        Headers, index and manifest (vs the loaded checkpoint) are checked on the files as
        opened (contained, ``O_NOFOLLOW``, identity-checked); each is then copied from that same
        descriptor into a new snapshot directory only this runner writes, hashed while it is
        copied; the sha256 manifest is checked against those hashes, and the snapshot's own
        headers must be the ones checked. vLLM reads the snapshot: exactly the bytes verified.
        Returns the checkpoint's directory, its entries, its file count, the snapshot and the
        snapshot's :func:`checkpoint_digest`.
        """
        snapshots = self._snapshots
        assert snapshots is not None
        weights_dir = path if path.is_dir() else path.parent
        with open_checkpoint(path) as ckpt:
            self._check_layout(ckpt, weights_dir)
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
                    if layout(copy.entries) != layout(ckpt.entries):
                        raise RunnerError(
                            f"checkpoint {str(path)!r} changed while it was being copied; "
                            "write new versions to new directories",
                            code=WireCode.WEIGHTS_UNREADABLE,
                        )
                    entries = dict(copy.entries)
                    digest = checkpoint_digest(copy)
            except BaseException:
                snapshots.remove(snapshot)
                raise
            return weights_dir, entries, len(ckpt.files.files), snapshot, digest

    def _check_layout(self, ckpt: OpenCheckpoint, weights_dir: Path) -> None:
        """The files vLLM would read are exactly the checkpoint's, and its manifest (names,
        shapes, dtypes) is the loaded checkpoint's; RunnerError with the code otherwise."""
        ours = {f.resolve() for f in ckpt.files.files}
        theirs = {f.resolve() for f in files_vllm_reads(weights_dir, ckpt.files.within)}
        if ours != theirs:
            raise RunnerError(
                f"vLLM loads whole directories: {str(weights_dir)!r} holds "
                f"{sorted(f.name for f in theirs)}, the checkpoint named is "
                f"{sorted(f.name for f in ours)}; give each checkpoint its own directory",
                code=WireCode.WEIGHTS_UNREADABLE,
            )
        with self._state:
            reference = self._reference
        # Always strict: a partial layerwise reload leaves vLLM's parameters on the meta device.
        plan_copy(ckpt.entries, reference, strict=True, aliases={})

    def validate_reload(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> dict[str, JsonValue]:
        """A dry run of :meth:`reload_weights`: every check it makes before vLLM is touched (an
        engine loaded, the files vLLM would read, every header against the loaded checkpoint's
        manifest, the sha256 manifest), on the files as they are now. Nothing is copied or
        drained: the engine serves on, untouched. RunnerError with reload_weights' code
        (COMMAND_TIMEOUT when ``cancel`` is set while hashing). Returns facts: tensors, bytes,
        files."""
        with self._state:
            loaded = self._engine is not None
        if not loaded:
            raise RunnerError(
                f"cannot reload {spec.version!r}: no vLLM engine is loaded",
                code=WireCode.MODEL_NOT_LOADED,
            )
        with open_checkpoint(path) as ckpt:
            self._check_layout(ckpt, path if path.is_dir() else path.parent)
            if spec.sha256:
                verify_sha256(ckpt, spec.sha256, cancel)
            entries = ckpt.entries
            return {
                "tensors": len(entries),
                "bytes": sum(e.nbytes for e in entries.values()),
                "files": len(ckpt.files.files),
            }

    def _apply(self, engine: Engine, spec: ReloadWeightsSpec, weights_dir: Path) -> None:
        """Reload, reset the prefix cache, label vLLM's weight version; on any failure restore
        the previous weights (and label). Runs drained."""
        version = spec.version
        from_version, from_dir = self._version, self._loaded_dir  # what vLLM loaded last
        try:
            engine.reload(str(weights_dir))
            if spec.resets_cache and not self._reset_prefix_cache(engine):
                raise RunnerError(
                    "vLLM did not reset its prefix cache: it would serve KV blocks of the "
                    "old weights"
                )
            engine.set_weight_version(version)
        except Exception as exc:
            reason = failure_reason(exc)
            if from_dir is not None and self._restore(engine, from_dir, from_version):
                raise RunnerError(
                    f"vLLM failed to reload {version!r} ({reason}); restored {from_version!r}",
                    code=WireCode.RUNNER_FAILED,
                ) from exc
            # Serving resumes (the drain's exit) on weights of no known version: nothing the
            # drain held goes on on them, and vLLM's own label says so on every output from now
            # on, until a reload succeeds.
            held = self._abort_held(engine)
            marker = degraded_label(from_version or version)
            with contextlib.suppress(Exception):
                engine.set_weight_version(marker)
            raise self._corrupted(
                f"vLLM failed to reload {version!r} ({reason}) and restoring {from_version!r} "
                f"failed too; {held}; serving resumed under vLLM weight version {marker!r} "
                "(no version): reload a version to recover",
                from_version,
                version,
            ) from exc

    def _abort_held(self, engine: Engine) -> str:
        """Abort what the drain holds (drain mode keep froze it, or it queued since) before
        serving resumes on weights of no version; says what happened, for the error."""
        try:
            aborted = engine.abort_held(self.options.request_timeout_s)
        except Exception as exc:
            return f"aborting the requests the drain held failed ({failure_reason(exc)})"
        return f"the requests the drain held were aborted ({aborted})"

    def _restore(self, engine: Engine, from_dir: Path, from_version: str | None) -> bool:
        try:
            engine.reload(str(from_dir))
            if not self._reset_prefix_cache(engine):
                return False
            if from_version is not None:
                engine.set_weight_version(from_version)
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
        error = WeightsCorrupted(message, from_version=from_version, to_version=to_version)
        info = DegradedInfo.of(error)
        with self._state:
            self._degraded = info
        return error

    # ------------------------------------------------------------------ config

    def validate_config(self, overrides: dict[str, JsonValue]) -> dict[str, JsonValue]:
        """A dry run of :meth:`update_config`: its checks (ours, then, in process, vLLM's own
        pure override function on the live configs), the config untouched. RunnerError
        CONFIG_KEY_REJECTED / CONFIG_VALUE_INVALID (MODEL_NOT_LOADED without an engine).
        Returns facts: keys (dotted, sorted)."""
        with self._command:
            nested = self._checked_config(overrides)[1]
        keys = sorted(f"{s}.{k}" for s, values in nested.items() for k in values)
        return {"keys": list[JsonValue](keys)}

    def _checked_config(
        self, overrides: dict[str, JsonValue]
    ) -> tuple[Engine, dict[str, dict[str, Any]]]:
        """update_config's checks, before any change (held: the command lock)."""
        engine = self._engine
        if engine is None:
            raise RunnerError("no vLLM engine is loaded", code=WireCode.MODEL_NOT_LOADED)
        nested = normalize_overrides(overrides)
        check_overrides(nested, self._fields, model_config_ok=self._model_config_ok)
        try:
            engine.dry_run_config(nested)
        except Exception as exc:
            raise translate_config_error(exc, engine.vllm_version, dry_run=True) from exc
        return engine, nested

    def update_config(self, overrides: dict[str, JsonValue]) -> RunnerDescription:
        with self._command:
            engine, nested = self._checked_config(overrides)
            version = engine.vllm_version
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
                "weights_digest": None if self._degraded is not None else self._digest,
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
                degraded=self._degraded or self._not_serving(engine),
                extra=extra,
            )

    def _not_serving(self, engine: Engine | None) -> DegradedInfo | None:
        """In process, an engine whose stepping loop died serves nothing until the worker
        restarts (a reload does not bring it back): degraded, RUNNER_FAILED (held: state)."""
        stopped = engine.stopped_serving() if isinstance(engine, InProcessEngine) else None
        if stopped is None:
            return None
        why, since = stopped
        version = self._version or self.options.initial_version
        return DegradedInfo(
            code=WireCode.RUNNER_FAILED.value,
            message=f"vLLM's stepping loop died ({why}); no request is served: restart the worker",
            from_version=version,
            to_version=version,
            since=since,
        )

    def generate(self, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
        """Greedy new token ids for ``prompt_ids`` (EOS ignored); refused while degraded;
        :class:`GenerationAborted` when a reload (drain mode abort) aborted it."""
        out = self.generate_full(prompt_ids, max_tokens)
        if out.finish_reason == "abort":
            raise GenerationAborted(
                f"vLLM aborted the request (finish reason 'abort'): a reload with drain mode "
                f"abort; {len(out.token_ids)} tokens generated"
            )
        return out.token_ids

    def generate_full(self, prompt_ids: list[int], max_tokens: int = 16) -> Generation:
        """One greedy completion with vLLM's weight-version spans (in process; a sidecar's
        ``/v1/completions`` gives none) and finish reason. In process, concurrent calls are
        served together by the engine's stepping loop and a reload drains them per its policy;
        a sidecar's vLLM drains its own requests on ``/pause``."""
        with self._state:
            engine = self._engine
        return self._check_serving(engine).generate(list(prompt_ids), max_tokens)

    def _check_serving(self, engine: Engine | None) -> Engine:
        if engine is None:
            raise RunnerError("no vLLM engine is loaded", code=WireCode.MODEL_NOT_LOADED)
        degraded = self._degraded
        if degraded is not None:
            raise RunnerError(
                f"refusing to serve: {degraded.message}", code=WireCode.WEIGHTS_CORRUPTED
            )
        return engine

    def vllm_weight_version(self) -> str:
        """vLLM's own weight-version label (in process: the engine; sidecar: ``/weight_info``)."""
        with self._state:
            engine = self._engine
        if engine is None:
            raise RunnerError("no vLLM engine is loaded", code=WireCode.MODEL_NOT_LOADED)
        return engine.get_weight_version()

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        """Not offered: the engine's tokenizer and log-probabilities are not wired up here."""
        return None

    def _set_phase(self, phase: str) -> None:
        with self._state:
            self._phase = phase


def checkpoint_digest(ckpt: OpenCheckpoint) -> str:
    """``weights_digest`` of the tensors in ``ckpt``'s files as stored (name, dtype, shape and the
    sampled elements), read through a private memory map of each open file: only the pages of
    the sampled elements are read. Equal to the torch runners' digest of a model holding that
    checkpoint when its names, dtypes and shapes are the model's."""
    maps: dict[Path, mmap.mmap] = {}
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, e in ckpt.entries.items():
            known = DTYPES.get(e.dtype)
            dtype = getattr(torch, known[0], None) if known is not None else None
            shape: tuple[int, ...] = e.shape
            if dtype is None:  # not a torch dtype: its raw bytes
                dtype, shape = torch.uint8, (e.nbytes,)
            count = e.nbytes // torch.empty((), dtype=dtype).element_size()
            if count == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            if e.file not in maps:
                maps[e.file] = mmap.mmap(ckpt.fds[e.file], 0, access=mmap.ACCESS_COPY)
            flat = torch.frombuffer(maps[e.file], dtype=dtype, count=count, offset=e.offset)
            tensors[name] = flat.view(shape)
        return weights_digest(tensors)
    finally:
        tensors.clear()  # the views first: a map with live views cannot close
        for m in maps.values():
            with contextlib.suppress(BufferError):
                m.close()
