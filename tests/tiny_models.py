"""Tiny HF target configs shared by the tests: small enough for CPU, real enough for HF code paths."""

from __future__ import annotations

from transformers import Qwen3Config


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
