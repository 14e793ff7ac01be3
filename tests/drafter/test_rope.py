"""The drafter's RoPE (rope.py, model.rope_cos_sin) against transformers' own rotary embedding classes.

Each variant is compared with the class a loader builds for the exported drafter (Qwen3RotaryEmbedding on
the drafter's config, as the reference does) and, through ``from_target``, with the target family's own
class (LlamaRotaryEmbedding for llama3, GptOssRotaryEmbedding for gpt-oss's yarn): cos and sin with the
attention factor applied, at positions up to a few thousand.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, LlamaConfig, Qwen3Config
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_pipe.config.rope import rope_inv_freq
from dflash_pipe.drafter import DrafterConfig
from dflash_pipe.drafter.model import rope_cos_sin

from .conftest import tiny_config

HEAD_DIM = 16
VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn (gpt-oss)": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "yarn (DeepSeek-V3 / Kimi mscale)": {
        "rope_type": "yarn",
        "factor": 40.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "yarn (ministral3)": {
        "rope_type": "yarn",
        "factor": 16.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16384,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + 0.3 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 4096,
    },
}
POSITIONS = torch.tensor([[0, 1, 7, 100, 1023, 2047, 3071]])


def _ours(cfg: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, scale = rope_inv_freq(cfg)
    cos, sin = rope_cos_sin(inv_freq, POSITIONS, torch.float32, scale)
    return cos[:, 0], sin[:, 0]  # [1, L, D]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_equals_transformers_qwen3_rotary(name) -> None:
    scaling = VARIANTS[name]
    cfg = tiny_config(
        head_dim=HEAD_DIM, rope_theta=150000.0, rope_scaling=scaling, max_position_embeddings=131072
    )
    hf = Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=131072,
        rope_parameters={**scaling, "rope_theta": 150000.0},
    )
    rot = Qwen3RotaryEmbedding(hf)
    cos, sin = rot(torch.zeros(1, POSITIONS.shape[1], HEAD_DIM), POSITIONS)
    ours_cos, ours_sin = _ours(cfg)
    torch.testing.assert_close(ours_cos, cos, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_sin, sin, atol=1e-6, rtol=1e-5)
    if name in ("yarn (gpt-oss)", "longrope"):  # (DeepSeek's mscale == mscale_all_dim: a factor of 1)
        assert rot.attention_scaling > 1.0  # the factor is really exercised


def test_llama3_target_rope_equals_llamas_own_class() -> None:
    tc = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=8,
        vocab_size=100,
        max_position_embeddings=131072,
        rope_parameters={**VARIANTS["llama3"], "rope_theta": 500000.0},
    )
    cfg = DrafterConfig.from_target(tc, mask_token_id=5, num_layers=2)
    cos, sin = LlamaRotaryEmbedding(tc)(torch.zeros(1, 1, 16), POSITIONS)
    ours_cos, ours_sin = _ours(cfg)
    torch.testing.assert_close(ours_cos, cos, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_sin, sin, atol=1e-6, rtol=1e-5)


def test_gpt_oss_yarn_target_rope_equals_gpt_oss_own_class() -> None:
    tc = GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=8,
        num_local_experts=4,
        vocab_size=100,
    )  # its default rope_parameters: yarn, factor 32, theta 150000
    cfg = DrafterConfig.from_target(tc, mask_token_id=5, num_layers=2)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    cos, sin = GptOssRotaryEmbedding(tc)(torch.zeros(1, 1, 16), POSITIONS)
    # gpt-oss's class returns half-width cos/sin (it rotates interleaved halves); ours repeats them
    ours_cos, ours_sin = _ours(cfg)
    half = ours_cos.shape[-1] // 2
    torch.testing.assert_close(ours_cos[..., :half], cos[..., :half], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_sin[..., :half], sin[..., :half], atol=1e-6, rtol=1e-5)


def test_unknown_or_incomplete_rope_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="rope_type 'nope' is not one this transformers knows"):
        tiny_config(rope_scaling={"rope_type": "nope"})
    with pytest.raises(ValueError, match="rope_scaling=.*linear"):
        tiny_config(rope_scaling={"rope_type": "linear"})  # no factor
