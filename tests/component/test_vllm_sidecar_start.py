"""The vLLM runner against a stand-in ``vllm serve`` on loopback (real HTTP, no vLLM needed).

vLLM's /server_info shells out (``pip list`` / ``uv pip list``) and answers HTTP 500 when that
command is not on the server's PATH; the runner must start and work without it. And what vLLM
is told to load must be exactly the bytes the runner checked (a private snapshot).
"""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import JsonValue

from controlplane.wire.errors import CommandRejected, RunnerError, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import TINY
from workers.demo.checkpoints import sha256_manifest, write_checkpoint
from workers.runners.vllm_runner import GenerationAborted, VllmRunner, degraded_label

#: What vLLM 0.32 answers on /server_info when `uv` is not on the server's PATH.
SERVER_INFO_500 = {"error": {"message": "'NoneType' object has no attribute 'splitlines'"}}


class FakeVllm:
    """The endpoints the runner calls, answering as vLLM 0.32 does; records every call."""

    def __init__(self, model: str, *, server_info_ok: bool) -> None:
        self.model = model
        self.server_info_ok = server_info_ok
        self.calls: list[tuple[str, str, Any]] = []
        #: For each reload: the files in the directory vLLM was told to load, as it read them.
        self.loaded: list[dict[str, bytes]] = []
        self.weight_version = "default"  # vLLM's label before anyone sets it
        self.failing_reloads = 0  # the next N reload_weights calls answer 500
        self.pause_released: threading.Event | None = None  # /pause blocks until it is set

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.calls.append((method, path, body))
        route = path.split("?", 1)[0]
        if route == "/health":
            return 200, None
        if route == "/version":
            return 200, {"version": "0.32.0"}
        if route == "/v1/models":
            return 200, {"data": [{"id": self.model, "root": self.model}]}
        if route == "/is_paused":
            return 200, {"is_paused": False}
        if route == "/server_info":
            if not self.server_info_ok:
                return 500, SERVER_INFO_500
            return 200, {
                "vllm_config": {
                    "model_config": {"dtype": "torch.float32", "max_logprobs": 20},
                    "load_config": {"load_format": "auto", "ignore_patterns": []},
                    "device_config": {"device_type": "cpu"},
                }
            }
        if route == "/pause" and self.pause_released is not None:
            self.pause_released.wait(30)
        if route in ("/pause", "/resume"):
            return 200, None
        if route == "/reset_prefix_cache":
            return 200, {"success": True}
        if route == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "new_version": self.weight_version}
        if route == "/weight_info":
            return 200, {"weight_version": self.weight_version}
        if route == "/v1/completions":  # as vLLM answers a request a pause (abort) aborted
            return 200, {"choices": [{"token_ids": [7, 8], "finish_reason": "abort"}]}
        if route == "/collective_rpc" and body.get("method") == "reload_weights":
            if self.failing_reloads:
                self.failing_reloads -= 1
                return 500, {"error": {"message": "Worker failed with error 'meta tensor'"}}
            loaded = Path(body["kwargs"]["weights_path"])
            self.loaded.append({f.name: f.read_bytes() for f in sorted(loaded.iterdir())})
            return 200, {"results": [None]}
        if route == "/collective_rpc" and body.get("method") == "update_config":
            (overrides,) = body["args"]
            if "model_config" in overrides:
                msg = "Field '_hf_config_revision' not found in ModelConfig"
                return 500, {"error": {"message": msg}}
            unknown = [k for k in overrides.get("load_config", {}) if k != "load_format"]
            if unknown:
                msg = f"LoadConfig.{unknown[0]} is not a valid config field"
                return 500, {"error": {"message": msg}}
            return 200, {"results": [None]}
        return 404, {"detail": "Not Found"}


