"""Tiny random configs of every target family dflash-pipe serves, one builder per family.

Each builder returns the config of the class a Hub checkpoint of that family is saved as: the multimodal
families (gemma3, kimi_k25, qwen3_5 and qwen3_5_moe Hub checkpoints) as their ``...ForConditionalGeneration``
config with a tiny vision tower, so loading them back exercises the same code as a real checkpoint. Widths are
tiny (hidden 32-64, 4 layers) so that a forward takes milliseconds on CPU; sliding windows are shorter than
the test samples so the window is exercised. A family the installed transformers lacks is left out of
``FAMILIES`` (``MISSING`` names it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedConfig

VOCAB = 128
LAYERS = 4
WINDOW = 4
"""Sliding window of the sliding-attention families: shorter than every sample of the coverage test."""


@dataclass(frozen=True, slots=True)
class Family:
    """One row of the family table: how to build a tiny checkpoint of it."""

    name: str
    """Row id: the model type, with ``-text`` / ``-multimodal`` where the family has both."""
    model_class: str
    """The transformers class a Hub checkpoint of the family is saved as."""
    config: Callable[[int], PreTrainedConfig]
    """Builds the config for a vocabulary size (a launch needs its tokenizer's)."""
    hybrid: bool = False
    """Has linear-attention layers (Gated DeltaNet / KDA): exact only with per-sample boundaries."""
    padded: bool = False
    """Runs right-padded rows even when packed rows are asked for (packed rows would not be exact)."""

    def save(self, path: Path, *, vocab: int = VOCAB, seed: int = 0) -> Path:
        """A random checkpoint of the family saved with ``save_pretrained``, as on the Hub."""
        torch.manual_seed(seed)
        model = getattr(transformers, self.model_class)(self.config(vocab)).eval()
        model.save_pretrained(path)
        return path

    def save_target(self, path: Path, seed: int = 0) -> Path:
        """A launchable target dir: the checkpoint over the demo tokenizer's vocabulary, plus that tokenizer."""
        from dflash_pipe.data import demo_tokenizer

        tokenizer = demo_tokenizer()
        self.save(path, vocab=len(tokenizer) + 8, seed=seed)  # + 8: rows for the multimodal token ids
        tokenizer.save_pretrained(path)
        return path


def _cls(name: str) -> Callable[..., PreTrainedConfig] | None:
    return getattr(transformers, name, None)


def _attention(vocab: int, **extra) -> dict:
    """The shape every dense-attention family shares: hidden 32, 4 heads of 16 (flex's minimum), 2 KV."""
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def _linear_attention(vocab: int, layers: int = LAYERS, **extra) -> dict:
    """Qwen3.5 / Qwen3-Next shape: 3 of every 4 layers Gated DeltaNet, the 4th gated full attention."""
    fields = _attention(
        vocab,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        **extra,
    )
    fields["num_hidden_layers"] = layers
    return fields


def _moe(**extra) -> dict:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **extra)


