"""What one load of a checkpoint measured. No torch: the runner interface builds on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from workers.weights.oms import SignedDigests


@dataclass(frozen=True)
class LoadStats:
    """Facts about one load: the checkpoint's size, and the time spent checking and copying it."""

    version: str
    files: int
    tensors: int
    bytes: int
    validate_s: float
    copy_s: float
    duration_s: float
    gbps: float
    #: The signed digests the copied bytes were checked against (oms.py); None: not signed.
    signed: SignedDigests | None = field(default=None, compare=False, repr=False)

    @classmethod
    def measured(
        cls,
        version: str,
        *,
        files: int,
        tensors: int,
        nbytes: int,
        started: float,
        copy_started: float,
        finished: float,
        signed: SignedDigests | None = None,
    ) -> Self:
        """From ``time.perf_counter()`` readings: checks ran from ``started`` to
        ``copy_started``, the copy (or the engine's own load) from then to ``finished``."""
        copy_s = finished - copy_started
        return cls(
            version=version,
            files=files,
            tensors=tensors,
            bytes=nbytes,
            validate_s=copy_started - started,
            copy_s=copy_s,
            duration_s=finished - started,
            gbps=nbytes / copy_s / 1e9 if copy_s > 0 else 0.0,
            signed=signed,
        )
