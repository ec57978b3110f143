"""Reload bandwidth and memory: in-place reloads into the torch (CPU), XLA (CPU) and CUDA runners.

Writes one fp32 checkpoint of the built-in ``workers.runners.tiny_lm:tiny_lm`` (~1 GB quick, ~4 GB full),
then runs each section in its own subprocess (clean memory, clean RSS baseline):

* **torch** (CPU): baselines, then the runner. Baselines: memcpy (``copy_`` from one preallocated
  flat buffer into the model's own tensors: the same bytes into the same places, the limit when
  the file is cached; also one flat buffer into another), a sequential read of the file
  (``readinto`` a reused 64 MiB buffer: the limit when it is not), the naive per-tensor loop
  serving engines use (``safe_open`` + ``get_tensor`` + ``param.copy_``) and ``load_file`` +
  ``load_state_dict``. Each page-cached, and cold (``posix_fadvise(DONTNEED)`` first; the
  resident fraction before each cold run is checked with ``mincore`` and reported).
  Issue 16 adds, on the same file: the peers users would pick instead (peers.py: ``load_file`` +
  ``copy_``, runai-model-streamer and fastsafetensors at their defaults and at the best of a
  sweep of their documented settings; a row that says why where one is missing or fails) and
  the machine's limits (limits.py: parallel memcpy at the best thread count, parallel reads at
  the best queue depth, buffered and O_DIRECT), which the targets use.
* **xla**: the XLA runner on PJRT's CPU device, with the naive loop and the peers (to host, then
  ``copy_`` to the device, with the settings the torch section chose) on the same device and a
  breakdown of where its time goes (read, ``copy_`` to the device, ``torch_xla.sync``).
* **cuda** (skipped without a GPU): pinned and pageable host-to-device bandwidth, the naive loop,
  ``load_file(device="cuda")`` + ``load_state_dict`` and + ``copy_``, the peers reading to the GPU
  (swept there), and the runner (pinned, double-buffered staging); GPU memory peaks from
  ``torch.cuda.max_memory_allocated``.

``python -m bench.reload.profile`` repeats one of these loaders in a process of its own, for
``perf``: where a target is missed, where the time goes.

Peak extra memory is sampled from /proc/self/status every millisecond during each run: anonymous
(really extra) and file-backed (page cache mapped by mmap readers) separately.

    .venv/bin/python -m bench.reload --quick            # ~1 GB checkpoint
    .venv/bin/python -m bench.reload                    # ~4 GB checkpoint
    .venv/bin/python -m bench.reload --quick --sections cuda --cold-repeats 2
"""

from __future__ import annotations

MB = 2**20
READ_BUFFER = 64 * MB
SIZES = {  # mode -> tiny_lm kwargs
    "tiny": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq": 128},
    "quick": {"d_model": 1024, "n_layers": 20, "n_heads": 8, "max_seq": 128},
    "full": {"d_model": 2048, "n_layers": 20, "n_heads": 8, "max_seq": 128},
}
