"""A fingerprint of the weights a model holds: cheap enough for every reload of a large model.

Workers of a fleet report it in each succeeded reload ack (``result["weights_digest"]``) so the
controller can check they all hold the same weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import torch

#: Elements sampled from each end of a tensor, and at a fixed stride through it.
SAMPLE_ELEMENTS: Final = 16

#: Brings sampled device tensors to the host, in order (one small copy each by default).
ToHost = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def _cpu(samples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [s.cpu() for s in samples]


def sample(tensor: torch.Tensor, k: int = SAMPLE_ELEMENTS) -> torch.Tensor:
    """The elements of ``tensor`` (flattened in row-major order) that the fingerprint covers, on
    the tensor's own device: the first ``k``, the last ``k``, and ``k`` at the fixed stride
    ``s = max(1, n // k)`` starting at ``s // 2`` (offsets ``s//2 + i*s``, ``i < k``, those below
    ``n``); with overlaps repeated, so every tensor of ``n`` elements samples the same offsets."""
    flat = tensor.detach().reshape(-1)  # a view for the contiguous parameters of a model
    n = flat.numel()
    stride = max(1, n // k)
    return torch.cat((flat[:k], flat[max(0, n - k) :], flat[stride // 2 :: stride][:k]))


def weights_digest(tensors: Mapping[str, torch.Tensor], *, to_host: ToHost = _cpu) -> str:
    """The sha256 (64 lowercase hex digits) of a fingerprint of ``tensors``, NOT of all their bytes.

    For each tensor, in sorted name order: its name, its dtype (``str(tensor.dtype)``), its shape,
    and the raw little-endian bytes of the elements :func:`sample` picks (at most 48 per tensor),
    read from the tensor where it lives (one small device-to-host copy each; ``to_host`` may batch
    them, as XLA wants). Each field is length-prefixed, so no two inputs run together.

    Equal weights give the same digest in any process on any (little-endian) host. Different
    checkpoints (other seed, other training step, other dtype or shapes) differ with overwhelming
    probability. A change confined to elements it does not sample (one flipped byte mid-tensor)
    goes unnoticed: the checkpoint's own checks (sizes, sha256 when the command gives one) cover
    the bytes; this covers which weights the model holds after the copy.
    """
    names = sorted(tensors)
    samples = to_host([sample(tensors[name]) for name in names])
    h = hashlib.sha256()
    for name, tensor, values in zip(names, (tensors[n] for n in names), samples, strict=True):
        shape = ",".join(str(d) for d in tensor.shape)
        data = values.detach().contiguous().view(torch.uint8).numpy().tobytes()
        for field in (name.encode(), str(tensor.dtype).encode(), shape.encode(), data):
            h.update(len(field).to_bytes(8, "little"))
            h.update(field)
    return h.hexdigest()
