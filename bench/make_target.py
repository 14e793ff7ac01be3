"""Build a random-initialised target of a real model's shape (no downloads), with a chat tokenizer.

Run: PYTHONPATH=. python bench/make_target.py --shape qwen3-8b --out /tmp/qwen3-8b-random [--device cuda]
The weights are random, so features are meaningless for quality but exact for throughput and memory.
The tokenizer is the demo tokenizer (its ids are a subset of the target's vocabulary).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_pipe.data import demo_tokenizer

SHAPES = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied
    "qwen3-tiny": (256, 8, 4, 2, 64, 768, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
}


def qwen3_config(shape: str) -> Qwen3Config:
    """The HF config of one of ``SHAPES`` (bf16, full causal attention in every layer)."""
    hidden, layers, heads, kv, head_dim, inter, vocab, tied = SHAPES[shape]
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--demo-vocab",
        action="store_true",
        help="The demo tokenizer's vocabulary instead of the shape's, so generated replies decode to its text.",
    )
    args = p.parse_args()
    config = qwen3_config(args.shape)
    if args.demo_vocab:
        config.vocab_size = len(demo_tokenizer())
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    demo_tokenizer().save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e9:.2f}B parameters written to {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
