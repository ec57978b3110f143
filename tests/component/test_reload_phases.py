"""A torch/XLA reload in two phases (issue 14): the checks (signature, headers, plan, the sha256
manifest hashed before copying) run while requests are served; only the copy holds them off, and
the ack's ``drain.paused_s`` covers the drain and the copy, not the checks.

The gated model of test_drain_policy.py holds a request mid-generation when the test says so;
the loader's steps are wrapped to meet the test (events, no sleeps), and the drain gate's clock
is the test's own, so what ``paused_s`` covers is shown by construction, not by timing.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import workers.runners.base as base
import workers.weights.loaders as loaders
from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import MakeCheckpoint, MakeRunner
from tests.component.test_drain_policy import (
    FACTORY,
    GUARD_S,
    HOLDS,
    NEW_TOKENS,
    PROMPTS,
    Clients,
    Hold,
    Reload,
    Versions,
    gated,
    versions,
)
from tests.component.test_loaders_verified import tensor_offset
from workers.demo.checkpoints import sha256_manifest
from workers.runners.base import ReloadResult
from workers.runners.torch_runner import TorchRunner

__all__ = ["gated", "versions"]  # fixtures, used by name


class Checking:
    """Wraps the loader's pre-copy hash (``verify_sha256``, run while preparing): the reload
    signals ``entered`` there and waits for ``go`` before hashing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, then: Callable[[], None] = lambda: None):
        self.entered, self.go = threading.Event(), threading.Event()
        original = loaders.verify_sha256

        def checking(*args: Any, **kwargs: Any) -> None:
            self.entered.set()
            assert self.go.wait(GUARD_S), "the test never let the check go on"
            then()
            original(*args, **kwargs)

        monkeypatch.setattr(loaders, "verify_sha256", checking)


def manifest_spec(versions: Versions) -> ReloadWeightsSpec:
    return ReloadWeightsSpec(
        path=str(versions.v2), version="v2", sha256=sha256_manifest(versions.v2)
    )


