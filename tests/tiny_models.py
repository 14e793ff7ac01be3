"""Tiny HF target configs shared by the tests: small enough for CPU, real enough for HF code paths."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=60,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def save_demo_target(path: Path, **overrides) -> Qwen3ForCausalLM:
    """A tiny random Qwen3 target (4 layers, seed 0) over the demo tokenizer, saved with the tokenizer as
    the HF folder the evaluation commands load."""
    from dflash_pipe.data import demo_tokenizer

    tok = demo_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=len(tok), num_hidden_layers=4, **overrides))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def export_random_drafter(target: Qwen3ForCausalLM, path: Path) -> Path:
    """A random one-layer drafter of ``target`` (the demo tokenizer's MASK, target layers 1 and 2), exported
    to ``path`` in the reference format."""
    from dflash_pipe.data import demo_tokenizer
    from dflash_pipe.drafter import DFlashDrafter, export_drafter
    from tests.drafter.conftest import tiny_config

    tok = demo_tokenizer()
    cfg = tiny_config(
        vocab_size=len(tok), num_hidden_layers=1, mask_token_id=tok.convert_tokens_to_ids("<|mask|>"),
        target_layer_ids=(1, 2),
    )  # fmt: skip
    export_drafter(DFlashDrafter(cfg, target.get_input_embeddings(), target.lm_head), path)
    return path
