"""The built-in demo model: a small causal transformer LM over bytes, seeded and deterministic.

Builds and runs the model only; it knows nothing of checkpoints, runners or the control plane.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention plus MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d_model, dim=-1)
        shape = (batch, seq, self.n_heads, d_model // self.n_heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, d_model))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyLM(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final norm, LM head."""

    positions: torch.Tensor

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_seq: int, tied: bool
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.vocab_size = vocab_size
        self.max_seq = max_seq
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.tied = tied
        self.tie_weights()
        # Not a weight: a non-persistent buffer never appears in checkpoints.
        self.register_buffer("positions", torch.arange(max_seq), persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when tied (again after a move that untied them)."""
        if self.tied:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for ids ``[batch, seq]`` (seq <= max_seq)."""
        seq = ids.shape[-1]
        x = self.tok_emb(ids) + self.pos_emb(self.positions[:seq])
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits

    @torch.no_grad()
    def next_logits(self, ids: list[int], *, pad_to: int | None = None) -> torch.Tensor:
        """Float32 CPU logits ``[vocab]`` after the last of ``ids`` (cropped to ``max_seq``).

        ``pad_to`` right-pads the input to a fixed length (causal: the padding changes nothing)
        so a compiling backend such as XLA sees one shape.
        """
        window = ids[-self.max_seq :]
        length = len(window)
        if pad_to is not None:
            window = window + [0] * (min(pad_to, self.max_seq) - length)
        device = self.tok_emb.weight.device
        batch = torch.tensor([window], dtype=torch.long, device=device)
        logits: torch.Tensor = self(batch)
        if pad_to is not None:  # index on the host: a device-side index would be a new graph
            return logits[0].float().cpu()[length - 1]
        return logits[0, length - 1].float().cpu()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        pad_to: int | None = None,
        stop: threading.Event | None = None,
    ) -> list[int]:
        """New token ids after ``prompt_ids``: greedy when temperature is 0, else seeded sampling.

        ``stop``: checked before each token; once set, the tokens so far are returned (fewer
        than ``max_new_tokens``: the caller that set it decides what they are worth)."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        generator = torch.Generator().manual_seed(seed)
        ids = list(prompt_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            if stop is not None and stop.is_set():
                break
            logits = self.next_logits(ids, pad_to=pad_to)
            if temperature == 0:
                token = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(token)
            out.append(token)
        return out


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic init from ``seed`` alone (no global RNG): N(0, 0.02), zero bias, unit norm."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.02, generator=generator)


def tiny_lm(
    vocab_size: int = 256,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    max_seq: int = 128,
    seed: int = 0,
    tied: bool = False,
) -> TinyLM:
    """A seeded TinyLM on the CPU. ``d_model=1024, n_layers=20`` is about 1 GB of fp32 weights."""
    # Built on the CPU, not the meta device: meta init imports torch._dynamo (seconds).
    model = TinyLM(vocab_size, d_model, n_layers, n_heads, max_seq, tied)
    init_weights(model, seed)
    return model.eval().requires_grad_(False)


def encode_text(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes of ``text``."""
    return list(text.encode("utf-8"))


def decode_ids(ids: list[int]) -> str:
    """Text from byte-level tokens (ids above 255 and broken UTF-8 become U+FFFD)."""
    return bytes(i if i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")


def build_model(factory: str, model_kwargs: Mapping[str, Any], seed: int) -> nn.Module:
    """Call the factory named ``"package.module:callable"``, passing ``seed`` when it takes one.

    Raises ValueError when the factory cannot be imported or does not return a module.
    """
    module_name, _, attr = factory.partition(":")
    try:
        func: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import model factory {factory!r}: {exc}") from exc
    kwargs = dict(model_kwargs)
    params = inspect.signature(func).parameters
    if "seed" not in kwargs and (
        "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    ):
        kwargs["seed"] = seed
    model = func(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {factory!r} returned {type(model).__name__}, not a Module")
    return model
