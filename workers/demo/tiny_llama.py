"""Write a tiny, seeded Llama checkpoint (config, safetensors, byte-level BPE tokenizer) offline.

For vLLM tests and demos. transformers and tokenizers are imported inside the functions; nothing
here reaches a model hub or loads a checkpoint into an engine.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: 2 layers, hidden 64, head_dim 32 (vLLM's CPU attention refuses head_dim 16).
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    # Larger than Llama's 0.02: random logits with clear gaps, so greedy decoding is stable
    # across kernels (vLLM vs transformers) and different seeds give different text.
    "initializer_range": 0.4,
}
VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. ",
    "a fleet of model servers reloads its weights without downtime. ",
    "kafka carries every command to every worker, and acks come back. ",
    "hello world, hello fleet, hello vllm. 0123456789 ",
)


def write_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line * 8 for line in _CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out))


def write_tiny_llama(
    out: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    overrides: Mapping[str, Any] | None = None,
    tokenizer_from: Path | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Write a seeded tiny Llama to ``out`` (a new directory) and return it.

    ``overrides`` change the architecture (a different manifest); ``tokenizer_from`` copies the
    tokenizer files of another checkpoint instead of training one; ``max_shard_size`` (e.g.
    "100KB") writes shards with an index json.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=False)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        **{**TINY_LLAMA, **dict(overrides or {})},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    # No sampling defaults: vLLM applies generation_config.json defaults to requests.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1}), encoding="utf-8"
    )
    if tokenizer_from is None:
        write_tokenizer(out)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            source = tokenizer_from / name
            if source.is_file():
                (out / name).write_bytes(source.read_bytes())
    return out


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """New token ids of greedy decoding with transformers in float32 (the reference output).

    A plain argmax loop, like vLLM with ``temperature=0, ignore_eos=True``: EOS is not special.
    """
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]


def main(argv: list[str] | None = None) -> None:
    """``python -m workers.demo.tiny_llama OUT [--seed N] [--tokenizer-from DIR] [--shards SIZE]``."""
    parser = argparse.ArgumentParser(prog="python -m workers.demo.tiny_llama", description=__doc__)
    parser.add_argument("out", type=Path, help="a new directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokenizer-from", type=Path, default=None)
    parser.add_argument("--shards", default=None, help='max shard size, e.g. "100KB"')
    args = parser.parse_args(argv)
    out = write_tiny_llama(
        args.out,
        seed=args.seed,
        dtype=args.dtype,
        tokenizer_from=args.tokenizer_from,
        max_shard_size=args.shards,
    )
    print(out)


if __name__ == "__main__":
    main()