@pytest.fixture
def fake_server() -> Iterator[tuple[str, list[FakeVllm]]]:
    holder: list[FakeVllm] = []

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, body = holder[0].answer(method, self.path, json.loads(raw) if raw else None)
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", holder
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _runner(
    tmp_path: Path, url: str, holder: list[FakeVllm], *, server_info_ok: bool
) -> VllmRunner:
    model = tmp_path / "ckpt"
    write_checkpoint(model, model_kwargs=TINY, seed=1)
    holder.append(FakeVllm(str(model), server_info_ok=server_info_ok))
    return VllmRunner(
        {"mode": "sidecar", "model": str(model), "base_url": url, "startup_timeout_s": 30}
    )


def test_sidecar_starts_and_applies_config_when_server_info_fails(
    tmp_path: Path, fake_server: tuple[str, list[FakeVllm]]
) -> None:
    url, holder = fake_server
    runner = _runner(tmp_path, url, holder, server_info_ok=False)
    runner.load()
    try:
        described = runner.describe()
        assert described.model_loaded and described.weights_version == "init"
        assert "splitlines" in str(described.extra["server_info_error"])
        assert described.device == "unknown" and described.extra["dtype"] == "unknown"
        # Field names are unknown here: vLLM judges them (its refusal is still our code).
        ok = runner.update_config({"load_config.load_format": "safetensors"})
        assert ok.config == {"load_config": {"load_format": "safetensors"}}
        with pytest.raises(RunnerError) as caught:
            runner.update_config({"load_config.no_such_field": 1})
        assert caught.value.code is WireCode.CONFIG_KEY_REJECTED
        # Our own checks still stand before vLLM is asked.
        cases: tuple[tuple[dict[str, JsonValue], WireCode], ...] = (
            ({"load_config.load_format": "bogus"}, WireCode.CONFIG_VALUE_INVALID),
            ({"load_config.ignore_patterns": ["*"]}, WireCode.CONFIG_KEY_REJECTED),
            ({"model_config.max_logprobs": 3}, WireCode.CONFIG_KEY_REJECTED),
        )
        for overrides, code in cases:
            with pytest.raises(RunnerError) as caught:
                runner.update_config(overrides)
            assert caught.value.code is code, overrides
    finally:
        runner.close()
    sent = [body for _, path, body in holder[0].calls if path == "/collective_rpc"]
    assert {"load_config": {"load_format": "bogus"}} not in [b["args"][0] for b in sent]


def test_sidecar_uses_server_info_when_it_answers(
    tmp_path: Path, fake_server: tuple[str, list[FakeVllm]]
) -> None:
    url, holder = fake_server
    runner = _runner(tmp_path, url, holder, server_info_ok=True)
    runner.load()
    try:
        described = runner.describe()
        assert described.device == "cpu" and described.extra["dtype"] == "float32"
        assert "server_info_error" not in described.extra
        assert "load_config.load_format" in described.accepts
        with pytest.raises(RunnerError) as caught:
            runner.update_config({"load_config.no_such_field": 1})
        assert caught.value.code is WireCode.CONFIG_KEY_REJECTED
    finally:
        runner.close()
    # Refused by our own check against the known fields: vLLM never saw it.
    sent = [body["args"][0] for _, path, body in holder[0].calls if path == "/collective_rpc"]
    assert {"load_config": {"no_such_field": 1}} not in sent


# --------------------------------------------------------------------------- the checks bind


def _sha(directory: Path) -> dict[str, str]:
    return sha256_manifest(directory)


def _write(directory: Path, seed: int, **kw: Any) -> Path:
    write_checkpoint(directory, model_kwargs={**TINY, **kw}, seed=seed)
    return directory


@pytest.fixture
def loaded(
    tmp_path: Path, fake_server: tuple[str, list[FakeVllm]]
) -> Iterator[tuple[VllmRunner, FakeVllm, Path]]:
    url, holder = fake_server
    runner = _runner(tmp_path, url, holder, server_info_ok=True)
    runner.load()
    try:
        yield runner, holder[0], tmp_path
    finally:
        runner.close()


