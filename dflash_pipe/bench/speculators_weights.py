"""speculators' DFlash weights and checkpoints in dflash-pipe's terms: the name map between its
``DFlashDraftModel`` and our drafter (checked both ways: a missing or extra name is an error naming it), its
layer ids, and the export of its checkpoints to our drafter format. Needs neither speculators nor its
trainer: a checkpoint is a ``config.json`` and a ``model.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose names and checkpoint layout this maps."""
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
"""One draft layer's weights, named alike in both (``layers.{i}.`` + name)."""
TOP_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")
VERIFIER_KEYS = frozenset(
    {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"}
)
"""Its model's parts that are the target's (frozen, reloaded from the verifier), not the drafter's."""


def draft_key_map(num_layers: int) -> dict[str, str]:
    """dflash-pipe's drafter weight name -> speculators' ``DFlashDraftModel`` name, every drafter weight."""
    names = {name: name for name in TOP_WEIGHTS}
    for i in range(num_layers):
        names |= {f"layers.{i}.{w}": f"layers.{i}.{w}" for w in LAYER_WEIGHTS}
    return names


def to_speculators(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our drafter's weights under speculators' names; a missing or extra name is a ValueError naming it."""
    names = draft_key_map(num_layers)
    _check_names(set(state), set(names), "dflash-pipe drafter state")
    return {names[k]: v for k, v in state.items()}


def from_speculators(state: dict[str, torch.Tensor], num_layers: int, source: str) -> dict[str, torch.Tensor]:
    """A speculators DFlash state (checkpoint or model) under our names, without its target parts."""
    names = draft_key_map(num_layers)
    _check_names(set(state) - VERIFIER_KEYS, set(names.values()), source)
    return {ours: state[theirs] for ours, theirs in names.items()}


def _check_names(got: set[str], want: set[str], source: str) -> None:
    missing, extra = sorted(want - got), sorted(got - want)
    if missing or extra:
        raise ValueError(
            f"{source}: weight names differ from the DFlash drafter's: missing {missing[:6]}, unexpected "
            f"{extra[:6]}; is it a {SPECULATORS_VERSION} DFlash model of this depth? (bench/peers/"
            "speculators_dflash.py maps names for that release)"
        )


def speculators_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """Its ``--target-layer-ids`` for our feature layer ids: it names the HF hidden-state index (our id + 1;
    its own converter does the same to z-lab's ids)."""
    return [int(i) + 1 for i in layer_ids]


def export_checkpoint(checkpoint: Path, cfg: Any, target: Path, out_dir: Path) -> Path:
    """One speculators checkpoint (``model.safetensors`` + its ``config.json``) as a dflash-pipe drafter
    export (``dflash-pipe eval --drafter`` loads it): its config checked against ``cfg`` (layer ids, block,
    mask token, every layer full attention), its weights renamed (``from_speculators``) and loaded strictly
    into our drafter with the target's embedding and LM head, then exported."""
    from safetensors.torch import load_file

    from dflash_pipe.drafter.export import export_drafter
    from dflash_pipe.drafter.model import DFlashDrafter
    from dflash_pipe.drafter.target_parts import load_frozen_target_parts

    theirs = json.loads((checkpoint / "config.json").read_text())
    layers = theirs["transformer_layer_config"]
    want = {
        "aux_hidden_state_layer_ids": speculators_layer_ids(cfg.target_layer_ids),
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }
    got = {k: layers.get(k) if k == "layer_types" else theirs.get(k) for k in want}
    if got != want:
        raise ValueError(f"{checkpoint}/config.json: {got} differs from the drafter's {want}")
    state = from_speculators(
        load_file(str(checkpoint / "model.safetensors")), cfg.num_hidden_layers, str(checkpoint)
    )
    embed, head = load_frozen_target_parts(target, dtype=torch.float32, device="cpu")
    model = DFlashDrafter(cfg, embed, head)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    export_drafter(model, out_dir, dtype=next(iter(state.values())).dtype)
    return out_dir
