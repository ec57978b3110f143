"""The torch runner on an XLA device (TPU, or the CPU through PJRT_DEVICE=CPU).

The only module that imports torch_xla. Copies go host -> device per tensor, then one sync.
"""

from __future__ import annotations

import torch
import torch_xla
import torch_xla.runtime as xr
from pydantic import ConfigDict

from workers.torch_runner import TorchRunner, TorchRunnerOptions


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

    def _pad_to(self, model: torch.nn.Module) -> int | None:
        # One input shape means one compiled graph, however long the prompt.
        max_seq = getattr(model, "max_seq", None)
        return max_seq if isinstance(max_seq, int) else None
