"""Read only the target's embedding and LM head from its safetensors (never the whole model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


def _weight_files(root: Path) -> dict[str, Path]:
    """tensor name -> file holding it (single model.safetensors or a sharded index)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / fname for name, fname in weight_map.items()}
    single = root / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise FileNotFoundError(
        f"{root}: no model.safetensors or model.safetensors.index.json; point --target at a local HF model dir"
    )


def _find(files: dict[str, Path], candidates: tuple[str, ...], suffix: str) -> str | None:
    for name in candidates:
        if name in files:
            return name
    matches = sorted(n for n in files if n.endswith(suffix))
    return matches[0] if matches else None


def _load(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_frozen_target_parts(
    target_path: str | Path, *, dtype: torch.dtype, device: torch.device | str
) -> tuple[nn.Embedding, nn.Linear]:
    """(embed_tokens, lm_head) of the target, frozen. A tied target (config tie_word_embeddings, or no
    lm_head tensor in a tied checkpoint) gets an LM head sharing the embedding weight; never a random one."""
    root = Path(target_path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{root}: no config.json; point --target at a local HF model dir")
    config = json.loads(cfg_path.read_text())
    text_cfg = config.get("text_config") or {}
    tied = bool(config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False)))
    files = _weight_files(root)
    embed_name = _find(files, _EMBED_KEYS, "embed_tokens.weight")
    if embed_name is None:
        raise KeyError(f"{root}: no embedding tensor (looked for {_EMBED_KEYS} or '*embed_tokens.weight')")
    embed_w = _load(files, embed_name).to(device=device, dtype=dtype)
    embed = nn.Embedding(embed_w.shape[0], embed_w.shape[1], device="meta")
    embed.weight = nn.Parameter(embed_w, requires_grad=False)
    head_name = None if tied else _find(files, _HEAD_KEYS, "lm_head.weight")
    lm_head = nn.Linear(embed_w.shape[1], embed_w.shape[0], bias=False, device="meta")
    if head_name is not None:
        lm_head.weight = nn.Parameter(
            _load(files, head_name).to(device=device, dtype=dtype), requires_grad=False
        )
    elif tied:
        lm_head.weight = embed.weight
    else:
        raise KeyError(
            f"{root}: tie_word_embeddings is false but there is no lm_head tensor (looked for {_HEAD_KEYS}); "
            "the checkpoint is incomplete"
        )
    for part in (embed, lm_head):
        part.requires_grad_(False)
        part.eval()
    return embed, lm_head