def test_requests_are_served_while_a_reload_checks_its_checkpoint(
    gated: Callable[[Hold | None], TorchRunner],
    versions: Versions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the reload hashes its manifest (seeded weights: before copying), the gate admits
    requests: one sent then completes, on v1, before the check goes on; the reload then
    applies v2 and later requests run on it."""
    runner = gated(None)
    checking = Checking(monkeypatch)
    reload = Reload(runner, manifest_spec(versions))
    assert checking.entered.wait(GUARD_S)
    assert runner.describe().extra["phase"] == "validating"
    assert not runner.drain_gate.wait_draining(0)  # nothing held off
    clients = Clients(runner)
    (request,) = clients.once(PROMPTS[0])
    served = request.result()  # completes while the reload is still checking
    assert served == versions.ref1[PROMPTS[0]]
    assert not checking.go.is_set() and reload.thread.is_alive()
    checking.go.set()
    assert isinstance(reload.result(), ReloadResult)
    assert runner.describe().weights_version == "v2"
    assert runner.generate(PROMPTS[0]) == versions.ref2[PROMPTS[0]]


class Clock:
    """The drain gate's ``time.monotonic``: moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_paused_s_covers_the_drain_and_the_copy_not_the_checks(
    gated: Callable[[Hold | None], TorchRunner],
    versions: Versions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate's clock advances 1000 s while the checks run and 1 s while the copy runs:
    ``paused_s`` is exactly the copy's second (the checks ran before the gate was asked for)."""
    runner = gated(None)
    clock = Clock()
    monkeypatch.setattr(base, "time", SimpleNamespace(monotonic=clock.monotonic))

    def checks_take_long() -> None:
        clock.now += 1000.0

    checking = Checking(monkeypatch, checks_take_long)
    checking.go.set()
    copy_plan = loaders.copy_plan

    def copy_takes_a_second(*args: Any, **kwargs: Any) -> None:
        clock.now += 1.0
        copy_plan(*args, **kwargs)

    monkeypatch.setattr(loaders, "copy_plan", copy_takes_a_second)
    result = runner.reload_weights(manifest_spec(versions), versions.v2)
    assert checking.entered.is_set()
    assert result.drain is not None
    assert result.drain.paused_s == 1.0
    assert result.as_dict()["drain"]["paused_s"] == 1.0  # type: ignore[index,call-overload]
    assert runner.describe().weights_version == "v2"


def test_paused_s_includes_the_wait_for_requests_in_flight(
    gated: Callable[[Hold | None], TorchRunner],
    versions: Versions,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request in flight holds the drain off: the time it takes (on the gate's clock) is in
    ``paused_s`` with the copy's, since new requests wait all along. The result's
    ``validate_s`` is the checks' alone (the loader's clock is the test's too), ``duration_s``
    the whole reload."""
    hold = Hold(1)
    runner = gated(hold)
    clock = Clock()
    monkeypatch.setattr(base, "time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(loaders, "time", SimpleNamespace(perf_counter=clock.monotonic))
    clients = Clients(runner)
    (held,) = clients.once(PROMPTS[0])
    hold.entered.wait(GUARD_S)
    reload = Reload(runner, ReloadWeightsSpec(path=str(versions.v2), version="v2"))
    assert runner.drain_gate.wait_draining(GUARD_S)
    clock.now += 7.0  # the request in flight takes 7 s more
    hold.release.set()
    result = reload.result()
    assert isinstance(result, ReloadResult) and result.drain is not None
    assert (result.drain.paused_s, result.drain.in_flight) == (7.0, 1)
    assert (result.validate_s, result.copy_s, result.duration_s) == (0.0, 0.0, 7.0)
    assert held.result() == versions.ref1[PROMPTS[0]]
    clients.join()


# --------------------------------------------------------------------------- the window between


@pytest.fixture
def restorable(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> Iterator[tuple[TorchRunner, Hold]]:
    """A gated runner whose weights came from a checkpoint (v1: restorable), and its hold of
    one request."""
    key = f"phases-{len(HOLDS)}"
    hold = HOLDS[key] = Hold(1)
    runner = make_runner(
        factory=FACTORY,
        model_kwargs={"hold": key},
        config={"max_new_tokens": NEW_TOKENS},
        initial_checkpoint=str(make_checkpoint(0)),
        initial_version="v1",
    )
    yield runner, hold
    HOLDS.pop(key, None)


def weights(runner: TorchRunner) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in runner._targets.items()}


def changed_while_draining(
    runner: TorchRunner,
    hold: Hold,
    spec: ReloadWeightsSpec,
    change: Callable[[], None],
    kept: str = "v1",
) -> RunnerError:
    """Reload ``spec`` while a request is in flight; once the checks are done and the reload
    drains, ``change`` the checkpoint, then let the request finish. The reload's error; the
    model as before (version ``kept``), not degraded."""
    before = weights(runner)
    clients = Clients(runner)
    (held,) = clients.once(PROMPTS[0])
    hold.entered.wait(GUARD_S)
    reload = Reload(runner, spec)
    assert runner.drain_gate.wait_draining(GUARD_S)  # the checks passed: now the drain
    change()
    hold.release.set()
    error = reload.result()
    assert isinstance(held.result(), list)
    clients.join()
    assert isinstance(error, RunnerError), error
    after = weights(runner)
    assert all(torch.equal(after[name], before[name]) for name in before)
    described = runner.describe()
    assert (described.weights_version, described.degraded) == (kept, None)
    return error


def flip_last_tensor(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xde\xad\xbe\xef", tensor_offset(path, -1) + 4)
    finally:
        os.close(fd)


def rewrite_moving_two_tensors(path: Path) -> None:
    """Rewrite ``path`` in place (as ``cp`` over it does: the same inode, the same size) with
    the same checkpoint laid out otherwise: two tensors of one dtype and shape trade places,
    their bytes and their header offsets both. Read at the old header's offsets, the new file
    gives each of the two the other's values."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, info in header.items():
        kind = (info["dtype"], tuple(info["shape"])) if name != "__metadata__" else None
        if kind is not None and kind in seen and info["data_offsets"][1] > info["data_offsets"][0]:
            first = header[seen[kind]]
            break
        if kind is not None:
            seen[kind] = name
    else:
        raise AssertionError(f"{path.name} has no two tensors of one dtype and shape")
    data = bytearray(raw[8 + length :])
    (a0, a1), (b0, b1) = first["data_offsets"], info["data_offsets"]
    data[a0:a1], data[b0:b1] = (
        raw[8 + length + b0 : 8 + length + b1],
        raw[8 + length + a0 : 8 + length + a1],
    )
    first["data_offsets"], info["data_offsets"] = info["data_offsets"], first["data_offsets"]
    moved = json.dumps(header, separators=(",", ":")).encode()
    assert len(moved) <= length
    with open(path, "r+b") as out:  # no O_TRUNC: the descriptor the reload holds sees it all
        out.write(raw[:8] + moved.ljust(length, b" ") + bytes(data))
    assert path.stat().st_size == len(raw)


def test_a_tensor_changed_after_the_checks_is_caught_and_v1_restored(
    restorable: tuple[TorchRunner, Hold], versions: Versions
) -> None:
    """The manifest is hashed as the copy goes (restorable weights): bytes changed after the
    checks, while the reload drains, are found, and v1 is restored."""
    runner, hold = restorable
    spec = manifest_spec(versions)

    error = changed_while_draining(runner, hold, spec, lambda: flip_last_tensor(versions.v2))
    assert error.code is WireCode.CHECKSUM_MISMATCH
    assert "'v1' was restored" in error.message


def test_seeded_weights_changed_while_draining_are_refused_untouched(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """Review MED-2 (a): seeded weights (nothing to restore) and a manifest hashed while
    serving; a tensor changed while the reload drains is refused (CHECKSUM_MISMATCH) before
    the first byte is written, the model as it was and not degraded, instead of being copied
    and found afterwards (WEIGHTS_CORRUPTED, degraded)."""
    hold = Hold(1)
    runner = gated(hold)
    seeded = runner.describe().weights_version
    assert seeded is not None and runner._in_force is None  # nothing to restore
    error = changed_while_draining(
        runner, hold, manifest_spec(versions), lambda: flip_last_tensor(versions.v2), seeded
    )
    assert error.code is WireCode.CHECKSUM_MISMATCH
    assert "nothing was copied" in error.message or "differ from" in error.message


def test_a_file_rewritten_in_place_while_draining_is_refused_before_copying(
    restorable: tuple[TorchRunner, Hold], versions: Versions
) -> None:
    """Review MED-2 (b): no manifest; v2 rewritten in place while the reload drains (the same
    inode, not shorter), its tensors laid out otherwise: the header parsed while serving no
    longer describes the file, so the copy would read two tensors at each other's offsets. It
    is refused before the first byte is written (WEIGHTS_UNREADABLE), v1 untouched."""
    runner, hold = restorable
    spec = ReloadWeightsSpec(path=str(versions.v2), version="v2")
    error = changed_while_draining(
        runner, hold, spec, lambda: rewrite_moving_two_tensors(versions.v2)
    )
    assert error.code is WireCode.WEIGHTS_UNREADABLE
    assert "changed after it was checked" in error.message
    assert "nothing was copied" in error.message


def test_a_file_truncated_after_the_checks_is_refused_before_copying(
    restorable: tuple[TorchRunner, Hold], versions: Versions
) -> None:
    """No manifest: a file cut short while the reload drains is found before the first byte is
    written (WEIGHTS_UNREADABLE, untouched), not by a short read halfway through the copy."""
    runner, hold = restorable
    spec = ReloadWeightsSpec(path=str(versions.v2), version="v2")
    size = versions.v2.stat().st_size
    error = changed_while_draining(runner, hold, spec, lambda: os.truncate(versions.v2, size - 8))
    assert error.code is WireCode.WEIGHTS_UNREADABLE
    assert "shrank" in error.message and "nothing was copied" in error.message
