"""What each serving engine's DFlash loader reads from an export, written from reading that loader (never
copied). Each `*_loads` takes the config the way the engine gets it (transformers' Qwen3Config from
config.json, model_type "qwen3") and the safetensors tensors, and returns the parameters the engine's model
fills with their shapes plus each layer's attention: (window in keys, query included, or None; causal).

- vLLM: vllm-project/vllm `vllm/model_executor/models/qwen3_dflash.py` (`_dflash_layer_causal`,
  `_resolve_layer_attention`, `DFlashQwen3Model.__init__`, `DFlashQwen3ForCausalLM.load_weights`,
  `hf_to_vllm_mapper`), `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`
  (`get_eagle3_aux_layers_from_config`), `vllm/model_executor/models/registry.py` ("DFlashDraftModel"),
  `vllm/v1/attention/backends/flash_attn.py` (a window W runs as flash-attn (W-1, 0)).
- SGLang: sgl-project/sglang `python/sglang/srt/models/dflash.py` (`_get_dflash_layer_attention_params`,
  `DFlashDraftModel.__init__`/`load_weights`, `DFlashMLP`), `python/sglang/srt/speculative/dflash_utils.py`
  (`parse_dflash_draft_config`, `get_dflash_layer_types`, `get_dflash_attention_sliding_window_size`).
- The reference: z-lab/dflash `dflash/model.py` (`DFlashDraftModel.__init__`, `Qwen3DFlashAttention.__init__`,
  `_attention_mask`, `_draft_value`), loaded with transformers' Qwen3Config (`config_class`).
"""

from __future__ import annotations

from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

SLIDING = "sliding_attention"


