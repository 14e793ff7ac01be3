from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, Qwen3Config

from dflash_pipe.config.drafter import default_target_layer_ids, gamma_for_block_size
from dflash_pipe.config.mask_token import resolve_mask_token_id
from dflash_pipe.drafter import DrafterConfig


def qwen3_8b_like() -> Qwen3Config:
    return Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=36,
        vocab_size=151936,
        rope_theta=1_000_000.0,
    )


def test_from_qwen3_config() -> None:
    cfg = DrafterConfig.from_target(qwen3_8b_like(), mask_token_id=151669)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        4096,
        32,
        8,
        128,
    )
    assert cfg.intermediate_size == 12288 and cfg.num_hidden_layers == 5 and cfg.num_target_layers == 36
    assert cfg.rope_theta == 1_000_000.0 and cfg.rope_scaling is None
    assert cfg.block_size == 16 and cfg.gamma == 7.0


def test_from_llama_config_with_llama3_rope() -> None:
    tc = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=32,
        vocab_size=1000,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    cfg = DrafterConfig.from_target(tc, mask_token_id=5, block_size=10)
    assert cfg.head_dim == 32  # hidden / heads when the config has no head_dim
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.gamma == 5.0
    assert cfg.target_layer_ids == (1, 8, 15, 22, 29)  # 32 layers: 1 + 7i


def test_layer_id_rule() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(28, 3) == (1, 13, 25)


def test_gamma_rule() -> None:
    assert [gamma_for_block_size(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert gamma_for_block_size(4) == pytest.approx(7 * 3 / 15)


def test_validation_errors_name_the_field() -> None:
    tc = qwen3_8b_like()
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig.from_target(tc, mask_token_id=1, target_layer_ids=(9, 1))
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig.from_target(tc, mask_token_id=1, target_layer_ids=(1, 36))
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.from_target(tc, mask_token_id=151936)
    with pytest.raises(ValueError, match="--mask-token-id"):
        DrafterConfig.from_target(tc)
    with pytest.raises(ValueError, match="attention_backend"):
        DrafterConfig.from_target(tc, mask_token_id=1, attention_backend="xformers")


def test_dict_round_trip_is_json_safe() -> None:
    cfg = DrafterConfig.from_target(qwen3_8b_like(), mask_token_id=151669, max_anchors=256)
    again = DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})


class _Tok:
    def __init__(self, vocab: dict[str, int], mask_token_id=None) -> None:
        self.vocab, self.mask_token_id = vocab, mask_token_id

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return len(self.vocab)


def test_mask_token_lookup_order() -> None:
    assert resolve_mask_token_id(_Tok({"a": 0, "<|mask|>": 1, "<|fim_pad|>": 2}), 10) == 1
    assert resolve_mask_token_id(_Tok({"a": 0, "b": 1}, mask_token_id=1), 10) == 1
    assert resolve_mask_token_id(_Tok({"a": 0, "b": 1}), 10) == 2  # first free embedding row
    assert resolve_mask_token_id(_Tok({"a": 0, "<|fim_pad|>": 1}), 2) == 1  # reserved token
    with pytest.raises(ValueError, match="--mask-token-id"):
        resolve_mask_token_id(_Tok({"a": 0, "b": 1}), 2)