def test_vllm_loads_the_verified_bytes_even_if_the_files_are_rewritten_after_the_check(
    loaded: tuple[VllmRunner, FakeVllm, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, fake, tmp_path = loaded
    v2 = _write(tmp_path / "v2", seed=2)
    verified = {f.name: f.read_bytes() for f in v2.iterdir()}
    manifest = _sha(v2)
    other = _write(tmp_path / "other", seed=3)
    validate = runner._validate

    def then_rewrite(spec: ReloadWeightsSpec, path: Path, cancel: Any) -> Any:
        checked = validate(spec, path, cancel)
        with open(v2 / "model.safetensors", "r+b") as fh:  # same inode, other weights
            fh.write((other / "model.safetensors").read_bytes())
        return checked

    monkeypatch.setattr(runner, "_validate", then_rewrite)
    result = runner.reload_weights(
        ReloadWeightsSpec(path=str(v2), version="v2", sha256=manifest), v2
    )
    assert result.version == "v2"
    assert _sha(v2) != manifest  # rewritten after the check ...
    assert fake.loaded == [verified]  # ... and vLLM read what was checked
    snapshot = Path(str(runner.describe().extra["weights_snapshot"]))
    assert snapshot != v2 and snapshot.is_dir()
    assert stat.S_IMODE(snapshot.stat().st_mode) & 0o077 == 0
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o400 for f in snapshot.iterdir())
    # The next reload replaces the snapshot; close() removes the last one.
    monkeypatch.undo()
    v3 = _write(tmp_path / "v3", seed=4)
    runner.reload_weights(ReloadWeightsSpec(path=str(v3), version="v3"), v3)
    assert not snapshot.exists()
    root = Path(str(runner.describe().extra["weights_snapshot"])).parent
    runner.close()
    assert not root.exists()


@pytest.mark.parametrize("sha256", [True, False])
def test_a_file_rewritten_while_it_is_copied_is_refused_and_never_loaded(
    loaded: tuple[VllmRunner, FakeVllm, Path], monkeypatch: pytest.MonkeyPatch, sha256: bool
) -> None:
    import workers.runners.vllm_runner as vllm_runner

    runner, fake, tmp_path = loaded
    v2 = _write(tmp_path / "v2", seed=2)
    manifest = _sha(v2) if sha256 else {}
    # With a manifest, other weights of the same layout; without, another layout.
    other = _write(tmp_path / "other", seed=3, **({} if sha256 else {"d_model": 16}))
    copy = vllm_runner.snapshot_checkpoint
    made: list[Path] = []

    def rewrite_then_copy(ckpt: Any, dest: Path, **kw: Any) -> Any:
        made.append(dest)
        with open(v2 / "model.safetensors", "r+b") as fh:  # after the header check
            fh.write((other / "model.safetensors").read_bytes())
            fh.truncate()
        return copy(ckpt, dest, **kw)

    monkeypatch.setattr(vllm_runner, "snapshot_checkpoint", rewrite_then_copy)
    with pytest.raises(RunnerError) as caught:
        runner.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2", sha256=manifest), v2)
    want = WireCode.CHECKSUM_MISMATCH if sha256 else WireCode.WEIGHTS_UNREADABLE
    assert caught.value.code is want, caught.value
    assert fake.loaded == []  # vLLM was never asked
    assert made and not made[0].exists()  # the refused snapshot is gone
    assert runner.describe().weights_version == "init"


def test_snapshot_dir_must_be_private(
    tmp_path: Path, fake_server: tuple[str, list[FakeVllm]]
) -> None:
    url, holder = fake_server
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    model = _write(tmp_path / "ckpt", seed=1)
    holder.append(FakeVllm(str(model), server_info_ok=True))
    options = {"mode": "sidecar", "model": str(model), "base_url": url, "snapshot_dir": str(shared)}
    runner = VllmRunner(options)
    with pytest.raises(RunnerError) as caught:
        runner.load()
    assert "writable by no one else" in caught.value.message
    shared.chmod(0o750)  # group may read (a sidecar of the same group): files get 0o440
    (shared / "v-leftover").mkdir()
    runner = VllmRunner(options)
    runner.load()
    try:
        assert not (shared / "v-leftover").exists()
        v2 = _write(tmp_path / "v2", seed=2)
        runner.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2"), v2)
        snapshot = Path(str(runner.describe().extra["weights_snapshot"]))
        assert snapshot.parent == shared.resolve()
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o440 for f in snapshot.iterdir())
    finally:
        runner.close()
    assert shared.is_dir() and list(shared.iterdir()) == []


