"""DrafterConfig.from_target on a tiny config of every family the DFlash authors publish drafters for.

Expected shapes are written from each family's config fields and the rules of docs/drafter.md ("Shapes from
the target"); each drafter is then built and run once (finite loss), so the shapes are usable, not only
plausible. Families the installed transformers lacks are skipped by name.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from dflash_pipe.drafter import DFlashDrafter, DrafterConfig

SMALL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8, vocab_size=128
)
MLA = dict(
    SMALL,
    intermediate_size=96,
    moe_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
)
FAMILIES = {
    "qwen3": dict(SMALL, intermediate_size=96, head_dim=16),
    "llama": dict(SMALL, intermediate_size=96),
    "qwen3_moe": dict(SMALL, intermediate_size=192, moe_intermediate_size=32, num_experts=4, head_dim=16),
    "qwen3_5_text": dict(SMALL, intermediate_size=96, head_dim=16),
    "qwen3_5": dict(text_config=dict(SMALL, intermediate_size=96, head_dim=16)),  # multimodal wrapper
    "qwen3_5_moe": dict(text_config=dict(SMALL, moe_intermediate_size=32, num_experts=4, head_dim=16)),
    "qwen3_next": dict(SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=16),
    "gpt_oss": dict(SMALL, intermediate_size=64, head_dim=16, num_local_experts=4),
    "deepseek_v3": dict(MLA, first_k_dense_replace=1),
    "kimi_k25": dict(text_config=MLA),  # DeepSeek-V3 text model in a multimodal wrapper
    "gemma3": dict(text_config=dict(SMALL, intermediate_size=96, head_dim=16)),
    "ministral3": dict(SMALL, intermediate_size=96, head_dim=16),
    "glm4_moe": dict(SMALL, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, head_dim=16),
}


def _target(model_type: str):
    try:
        return AutoConfig.for_model(model_type, **FAMILIES[model_type])
    except (KeyError, ValueError) as exc:
        pytest.skip(f"{model_type}: not in this transformers ({exc})")


def _expected(tc) -> dict:
    """The rules of docs/drafter.md, from the (text) config's own fields."""
    heads = tc.num_attention_heads
    if getattr(tc, "kv_lora_rank", None):  # MLA: v_head_dim, <= 8 KV heads dividing the head count
        head_dim, kv = tc.v_head_dim, max(d for d in range(1, min(8, heads) + 1) if heads % d == 0)
    else:
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        kv = tc.num_key_value_heads
    ffn = getattr(tc, "intermediate_size", None) or 3 * tc.hidden_size
    return dict(
        hidden_size=tc.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=ffn,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
    )


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_from_target_every_family(model_type) -> None:
    target = _target(model_type)
    tc = target.get_text_config()
    cfg = DrafterConfig.from_target(target, mask_token_id=3, num_layers=2, block_size=4, max_anchors=4)
    for name, value in _expected(tc).items():
        assert getattr(cfg, name) == value, name
    assert cfg.target_layer_ids == (1, 5)  # round(1 + i*(8-4)/(2-1))
    if model_type in ("qwen3_5_moe",):
        assert getattr(tc, "intermediate_size", None) is None and cfg.intermediate_size == 3 * tc.hidden_size
    assert cfg.rope_scaling is None or "partial_rotary_factor" not in cfg.rope_scaling
    torch.manual_seed(0)
    model = DFlashDrafter(
        cfg, nn.Embedding(cfg.vocab_size, cfg.hidden_size), nn.Linear(cfg.hidden_size, cfg.vocab_size)
    )
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    out = model(ids, torch.randn(1, 12, cfg.feature_size), torch.ones(1, 12, dtype=torch.bool))
    assert out.num_anchors > 0 and math.isfinite(float(out.loss_sum.detach()))


def test_yarn_targets_keep_their_rope() -> None:
    """gpt-oss, DeepSeek-V3/Kimi-style and ministral3 yarn reach the drafter (they were refused before)."""
    for model_type in ("gpt_oss", "ministral3"):
        cfg = DrafterConfig.from_target(_target(model_type), mask_token_id=3, num_layers=2)
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] > 1
    ds = _target("deepseek_v3")
    ds.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    }
    cfg = DrafterConfig.from_target(ds, mask_token_id=3, num_layers=2)
    assert cfg.rope_scaling["factor"] == 40.0 and cfg.head_dim == ds.v_head_dim


def test_gemma3_takes_the_full_attention_rope() -> None:
    cfg = DrafterConfig.from_target(_target("gemma3"), mask_token_id=3, num_layers=2)
    tc = _target("gemma3").get_text_config()
    assert cfg.rope_theta == tc.rope_parameters["full_attention"]["rope_theta"]
