"""The loaders users would pick instead, on the same file in the same run (issue 16).

Each peer ends with the checkpoint's bytes in the model's own tensors (``copy_`` into them, then
the device's sync), so every row does the same work as the runner's reload:

* safetensors ``load_file`` + ``copy_`` (``load_file`` maps the file and copies each tensor out
  of the mapping; the ``copy_`` then moves it into the parameter);
* runai-model-streamer's ``SafetensorsStreamer`` (reads into its own CPU buffers, yields owned
  tensors), at its defaults and at the best of its documented settings
  (``RUNAI_STREAMER_CONCURRENCY``, ``RUNAI_STREAMER_CHUNK_BYTESIZE``: docs/src/env-vars.md;
  ``RUNAI_STREAMER_FS_STRATEGY``: the library's config header), which each new streamer reads
  from the environment;
* fastsafetensors' ``SafeTensorsFileLoader`` with ``nogds=True`` (reads the whole file into one
  buffer on the target device, then hands out views), at its defaults and at the best of its
  documented knobs (``max_threads``, ``bbuf_size_kb``, ``FASTSAFETENSORS_ODIRECT``).

A peer that is not installed, or that fails, yields a row that says why instead of a time: the
benchmark must run anywhere. The naive ``safe_open`` loop and ``load_file`` +
``load_state_dict`` live in measure.py (they predate this module) and count as peers too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.reload import MB

Loader = Callable[[], None]

#: Row-name prefixes of every peer (report.py finds the fastest among them).
PEER_PREFIXES = ("peer:", "naive", "load_file")


@dataclass
class Setting:
    """One configuration of a peer: what it is called in the table and how it is applied."""

    label: str
    env: dict[str, str] = field(default_factory=dict)  # runai reads its settings from here
    kwargs: dict[str, Any] = field(default_factory=dict)  # fastsafetensors takes keywords

    def as_json(self) -> dict[str, Any]:
        return {"label": self.label, "env": self.env, "kwargs": self.kwargs}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Setting:
        return cls(data["label"], dict(data.get("env", {})), dict(data.get("kwargs", {})))


def version(dist: str) -> str | None:
    """The installed version of ``dist``, None when it is missing."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def unavailable(dist: str, module: str) -> str | None:
    """Why the peer ``dist`` cannot run here (not installed, or its import fails), else None."""
    if version(dist) is None:
        return f"{dist} is not installed (pip install '.[bench]')"
    try:
        __import__(module)
    except Exception as exc:  # a native library that does not load is "unavailable" too
        return f"import {module} failed: {exc!r}"
    return None


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in os.environ for the block, restoring what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_file_copy(
    path: Path, targets: dict[str, Any], sync: Callable[[], object], device: str = "cpu"
) -> Loader:
    """safetensors ``load_file`` (to ``device``), then ``copy_`` each tensor into the model."""
    import torch
    from safetensors.torch import load_file

    def run() -> None:
        with torch.no_grad():
            state = load_file(str(path), device=device)
            for name, tensor in state.items():
                targets[name].copy_(tensor)
            del state
        sync()

    return run


# --------------------------------------------------------------------------- runai-model-streamer

RUNAI = "runai-model-streamer"


def runai_settings(cores: int, quick: bool) -> list[Setting]:
    """The settings to try; the first is the defaults. Documented in docs/src/env-vars.md:
    readers (``RUNAI_STREAMER_CONCURRENCY``, default 16) and the bytes each reads at once
    (``RUNAI_STREAMER_CHUNK_BYTESIZE``, default 2 MiB on a file system); in the library's
    config header: the read strategy (``RUNAI_STREAMER_FS_STRATEGY``, 0.17's default
    ``io_uring_direct``, which bypasses the page cache: the buffered strategies can use it).
    Every streamer reads them when it is created, so one process can try them all."""
    strategies = ["", "io_uring_buffered,sync_buffered", "sync_buffered"]
    if quick:  # one point per strategy and the larger chunk: --quick stays short
        grid = [(strategies[1], 16, 2), (strategies[2], 2, 2), ("", 16, 16)]
    else:
        concurrency = sorted({2, 4, 8, 16, 32, cores, 2 * cores})
        grid = [(st, c, 2) for st in strategies for c in concurrency]
        grid += [(st, 16, 16) for st in strategies]
    out = [Setting("defaults")]
    for strategy, c, mib in grid:
        if (strategy, c, mib) == ("", 16, 2):
            continue  # the defaults, already first
        env = {
            "RUNAI_STREAMER_CONCURRENCY": str(c),
            "RUNAI_STREAMER_CHUNK_BYTESIZE": str(mib * MB),
        }
        label = f"CONCURRENCY={c}, CHUNK_BYTESIZE={mib} MiB"
        if strategy:
            env["RUNAI_STREAMER_FS_STRATEGY"] = strategy
            label += f", FS_STRATEGY={strategy.split(',')[0]}"
        out.append(Setting(label, env=env))
    return out


