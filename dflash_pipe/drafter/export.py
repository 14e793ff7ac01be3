"""Export to the reference DFlashDraftModel format (config.json + model.safetensors) and load it back."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import SLIDING_ATTENTION, DrafterConfig, read_rope
from .model import DFlashDrafter
from .rope import rope_parameters

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CHECKPOINT_WEIGHTS = "drafter.safetensors"
CHECKPOINT_CONFIG = "drafter_config.json"


def reference_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """A Qwen3Config-shaped dict with `dflash_config`, plus the top-level keys older loaders read.

    Which engine reads which key is in docs/drafter.md ("What the export writes"). On purpose absent:
    ``is_causal``, ``dflash_config.causal`` and ``dflash_config.use_swa`` (vLLM and the reference then give
    sliding layers causal and full layers bidirectional attention, as training does; SGLang always does).
    """
    sliding = SLIDING_ATTENTION in cfg.layer_types
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": sliding,  # transformers' Qwen3Config drops sliding_window when this is false
        "sliding_window": cfg.sliding_window,
        "max_window_layers": cfg.num_hidden_layers,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "num_target_layers": cfg.num_target_layers,
        },
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        # vLLM reads this before dflash_config.target_layer_ids (HF hidden-state index = layer id + 1)
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "dflash_pipe": cfg.to_dict(),  # exact round trip of our own switches (max_anchors, ...)
    }


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Reference key -> shape; the golden key set of an export."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "norm.weight": (h,),
        "fc.weight": (h, cfg.feature_size),
        "hidden_norm.weight": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hq, h),
            p + "self_attn.k_proj.weight": (hkv, h),
            p + "self_attn.v_proj.weight": (hkv, h),
            p + "self_attn.o_proj.weight": (h, hq),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def validate_state(state: dict[str, torch.Tensor], cfg: DrafterConfig, source: str | Path) -> None:
    """Clear error on missing, unexpected or mis-shaped tensors."""
    want = expected_shapes(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(
            f"{source}: key mismatch with the drafter config: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    bad = [f"{k}: {tuple(state[k].shape)} != {want[k]}" for k in want if tuple(state[k].shape) != want[k]]
    if bad:
        raise ValueError(f"{source}: shape mismatch with the drafter config: {bad[:8]}")


def _write(
    state: dict[str, torch.Tensor], cfg: DrafterConfig, out_dir: Path, dtype: torch.dtype | None
) -> None:
    validate_state(state, cfg, "export")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in state.items()
    }
    out_dtype = next(iter(tensors.values())).dtype
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / CONFIG_NAME).write_text(json.dumps(reference_config(cfg, out_dtype), indent=2) + "\n")


def export_drafter(model: DFlashDrafter, out_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """Write the reference format; `dtype` casts the weights (None keeps the training dtype)."""
    _write(model.state_dict(), model.cfg, Path(out_dir), dtype)


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """Training checkpoint (drafter.safetensors + drafter_config.json) -> reference format; no target needed."""
    ckpt = Path(checkpoint_dir)
    for name in (CHECKPOINT_WEIGHTS, CHECKPOINT_CONFIG):
        if not (ckpt / name).is_file():
            raise FileNotFoundError(f"{ckpt}: no {name}; is this a dflash-pipe checkpoint directory?")
    cfg = DrafterConfig.from_dict(json.loads((ckpt / CHECKPOINT_CONFIG).read_text()))
    _write(load_file(str(ckpt / CHECKPOINT_WEIGHTS)), cfg, Path(out_dir), dtype)


def config_from_export(config: dict) -> DrafterConfig:
    """DrafterConfig from an exported config.json (ours, or a reference one without `dflash_pipe`)."""
    if "dflash_pipe" in config:
        return DrafterConfig.from_dict(config["dflash_pipe"])
    dflash = config.get("dflash_config", {})
    num_target = int(dflash.get("num_target_layers", config.get("num_target_layers", 0)))
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        from .config import default_target_layer_ids

        layer_ids = default_target_layer_ids(num_target, int(config["num_hidden_layers"]))
    if "mask_token_id" not in dflash:
        raise ValueError("config.json: dflash_config.mask_token_id is missing; pass a complete DFlash export")
    theta, scaling = read_rope(SimpleNamespace(**config))
    layer_types = config.get("layer_types")
    sliding = layer_types is not None and SLIDING_ATTENTION in layer_types
    window = dflash.get("swa_window_size", config.get("sliding_window")) if sliding else None
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        num_hidden_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        layer_types=tuple(layer_types) if layer_types is not None else None,
        sliding_window=window,
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        block_size=int(dflash.get("block_size", config.get("block_size", 16))),
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=tuple(layer_ids),
        num_target_layers=num_target or max(layer_ids) + 1,
    )


def load_exported(export_dir: str | Path, *, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> DFlashDrafter:
    """Rebuild a DFlashDrafter from an export, validating keys and shapes."""
    root = Path(export_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root}: no {name}; expected an export_drafter output directory")
    cfg = config_from_export(json.loads((root / CONFIG_NAME).read_text()))
    state = load_file(str(root / WEIGHTS_NAME))
    validate_state(state, cfg, root / WEIGHTS_NAME)
    if embed_tokens.weight.shape[1] != cfg.hidden_size:
        raise ValueError(
            f"{root}: the drafter was trained for hidden size {cfg.hidden_size}, but this target's is "
            f"{embed_tokens.weight.shape[1]}. Evaluate it with the target model it was trained on"
        )
    if embed_tokens.weight.shape[0] != cfg.vocab_size:
        raise ValueError(
            f"{root}: embedding has {embed_tokens.weight.shape[0]} rows but the drafter expects vocab_size={cfg.vocab_size}"
        )
    model = DFlashDrafter(cfg, embed_tokens, lm_head)
    dtype = next(iter(state.values())).dtype
    model.to(dtype=dtype)
    model.load_state_dict(state, strict=True)
    return model
