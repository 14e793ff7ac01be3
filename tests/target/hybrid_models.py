"""Tiny random hybrid targets (linear attention + full attention), saved the way Hub checkpoints are, and the
independent reference: each sample alone through the plain HF model with ``output_hidden_states=True``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from tests.target.inputs import VOCAB

_LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # grouped values (Hv = 2 Hk), as in every Qwen3.5 size
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}


def _qwen3_5_text() -> dict:
    return {"model_type": "qwen3_5_text", "intermediate_size": 96, **_ATTENTION, **_LINEAR}


def _qwen3_5_moe_text() -> dict:
    return {"model_type": "qwen3_5_moe_text", **_ATTENTION, **_LINEAR, **_MOE}


def _common(model_type: str) -> dict:
    return {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": len(_TYPES), "layer_types": _TYPES}


HYBRIDS: dict[str, Callable[[], PreTrainedConfig]] = {
    "qwen3_5_text": lambda: AutoConfig.for_model(**_common(""), **_qwen3_5_text()),
    "qwen3_5": lambda: AutoConfig.for_model("qwen3_5", text_config={**_common(""), **_qwen3_5_text()}),
    "qwen3_5_moe_text": lambda: AutoConfig.for_model(**_common(""), **_qwen3_5_moe_text()),
    "qwen3_next": lambda: AutoConfig.for_model(
        "qwen3_next",
        **_common(""),
        intermediate_size=96,
        **_ATTENTION,
        **_LINEAR,
        **_MOE,
        decoder_sparse_step=1,
    ),
    "kimi_linear": lambda: AutoConfig.for_model(
        "kimi_linear",
        **_common(""),
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        linear_head_dim=16,
        linear_num_heads=4,
        moe_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
"""Family name -> tiny config: 5 layers, three linear-attention and two full-attention."""


def save_hybrid(family: str, out: Path, seed: int = 0) -> Path:
    """A randomly initialised ``family`` target written with ``save_pretrained`` (fp32)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(HYBRIDS[family](), dtype=torch.float32)
    model.save_pretrained(out)
    return out


@torch.no_grad()
def per_sample_reference(
    model_dir: Path,
    ids: torch.Tensor,
    lengths: list[int],
    layer_ids: tuple[int, ...],
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Each sample alone through the plain HF model (sdpa, no hooks) on ``device``: ``[len, k*H]`` per
    sample, on the CPU."""
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.eval()
    out = []
    for chunk in ids.split(lengths):
        hs = model(input_ids=chunk[None].to(device), output_hidden_states=True, use_cache=False).hidden_states
        out.append(torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1).cpu())
    return out


def relative_errors(feats: torch.Tensor, reference: list[torch.Tensor], lengths: list[int]) -> list[float]:
    """Relative Frobenius error of each sample's features."""
    return [((a - b).norm() / b.norm()).item() for a, b in zip(feats.split(lengths), reference, strict=True)]