def fused_params(hf: Qwen3Config, num_features: int) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's and SGLang's DFlash models build alike: q/k/v fused into qkv_proj and
    gate/up into gate_up_proj (QKVParallelLinear, MergedColumnParallelLinear), the rest as in the export."""
    h, d, ffn = hf.hidden_size, hf.head_dim, hf.intermediate_size
    hq, hkv = hf.num_attention_heads * d, hf.num_key_value_heads * d
    params = {"fc.weight": (h, num_features * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(hf.num_hidden_layers):
        p = f"layers.{i}."
        params |= {
            p + "self_attn.qkv_proj.weight": (hq + 2 * hkv, h),
            p + "self_attn.o_proj.weight": (h, hq),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_up_proj.weight": (2 * ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return params


def tiles(parts: list[tuple[int, tuple[int, ...]]], shape: tuple[int, ...]) -> bool:
    """Whether the shards ``(row offset, shape)`` an engine copies into a fused weight of ``shape`` cover
    its rows exactly, each at its own offset (a q/k/v shard of the wrong size lands over its neighbour)."""
    at = 0
    for offset, part in sorted(parts):
        if offset != at or tuple(part[1:]) != tuple(shape[1:]):
            return False
        at += part[0]
    return at == shape[0]


def vllm_loads(raw: dict, hf: Qwen3Config, tensors: dict) -> dict:
    assert raw["architectures"] == ["DFlashDraftModel"]  # registry -> qwen3_dflash.DFlashQwen3ForCausalLM
    dflash = hf.dflash_config
    aux = getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or [i + 1 for i in dflash["target_layer_ids"]]
    d = hf.head_dim
    hq, hkv = hf.num_attention_heads * d, hf.num_key_value_heads * d
    attention, types = [], getattr(hf, "layer_types", None)
    for i in range(hf.num_hidden_layers):
        use_swa = dflash.get("use_swa", False)
        any_sliding = bool(types) and SLIDING in types
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING
        window = dflash.get("swa_window_size", getattr(hf, "sliding_window", None)) if sliding else None
        assert not sliding or window is not None, "vLLM: sliding attention without a window raises"
        if getattr(hf, "is_causal", None) is not None:
            causal = bool(hf.is_causal)
        elif dflash.get("causal") is not None:
            causal = bool(dflash["causal"])
        else:
            causal = bool(types) and types[i] == SLIDING
        attention.append((window, causal))
    params = {"model." + k: v for k, v in fused_params(hf, len(aux)).items()}
    stacked = {
        ".q_proj": (".qkv_proj", 0),
        ".k_proj": (".qkv_proj", hq),
        ".v_proj": (".qkv_proj", hq + hkv),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", hf.intermediate_size),
    }
    filled: dict[str, list] = {}
    for name, t in tensors.items():
        assert "mask_hidden" not in name and "embed_tokens" not in name and "lm_head" not in name
        name = "model." + name  # load_weights prefixes everything but lm_head / d2t
        for old, (new, offset) in stacked.items():
            if old in name:
                name = name.replace(old, new)
                filled.setdefault(name, []).append((offset, tuple(t.shape)))
                break
        else:
            filled.setdefault(name, []).append((0, tuple(t.shape)))
    return dict(
        params=params,
        filled=filled,
        attention=attention,
        block_size=dflash.get("block_size", 16),
        mask_token_id=dflash["mask_token_id"],
        aux_layers=aux,
        needs_v2_runner=bool(types) and 0 < types.count(SLIDING) < len(types),
    )


def sglang_loads(raw: dict, hf: Qwen3Config, tensors: dict) -> dict:
    dflash = hf.dflash_config
    num_target = dflash.get("num_target_layers", getattr(hf, "num_target_layers", None))
    block_size = dflash.get("block_size", getattr(hf, "block_size", None))
    ids = dflash.get("target_layer_ids", getattr(hf, "target_layer_ids", None))
    assert ids and all(0 <= i < num_target for i in ids), "SGLang raises on an out-of-range target layer"
    mask_id = dflash.get("mask_token_id", getattr(hf, "mask_token_id", None))
    assert isinstance(mask_id, int) and not isinstance(mask_id, bool) and mask_id >= 0
    assert getattr(hf, "hidden_act", "silu") == "silu" and hf.intermediate_size > 0
    types = getattr(hf, "layer_types", None)
    attention = []
    for i in range(hf.num_hidden_layers):
        if types is None or types[i] == "full_attention":
            attention.append((None, False))  # (-1, ENCODER_ONLY)
        else:
            assert types[i] == SLIDING
            window_left = int(hf.sliding_window) - 1  # stored minus one; keys q - k <= window_left
            attention.append((window_left + 1, True))  # DECODER: causal
    params = fused_params(hf, len(ids))
    d = hf.head_dim
    hq, hkv = hf.num_attention_heads * d, hf.num_key_value_heads * d
    # (param, weight, shard id's row offset: QKVParallelLinear / MergedColumnParallelLinear.weight_loader)
    stacked = [
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", hq),
        ("qkv_proj", "v_proj", hq + hkv),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", hf.intermediate_size),
    ]
    filled, ignored = {}, []
    for name, t in tensors.items():
        offset = 0
        for param, weight, at in stacked:
            if f".{weight}." in name:
                name, offset = name.replace(weight, param), at
                break
        resolved = name if name in params else None  # (also tries with/without "model.")
        if resolved is None:
            ignored.append(name)  # SGLang skips an unknown weight silently: a trained tensor lost
            continue
        if resolved == "fc.weight":
            assert tuple(t.shape) == params["fc.weight"], "SGLang raises on a wrong fc.weight shape"
        filled.setdefault(resolved, []).append((offset, tuple(t.shape)))
    return dict(
        params=params,
        filled=filled,
        ignored=ignored,
        attention=attention,
        block_size=block_size,
        num_target_layers=num_target,
        target_layer_ids=list(ids),
        mask_token_id=mask_id,
    )


def reference_loads(hf: Qwen3Config) -> dict:
    dflash = getattr(hf, "dflash_config", {})
    value = lambda name, default=None: dflash.get(name, getattr(hf, name, default))  # noqa: E731 (_draft_value)
    ids = value("target_layer_ids")
    assert ids is not None, "the reference raises without target_layer_ids"
    h, d = hf.hidden_size, hf.head_dim
    bias = hf.attention_bias
    params = {"norm.weight": (h,), "fc.weight": (h, len(ids) * h), "hidden_norm.weight": (h,)}
    attention = []
    for i in range(hf.num_hidden_layers):
        p = f"layers.{i}."
        for proj, shape in (
            ("q_proj", (hf.num_attention_heads * d, h)),
            ("k_proj", (hf.num_key_value_heads * d, h)),
            ("v_proj", (hf.num_key_value_heads * d, h)),
            ("o_proj", (h, hf.num_attention_heads * d)),
        ):
            params[p + f"self_attn.{proj}.weight"] = shape
            if bias:
                params[p + f"self_attn.{proj}.bias"] = (shape[0],)
        params[p + "self_attn.q_norm.weight"] = tuple(Qwen3RMSNorm(d).weight.shape)
        params[p + "self_attn.k_norm.weight"] = (d,)
        params |= {p + "mlp." + k: tuple(v.shape) for k, v in Qwen3MLP(hf).state_dict().items()}
        params[p + "input_layernorm.weight"] = (h,)
        params[p + "post_attention_layernorm.weight"] = (h,)
        layer_type = hf.layer_types[i] if getattr(hf, "layer_types", None) else "full_attention"
        is_causal = getattr(hf, "is_causal", None)
        causal = layer_type == SLIDING if is_causal is None else bool(is_causal)
        window = hf.sliding_window if layer_type == SLIDING else None
        attention.append((window, causal))
    return dict(
        params=params,
        attention=attention,
        block_size=int(value("block_size", 16)),
        mask_token_id=value("mask_token_id"),
        target_layer_ids=list(ids),
    )