def _mla(vocab: int, **extra) -> dict:
    """DeepSeek-V3 multi-head latent attention and MoE, tiny: a dense first layer, then routed experts."""
    fields = _attention(
        vocab,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    fields.update(num_key_value_heads=4, **extra)
    return fields


def _qwen_vision(cls_name: str) -> dict:
    return _cls(cls_name)(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4
    ).to_dict()


def _special_ids(v: int) -> dict:
    """Image/video token ids of the multimodal configs: the last rows of the tiny vocabulary."""
    return dict(
        image_token_id=v - 4, video_token_id=v - 3, vision_start_token_id=v - 2, vision_end_token_id=v - 1
    )


def qwen3(v: int) -> PreTrainedConfig:
    return _cls("Qwen3Config")(**_attention(v, head_dim=16))


def llama(v: int) -> PreTrainedConfig:
    return _cls("LlamaConfig")(**_attention(v))


def mistral(v: int) -> PreTrainedConfig:
    return _cls("MistralConfig")(**_attention(v, sliding_window=WINDOW))


def qwen3_moe(v: int) -> PreTrainedConfig:
    return _cls("Qwen3MoeConfig")(**_attention(v, head_dim=16, **_moe()))


def glm4_moe(v: int) -> PreTrainedConfig:
    moe = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
    return _cls("Glm4MoeConfig")(**_attention(v, first_k_dense_replace=1, **moe))


def gemma3_text(v: int) -> PreTrainedConfig:
    sliding = dict(sliding_window=WINDOW, sliding_window_pattern=2)  # layers 0, 2 sliding; 1, 3 full
    return _cls("Gemma3TextConfig")(**_attention(v, head_dim=16, query_pre_attn_scalar=16, **sliding))


def gemma3_multimodal(v: int) -> PreTrainedConfig:
    vision = _cls("SiglipVisionConfig")(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
        patch_size=4,
    )  # fmt: skip
    return _cls("Gemma3Config")(
        text_config=gemma3_text(v).to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=v - 3,
        eoi_token_index=v - 2,
        image_token_index=v - 1,
    )


def gpt_oss(v: int) -> PreTrainedConfig:
    """Sliding window on alternate layers, attention sinks, yarn RoPE and MoE, as gpt-oss-20b/120b."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    return _cls("GptOssConfig")(
        **_attention(
            v,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
            rope_parameters=yarn,
        )
    )


def deepseek_v3(v: int) -> PreTrainedConfig:
    return _cls("DeepseekV3Config")(**_mla(v))


def kimi_k25(v: int) -> PreTrainedConfig:
    """Kimi-K2.5: a DeepSeek-V3 text model inside a multimodal wrapper that has no causal-LM class."""
    vision = _cls("Kimi_K25VisionConfig")(
        patch_size=4, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2, num_hidden_layers=1,
        hidden_size=16, intermediate_size=32,
    )  # fmt: skip
    return _cls("Kimi_K25Config")(
        text_config=deepseek_v3(v).to_dict(),
        vision_config=vision.to_dict(),
        projection_hidden_size=16,
        **_special_ids(v),
    )


def qwen3_5_text(v: int, layers: int = LAYERS) -> PreTrainedConfig:
    return _cls("Qwen3_5TextConfig")(**_linear_attention(v, layers))


def qwen3_5_multimodal(v: int) -> PreTrainedConfig:
    return _cls("Qwen3_5Config")(
        text_config=qwen3_5_text(v).to_dict(),
        vision_config=_qwen_vision("Qwen3_5VisionConfig"),
        **_special_ids(v),
    )


def qwen3_5_moe(v: int) -> PreTrainedConfig:
    text = _cls("Qwen3_5MoeTextConfig")(**_linear_attention(v, **_moe(shared_expert_intermediate_size=16)))
    return _cls("Qwen3_5MoeConfig")(
        text_config=text.to_dict(), vision_config=_qwen_vision("Qwen3_5MoeVisionConfig"), **_special_ids(v)
    )


def qwen3_next(v: int) -> PreTrainedConfig:
    moe = _moe(shared_expert_intermediate_size=16, decoder_sparse_step=1)
    return _cls("Qwen3NextConfig")(**_linear_attention(v, **moe))


def kimi_linear(v: int) -> PreTrainedConfig:
    """Kimi Linear: KDA linear attention (3 of 4 layers) and MLA full attention, MoE after a dense layer."""
    fields = _mla(v, q_lora_rank=None, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4)
    del fields["n_routed_experts"]
    return _cls("KimiLinearConfig")(
        **fields,
        num_local_experts=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1),
    )


def mixtral(v: int) -> PreTrainedConfig:
    return _cls("MixtralConfig")(**_attention(v, num_local_experts=4, num_experts_per_tok=2))


def gemma2(v: int) -> PreTrainedConfig:
    """Soft-capped attention logits and alternating sliding windows (flex refuses soft-capping)."""
    return _cls("Gemma2Config")(**_attention(v, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16))


def ministral3(v: int) -> PreTrainedConfig:
    """yarn RoPE by default."""
    return _cls("Ministral3Config")(**_attention(v, head_dim=16))


def _plain(cls_name: str) -> Callable[[int], PreTrainedConfig]:
    return lambda v: _cls(cls_name)(**_attention(v))


def cohere2(v: int) -> PreTrainedConfig:
    return _cls("Cohere2Config")(**_attention(v, sliding_window=WINDOW))


def _recurrent_fields(v: int) -> dict:
    fields = _attention(v)
    fields.pop("max_position_embeddings")
    return fields


def lfm2(v: int) -> PreTrainedConfig:
    """LFM2: short-conv layers between attention layers (a sequence mixer the packed row does not know)."""
    return _cls("Lfm2Config")(**_recurrent_fields(v), layer_types=["conv", "conv", "full_attention", "conv"])


def falcon_h1(v: int) -> PreTrainedConfig:
    """Falcon-H1: Mamba-2 and attention side by side in every layer."""
    mamba = dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1)
    return _cls("FalconH1Config")(**_recurrent_fields(v), mamba_chunk_size=8, **mamba)


def granitemoehybrid(v: int) -> PreTrainedConfig:
    """Granite-4: Mamba-2 layers and attention layers, MoE."""
    mamba = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
    return _cls("GraniteMoeHybridConfig")(
        **_recurrent_fields(v),
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        **mamba,
    )


_ROWS: list[tuple[str, str, str, Callable[[int], PreTrainedConfig], bool]] = [
    # (row, config class it needs, checkpoint model class, config builder, hybrid)
    ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", qwen3, False),
    ("llama", "LlamaConfig", "LlamaForCausalLM", llama, False),
    ("mistral", "MistralConfig", "MistralForCausalLM", mistral, False),
    ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", qwen3_moe, False),
    ("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", glm4_moe, False),
    ("gemma3-text", "Gemma3TextConfig", "Gemma3ForCausalLM", gemma3_text, False),
    ("gemma3-multimodal", "Gemma3Config", "Gemma3ForConditionalGeneration", gemma3_multimodal, False),
    ("gpt_oss", "GptOssConfig", "GptOssForCausalLM", gpt_oss, False),
    ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", deepseek_v3, False),
    ("kimi_k25", "Kimi_K25Config", "Kimi_K25ForConditionalGeneration", kimi_k25, False),
    ("qwen3_5-text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", qwen3_5_text, True),
    ("qwen3_5-multimodal", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", qwen3_5_multimodal, True),
    ("qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", qwen3_5_moe, True),
    ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", qwen3_next, True),
    ("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", kimi_linear, True),
    # More families, cheap to check: dense and MoE variants, then hybrids whose mixers the packed row does
    # not know (Mamba-2, short convs), which must run padded rows.
    ("mixtral", "MixtralConfig", "MixtralForCausalLM", mixtral, False),
    ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _plain("Qwen2Config"), False),
    ("phi3", "Phi3Config", "Phi3ForCausalLM", _plain("Phi3Config"), False),
    ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _plain("Olmo2Config"), False),
    ("glm4", "Glm4Config", "Glm4ForCausalLM", _plain("Glm4Config"), False),
    ("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", _plain("SmolLM3Config"), False),
    ("gemma2", "Gemma2Config", "Gemma2ForCausalLM", gemma2, False),
    ("cohere2", "Cohere2Config", "Cohere2ForCausalLM", cohere2, False),
    ("ministral3", "Ministral3Config", "Ministral3ForCausalLM", ministral3, False),
    ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", lfm2, False),
    ("falcon_h1", "FalconH1Config", "FalconH1ForCausalLM", falcon_h1, False),
    ("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", granitemoehybrid, False),
]
PADDED = {"gpt_oss", "lfm2", "falcon_h1", "granitemoehybrid"}
"""Rows that must run right-padded rows when packed ones are asked for."""

FAMILIES: dict[str, Family] = {
    row: Family(name=row, model_class=model, config=build, hybrid=hybrid, padded=row in PADDED)
    for row, config_cls, model, build, hybrid in _ROWS
    if _cls(config_cls) is not None and _cls(model) is not None
}
MISSING: list[str] = [row for row, *_ in _ROWS if row not in FAMILIES]
"""Rows the installed transformers has no classes for (transformers 5.17 and 5.24 differ)."""
