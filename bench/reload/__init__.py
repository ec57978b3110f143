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
* **xla**: the XLA runner on PJRT's CPU device, with the naive loop on the same device and a
  breakdown of where its time goes (read, ``copy_`` to the device, ``torch_xla.sync``).
* **cuda** (skipped without a GPU): pinned and pageable host-to-device bandwidth, the naive loop,
  ``load_file(device="cuda")`` + ``load_state_dict``, and the runner (pinned, double-buffered
  staging); GPU memory peaks from ``torch.cuda.max_memory_allocated``.

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
