"""The torch runner on an XLA device (TPU, or the CPU through PJRT_DEVICE=CPU).

The only module that imports torch_xla. On PJRT's CPU device a parameter's buffer is host
memory: a reload reads the file straight into it through a DLPack alias (``host_alias``). On
other devices copies go host -> device per tensor, then one sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.utils.dlpack
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.utils.dlpack as xdl
from pydantic import ConfigDict
from torch_xla import _XLAC  # type: ignore[attr-defined]

from workers.runners.torch_runner import TorchRunner, TorchRunnerOptions


class XlaRunnerOptions(TorchRunnerOptions):
    """As for the torch runner; ``device`` is ignored: the runner uses torch_xla's device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = "xla"


class XlaRunner(TorchRunner):
    name = "xla"
    options_model = XlaRunnerOptions

    def _resolve_device(self) -> torch.device:
        device: torch.device = torch_xla.device()
        return device

    def _sync(self) -> None:
        torch_xla.sync()

    def _device_label(self) -> str:
        device = self._device if self._device is not None else "xla"
        return f"{device} ({xr.device_type()})"

    def _to_host(self, samples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # One graph gathers every sample and one transfer brings them all: not a sync per tensor.
        host: list[torch.Tensor] = xm._maybe_convert_to_cpu(list(samples))  # type: ignore[assignment]
        return host

    # torch_xla does not promise that tracing and running lazy graphs from several threads at
    # once is safe: requests run one at a time, as they did before the drain gate.
    _one_request_at_a_time = True

    def _pad_to(self, model: torch.nn.Module) -> int | None:
        # One input shape means one compiled graph, however long the prompt.
        max_seq = getattr(model, "max_seq", None)
        return max_seq if isinstance(max_seq, int) else None

    def _host_alias(self, tensor: torch.Tensor) -> torch.Tensor | None:
        # Only where the buffer is host memory; a TPU's is not, and keeps the copy path.
        if xr.device_type() != "CPU" or tensor.numel() == 0:
            return None
        # Writing into a buffer XLA considers immutable is safe only while nothing reads it:
        # the caller holds the drain gate alone (no request runs or can start), and this waits
        # for whatever was already queued. Parameters are never aliased by other device tensors
        # (tied weights are copied once, through their canonical name).
        xm.wait_device_ops()
        alias = torch.utils.dlpack.from_dlpack(xdl.to_dlpack(tensor))
        if (
            alias.device.type != "cpu"
            or alias.shape != tensor.shape
            or alias.dtype != tensor.dtype
            or alias.data_ptr() != _XLAC._unsafe_buffer_pointer(tensor)
        ):
            return None  # a copy, not the buffer itself: writing it would change nothing
        return alias