def test_a_hugging_face_cache_layout_inside_the_roots_is_snapshotted(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    """snapshots/<rev>/ holds symlinks into ../../blobs (inside the allowed root): fine, and
    vLLM gets real files with the blobs' bytes."""
    from workers.weights.paths import resolve_weights_path

    runner, fake, tmp_path = loaded
    cache = tmp_path / "hf"
    source = cache / "src"
    write_checkpoint(source, model_kwargs=TINY, seed=2, shards=2)
    (cache / "blobs").mkdir()
    snapshot_dir = cache / "snapshots" / "rev1"
    snapshot_dir.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        if file.suffix != ".safetensors":  # the index stays a plain file
            file.rename(snapshot_dir / file.name)
            continue
        file.rename(cache / "blobs" / f"blob{i}")
        (snapshot_dir / file.name).symlink_to(f"../../blobs/blob{i}")
    want = {f.name: f.read_bytes() for f in snapshot_dir.iterdir() if f.suffix == ".safetensors"}
    path = resolve_weights_path(str(snapshot_dir), [cache])
    runner.reload_weights(ReloadWeightsSpec(path=str(path), version="v2"), path)
    (got,) = fake.loaded
    assert {n: b for n, b in got.items() if n.endswith(".safetensors")} == want
    assert "model.safetensors.index.json" in got
    # The same layout with a blob outside the roots is refused before anything is copied.
    outside = resolve_weights_path(str(snapshot_dir), [cache / "snapshots"])
    with pytest.raises(CommandRejected) as caught:
        runner.reload_weights(ReloadWeightsSpec(path=str(outside), version="v3"), outside)
    assert caught.value.code is WireCode.PATH_NOT_ALLOWED
    assert len(fake.loaded) == 1


# --------------------------------------------------------------------------- drain policy (issue 14)


def _routes(fake: FakeVllm, since: int) -> list[str]:
    """The calls the runner made after the first ``since``, as 'METHOD path?query'."""
    return [
        f"{method} {path}"
        for method, path, _ in fake.calls[since:]
        if "/health" not in path and path != "/metrics"
    ]


def test_sidecar_reload_pauses_with_the_policy_resets_labels_and_resumes(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    runner, fake, tmp_path = loaded
    assert fake.weight_version == "init"  # labelled at start with the runner's version
    v2 = _write(tmp_path / "v2", seed=2)
    since = len(fake.calls)
    spec = ReloadWeightsSpec.model_validate(
        {"path": str(v2), "version": "v2", "drain": {"mode": "abort", "timeout_s": 5}}
    )
    result = runner.reload_weights(spec, v2)
    assert result.as_dict()["drain"] == {
        "mode": "abort",
        "paused_s": result.as_dict()["drain"]["paused_s"],  # type: ignore[index,call-overload]
        "in_flight": 0,  # the stand-in has no /metrics
        "aborted": 0,
    }
    calls = _routes(fake, since)
    assert calls == [
        "POST /pause?mode=abort&clear_cache=false",
        "POST /collective_rpc",
        "POST /reset_prefix_cache?reset_running_requests=true",
        "POST /update_weight_version",
        "POST /resume",
    ]
    assert fake.weight_version == "v2" == runner.vllm_weight_version()
    assert runner.describe().weights_version == "v2"
    # reset_cache false: no reset; the default drain is wait.
    v3 = _write(tmp_path / "v3", seed=3)
    since = len(fake.calls)
    spec = ReloadWeightsSpec.model_validate(
        {"path": str(v3), "version": "v3", "reset_cache": False}
    )
    runner.reload_weights(spec, v3)
    calls = _routes(fake, since)
    assert calls[0] == "POST /pause?mode=wait&clear_cache=false"
    assert not any("reset_prefix_cache" in c for c in calls)
    assert calls[-1] == "POST /resume" and fake.weight_version == "v3"


def _failing_reload(
    loaded: tuple[VllmRunner, FakeVllm, Path], failures: int
) -> tuple[RunnerError, list[str]]:
    """Reload v2 while vLLM's next ``failures`` reload_weights calls fail: the error, the calls."""
    runner, fake, tmp_path = loaded
    v2 = _write(tmp_path / "v2", seed=2)
    fake.failing_reloads = failures
    since = len(fake.calls)
    with pytest.raises(RunnerError) as caught:
        runner.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2"), v2)
    return caught.value, _routes(fake, since)


def test_sidecar_failed_reload_restores_keeps_the_label_and_still_resumes(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    runner, fake, _ = loaded
    error, calls = _failing_reload(loaded, 1)
    assert error.code is WireCode.RUNNER_FAILED
    assert "restored 'init'" in error.message
    assert calls.count("POST /collective_rpc") == 2  # the failed reload, then the restore
    assert calls[-1] == "POST /resume"
    assert fake.weight_version == "init" == runner.describe().weights_version
    assert runner.describe().degraded is None


def test_sidecar_drain_past_its_deadline_is_a_timeout_and_serving_goes_on(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    runner, fake, tmp_path = loaded
    v2 = _write(tmp_path / "v2", seed=2)
    fake.pause_released = threading.Event()  # requests in flight never finish
    since = len(fake.calls)
    spec = ReloadWeightsSpec.model_validate(
        {"path": str(v2), "version": "v2", "drain": {"mode": "wait", "timeout_s": 0.2}}
    )
    try:
        with pytest.raises(RunnerError) as caught:
            runner.reload_weights(spec, v2)
    finally:
        fake.pause_released.set()
    assert caught.value.code is WireCode.COMMAND_TIMEOUT
    assert "weights untouched" in caught.value.message
    calls = _routes(fake, since)
    assert "POST /collective_rpc" not in calls
    assert calls[-1] == "POST /resume"
    assert fake.weight_version == "init" == runner.describe().weights_version


def test_a_request_vllm_aborted_is_a_coded_error_from_generate(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    runner, _, _ = loaded
    assert runner.generate_full([1, 2, 3], 4).finish_reason == "abort"
    with pytest.raises(GenerationAborted) as caught:
        runner.generate([1, 2, 3], 4)
    assert caught.value.code is WireCode.RUNNER_FAILED
    assert "finish reason 'abort'" in caught.value.message


def test_sidecar_failed_restore_resumes_labelled_degraded_until_a_reload_succeeds(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    """The reload and the restore both fail: serving resumes (never left paused), vLLM's weight
    version is the marker that is no version, and the runner reports degraded."""
    runner, fake, tmp_path = loaded
    error, calls = _failing_reload(loaded, 2)
    assert error.code is WireCode.WEIGHTS_CORRUPTED
    assert "'init!degraded'" in error.message
    assert calls.count("POST /collective_rpc") == 2  # the failed reload, the failed restore
    assert calls[-1] == "POST /resume"
    assert fake.weight_version == degraded_label("init") == "init!degraded"
    described = runner.describe()
    assert described.degraded is not None and described.degraded.code == "WEIGHTS_CORRUPTED"
    assert described.weights_version == "init" and described.extra["weights_digest"] is None
    v2 = tmp_path / "v2"
    runner.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2"), v2)  # recovers
    assert fake.weight_version == "v2" == runner.describe().weights_version
    assert runner.describe().degraded is None


def test_sidecar_dry_runs_check_like_the_command_and_call_no_vllm_endpoint(
    loaded: tuple[VllmRunner, FakeVllm, Path],
) -> None:
    """validate_reload / validate_config (contract C2): the checks only, not one call to vLLM."""
    runner, fake, tmp_path = loaded
    v2 = _write(tmp_path / "v2", seed=2)
    wide = _write(tmp_path / "wide", seed=3, d_model=2 * TINY["d_model"])
    before = runner.describe()
    since = len(fake.calls)
    spec = ReloadWeightsSpec(path=str(v2), version="v2", sha256=sha256_manifest(v2))
    facts = runner.validate_reload(spec, v2)
    assert facts["files"] == 1 and facts["tensors"] == before.extra["tensors"]
    cancelled = threading.Event()
    cancelled.set()  # the command's deadline passed: hashing stops
    with pytest.raises(RunnerError) as stopped:
        runner.validate_reload(spec, v2, cancel=cancelled)
    assert stopped.value.code is WireCode.COMMAND_TIMEOUT
    assert isinstance(facts["bytes"], int) and facts["bytes"] > 0
    bad_sum = ReloadWeightsSpec(
        path=str(v2), version="v2", sha256=dict.fromkeys(sha256_manifest(v2), "0" * 64)
    )
    for bad, code in [
        (ReloadWeightsSpec(path=str(wide), version="wide"), WireCode.WEIGHTS_SHAPE_MISMATCH),
        (bad_sum, WireCode.CHECKSUM_MISMATCH),
    ]:
        with pytest.raises(RunnerError) as caught:
            runner.validate_reload(bad, Path(bad.path))
        assert caught.value.code is code
    assert runner.validate_config({"load_config.load_format": "safetensors"}) == {
        "keys": ["load_config.load_format"]
    }
    for overrides, code in [
        ({"load_config": {"no_such_field": 1}}, WireCode.CONFIG_KEY_REJECTED),
        ({"load_config": {"load_format": "bogus"}}, WireCode.CONFIG_VALUE_INVALID),
    ]:
        with pytest.raises(RunnerError) as caught:
            runner.validate_config(overrides)  # type: ignore[arg-type]
        assert caught.value.code is code
    assert _routes(fake, since) == []
    after = runner.describe()
    assert (after.weights_version, after.config_digest) == ("init", before.config_digest)
    assert fake.weight_version == "init"


def test_no_initial_version_can_pass_for_the_degraded_marker(tmp_path: Path) -> None:
    """Versions are identifiers (no ``!``), the initial one too: ``v1!degraded`` is never real."""
    with pytest.raises(ValueError, match="initial_version"):
        VllmRunner({"mode": "sidecar", "model": str(tmp_path), "initial_version": "v1!degraded"})
    VllmRunner({"mode": "sidecar", "model": str(tmp_path), "initial_version": "v1"})


def _metrics(running: int, waiting: int, **finished: int) -> str:
    """vLLM 0.32's /metrics lines for the request counts (and a few that must not count)."""
    labels = 'engine="0",model_name="m"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(running)}",
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {float(waiting)}',
    ]
    for reason in ("stop", "length", "abort", "error", "repetition"):
        count = finished.get(reason, 0)
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {count}.0')
        lines.append(f'vllm:request_success_created{{{labels},finished_reason="{reason}"}} 1.7e9')
    return "\n".join(lines) + "\n"


def test_a_sidecar_drain_counts_what_vllm_finished_not_its_stale_running_gauge() -> None:
    """The gauge read before the pause said 2 running; vLLM then aborted 6 (4 running, 2
    queued, one more finished on its own before the pause landed): the counts are vLLM's."""
    from workers.runners.vllm_sidecar import RequestCounts

    before = RequestCounts.parse(_metrics(2, 0, length=10, abort=1))
    assert (before.running, before.waiting) == (2, 0)
    assert before.finished == {"stop": 0, "length": 10, "abort": 1, "error": 0, "repetition": 0}
    aborted = RequestCounts.parse(_metrics(0, 0, length=11, abort=7))
    assert before.drained(aborted, "abort") == (7, 6)
    waited = RequestCounts.parse(_metrics(0, 0, length=16, abort=1))
    assert before.drained(waited, "wait") == (6, 0)
    kept = RequestCounts.parse(_metrics(4, 2, length=11, abort=1))
    assert before.drained(kept, "keep") == (7, 0)
