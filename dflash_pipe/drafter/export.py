"""Export to the reference DFlashDraftModel format (config.json + model.safetensors, plus
modeling_dflash.py and ``auto_map`` for ``AutoModel.from_pretrained(DIR, trust_remote_code=True)``) and load
it back.

An export carries a manifest (``manifest.json``: each file's size and sha256, as a checkpoint does), and
loading it checks the manifest first: a damaged export is one ``ExportError`` line naming the file, what is
wrong and how to export it again. An export written before exports carried a manifest still loads, with a
warning that it is unverified. Every file gets the mode the umask says (0644 under umask 022).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_pipe.config.drafter import SLIDING_ATTENTION, DrafterConfig, read_rope
from dflash_pipe.config.rope import rope_parameters
from dflash_pipe.run.files import DRAFTER_CONFIG, DRAFTER_WEIGHTS
from dflash_pipe.run.manifest import MANIFEST, check_manifest, chmod_from_umask, write_manifest

from .model import DFlashDrafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODELING_NAME = "modeling_dflash.py"
"""The drafter as code for ``AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True)`` (``auto_map``)."""
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME)
"""What every export has and a loader needs (exports before ``MODELING_NAME`` have only these)."""
WRITTEN_FILES = (*EXPORT_FILES, MODELING_NAME)
"""What an export writes; its manifest lists these (and only these: other files in OUT_DIR are not the
export's), so each is verified on load."""
MODELING_SOURCE = Path(__file__).with_name(MODELING_NAME)
"""The file written as ``MODELING_NAME``: torch and transformers only, run from the export directory."""


class ExportError(ValueError):
    """A damaged export, in one line: the file, what is wrong with it, and how to export it again."""


class UnverifiedExportWarning(UserWarning):
    """An export without a manifest (written before exports carried one): loaded, but not verified."""


def reference_config(
    cfg: DrafterConfig, dtype: torch.dtype, *, chat_template_kwargs: dict | None = None
) -> dict:
    """A Qwen3Config-shaped dict with `dflash_config`, plus the top-level keys older loaders read.

    ``chat_template_kwargs``: the chat template arguments the drafter was trained with (the run's
    ``data.chat_template_kwargs``), written as ``dflash_config.chat_template_kwargs`` for
    ``serve-command``; None (unknown, e.g. an export of a model in memory) leaves the key out.

    Which engine reads which key is in docs/drafter.md ("What the export writes"). On purpose absent:
    ``is_causal``, ``dflash_config.causal`` and ``dflash_config.use_swa`` (vLLM and the reference then give
    sliding layers causal and full layers bidirectional attention, as training does; SGLang always does).
    """
    sliding = SLIDING_ATTENTION in cfg.layer_types
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        # AutoModel.from_pretrained(DIR, trust_remote_code=True) builds MODELING_NAME's class (config: Qwen3Config)
        "auto_map": {"AutoModel": f"{MODELING_NAME.removesuffix('.py')}.DFlashDraftModel"},
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
            **({} if chat_template_kwargs is None else {"chat_template_kwargs": dict(chat_template_kwargs)}),
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
    state: dict[str, torch.Tensor],
    cfg: DrafterConfig,
    out_dir: Path,
    dtype: torch.dtype | None,
    chat_template_kwargs: dict | None = None,
) -> None:
    validate_state(state, cfg, "export")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in state.items()
    }
    dtype_out = next(iter(tensors.values())).dtype
    config = json.dumps(reference_config(cfg, dtype_out, chat_template_kwargs=chat_template_kwargs), indent=2)
    config += "\n"
    _replace(out_dir / WEIGHTS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    _replace(out_dir / CONFIG_NAME, lambda tmp: tmp.write_text(config))
    modeling = MODELING_SOURCE.read_bytes()
    _replace(out_dir / MODELING_NAME, lambda tmp: tmp.write_bytes(modeling))
    # Last: a re-export cut short leaves the previous manifest, which then refuses the mixed files.
    write_manifest(out_dir, WRITTEN_FILES)
    chmod_from_umask(out_dir / MANIFEST)


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` to a temporary file beside ``path``, given the umask's mode (safetensors writes 0600), then
    renamed over ``path``: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        chmod_from_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_drafter(model: DFlashDrafter, out_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """Write the reference format; `dtype` casts the weights (None keeps the training dtype)."""
    _write(model.state_dict(), model.cfg, Path(out_dir), dtype)


def export_checkpoint(
    checkpoint_dir: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    chat_template_kwargs: dict | None = None,
) -> None:
    """Training checkpoint (drafter.safetensors + drafter_config.json) -> reference format; no target needed.
    ``chat_template_kwargs``: the run's, recorded in the export (``reference_config``)."""
    ckpt = Path(checkpoint_dir)
    for name in (DRAFTER_WEIGHTS, DRAFTER_CONFIG):
        if not (ckpt / name).is_file():
            raise FileNotFoundError(f"{ckpt}: no {name}; is this a dflash-pipe checkpoint directory?")
    cfg = DrafterConfig.from_dict(json.loads((ckpt / DRAFTER_CONFIG).read_text()))
    _write(load_file(str(ckpt / DRAFTER_WEIGHTS)), cfg, Path(out_dir), dtype, chat_template_kwargs)


def config_from_export(config: dict) -> DrafterConfig:
    """DrafterConfig from an exported config.json (ours, or a reference one without `dflash_pipe`)."""
    if "dflash_pipe" in config:
        return DrafterConfig.from_dict(config["dflash_pipe"])
    dflash = config.get("dflash_config", {})
    num_target = int(dflash.get("num_target_layers", config.get("num_target_layers", 0)))
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        from dflash_pipe.config.drafter import default_target_layer_ids

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


def verify_export(export_dir: str | Path, *, warn: Callable[[str], None] | None = None) -> None:
    """Refuses a damaged export with one ``ExportError`` line; a missing directory or file is a
    FileNotFoundError. With a manifest, every file it lists must have its recorded size and sha256. Without
    one (an export older than manifests) the files must be there and the weights' safetensors header
    readable, and ``warn`` (default: an ``UnverifiedExportWarning``, shown once) hears that it is
    unverified."""
    root = Path(export_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such export directory")
    if (root / MANIFEST).exists():
        problem = check_manifest(root, required=EXPORT_FILES)
        if problem is not None:
            raise ExportError(_damaged(root, problem))
        return
    for name in EXPORT_FILES:
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root}: no {name}; expected a `dflash-pipe export` output directory")
    try:
        with safe_open(str(root / WEIGHTS_NAME), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise ExportError(_damaged(root, _unreadable(root / WEIGHTS_NAME, e))) from None
    note = (
        f"{root} has no {MANIFEST} (it was exported before exports carried one), so its files are not "
        f"verified; export it again from its run dir or checkpoint to add one (dflash-pipe export RUN_DIR {root})"
    )
    if warn is not None:
        warn(note)
    else:
        warnings.warn(note, UnverifiedExportWarning, stacklevel=3)


def read_export_config(export_dir: str | Path) -> DrafterConfig:
    """The DrafterConfig of an export's config.json; an unreadable one is an ``ExportError`` naming it."""
    root = Path(export_dir)
    path = root / CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ExportError(_damaged(root, f"{path} is not valid JSON ({e})")) from None
    try:
        return config_from_export(config)
    except (KeyError, TypeError, AttributeError) as e:
        raise ExportError(
            _damaged(root, f"{path} is not a DFlash config ({type(e).__name__}: {e})")
        ) from None


def load_exported(
    export_dir: str | Path,
    *,
    embed_tokens: nn.Embedding,
    lm_head: nn.Linear,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
) -> DFlashDrafter:
    """Rebuild a DFlashDrafter from an export, checked against its manifest (``verify_export``; pass
    ``verify=False`` when the caller just did) and validating keys and shapes."""
    root = Path(export_dir)
    if verify:
        verify_export(root, warn=warn)
    for name in EXPORT_FILES:
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root}: no {name}; expected a `dflash-pipe export` output directory")
    cfg = read_export_config(root)
    try:
        state = load_file(str(root / WEIGHTS_NAME))
    except SafetensorError as e:
        raise ExportError(_damaged(root, _unreadable(root / WEIGHTS_NAME, e))) from None
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


def _unreadable(path: Path, error: BaseException) -> str:
    return f"{path} is not a readable safetensors file ({' '.join(str(error).split())})"


def _damaged(root: Path, problem: str) -> str:
    return (
        f"{problem}: the export in {root} is damaged. Export it again from its run dir or checkpoint: "
        f"dflash-pipe export RUN_DIR {root}"
    )