def runai_loader(
    path: Path,
    targets: dict[str, Any],
    sync: Callable[[], object],
    setting: Setting,
    device: str = "cpu",
) -> Loader:
    """``SafetensorsStreamer.stream_file`` to ``device``; each yielded tensor ``copy_``'d into
    the model (on CUDA the streamer's tensors are already on the GPU: a device-to-device copy)."""
    import logging

    import torch
    from runai_model_streamer import SafetensorsStreamer

    # Its INFO lines (ring size, throughput) once per load; torch_xla's logging set-up shows them.
    logging.getLogger("runai_model_streamer").setLevel(logging.WARNING)

    def run() -> None:
        with environ(setting.env), torch.no_grad(), SafetensorsStreamer() as streamer:
            streamer.stream_file(str(path), device=device)
            for name, tensor in streamer.get_tensors():
                targets[name].copy_(tensor)
        sync()

    return run


# --------------------------------------------------------------------------- fastsafetensors

FASTSAFETENSORS = "fastsafetensors"


def fastsafetensors_settings(cores: int, quick: bool) -> list[Setting]:
    """The documented knobs to try; the first is the defaults: copy threads (``max_threads``,
    default 16), the bounce buffer (``bbuf_size_kb``, default 16 MiB) and direct I/O
    (``FASTSAFETENSORS_ODIRECT``, on by default for local file systems: 0 reads through the
    page cache)."""
    if quick:  # buffered reads, with the default and with few threads: --quick stays short
        grid = [(16, 16, "0"), (2, 16, "0")]
    else:
        threads = sorted({1, 2, 4, 8, 16, cores})
        grid = [(t, 16, odirect) for t in threads for odirect in ("", "0")]
        grid += [(16, 4, ""), (16, 64, "")]  # the bounce buffer, at the default threads
    out = [Setting("defaults")]
    for t, mib, odirect in grid:
        if (t, mib, odirect) == (16, 16, ""):
            continue
        label = f"max_threads={t}, bbuf_size_kb={mib * 1024}"
        env = {}
        if odirect:
            env["FASTSAFETENSORS_ODIRECT"] = odirect
            label += f", FASTSAFETENSORS_ODIRECT={odirect}"
        kwargs = {"max_threads": t, "bbuf_size_kb": mib * 1024}
        out.append(Setting(label, env=env, kwargs=kwargs))
    return out


def fastsafetensors_loader(
    path: Path,
    targets: dict[str, Any],
    sync: Callable[[], object],
    setting: Setting,
    device: str = "cpu",
) -> Loader:
    """``SafeTensorsFileLoader(nogds=True)``: the file into one buffer on ``device``, then each
    tensor (a view of it) ``copy_``'d into the model, and the buffer released."""
    import torch
    from fastsafetensors import SafeTensorsFileLoader

    def run() -> None:
        with environ(setting.env):
            load()

    def load() -> None:
        loader = SafeTensorsFileLoader(None, device, nogds=True, **setting.kwargs)
        try:
            loader.add_filenames({0: [str(path)]})
            buffers = loader.copy_files_to_device()
            try:
                with torch.no_grad():
                    for name in buffers.key_to_rank_lidx:
                        targets[name].copy_(buffers.get_tensor(name))
                sync()
            finally:
                buffers.close()
        finally:
            loader.close()

    return run


#: (distribution, module, settings, loader) of each tunable peer.
TUNABLE: dict[str, tuple[str, Callable[..., list[Setting]], Callable[..., Loader]]] = {
    RUNAI: ("runai_model_streamer", runai_settings, runai_loader),
    FASTSAFETENSORS: ("fastsafetensors", fastsafetensors_settings, fastsafetensors_loader),
}


def peer_label(dist: str, setting: str, how: str = "") -> str:
    ver = version(dist) or "?"
    return f"peer: {dist} {ver}{how} ({setting})"
