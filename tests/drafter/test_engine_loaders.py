"""Exports checked against what each serving engine's DFlash loader reads (engine_loaders.py, with the
loader paths), on three drafters: all full layers, mixed sliding/full, and block size 10 with 3 feature
layers for 2 draft layers. Pinned: every parameter the engine builds is filled with the right shape, no
exported tensor is dropped, every layer gets the attention pattern training gave it
(DrafterConfig.layer_windows, causal exactly for sliding layers), and the rest of what each loader reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_pipe.drafter.export import export_drafter, load_exported
from dflash_pipe.drafter.model import rope_cos_sin

from .conftest import tiny_config, tiny_drafter
from .engine_loaders import SLIDING, reference_loads, sglang_loads, tiles, vllm_loads
from .test_rope import VARIANTS

DRAFTERS = {
    "full": dict(num_hidden_layers=3),
    "mixed": dict(num_hidden_layers=3, layer_types=(SLIDING, SLIDING, "full_attention"), sliding_window=6),
    "bs10": dict(num_hidden_layers=2, block_size=10, target_layer_ids=(0, 1, 3)),
}


@pytest.fixture(params=list(DRAFTERS))
def exported(request, tmp_path):
    model = tiny_drafter(tiny_config(attention_backend="sdpa", **DRAFTERS[request.param]))
    export_drafter(model, tmp_path, dtype=torch.bfloat16)
    raw = json.loads((tmp_path / "config.json").read_text())
    hf = Qwen3Config.from_pretrained(str(tmp_path))  # how vLLM, SGLang and the reference get the config
    return model, tmp_path, raw, hf, load_file(str(tmp_path / "model.safetensors"))


def _training_attention(cfg) -> list[tuple[int | None, bool]]:
    return [(w, w is not None) for w in cfg.layer_windows]


# --- vLLM ----------------------------------------------------------------------------------------------


def test_vllm_loader(exported) -> None:
    """vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py (+ eagle3_utils.py, registry.py)."""
    model, _, raw, hf, tensors = exported
    got = vllm_loads(raw, hf, tensors)
    assert set(got["filled"]) == set(got["params"])  # every parameter filled, nothing dropped
    for name, parts in got["filled"].items():  # stacked shards tile the fused weight, each at its offset
        assert tiles(parts, got["params"][name]), (name, parts, got["params"][name])
    assert got["attention"] == _training_attention(model.cfg)
    assert got["block_size"] == model.cfg.block_size and got["mask_token_id"] == model.cfg.mask_token_id
    assert got["aux_layers"] == [i + 1 for i in model.cfg.target_layer_ids]
    assert got["needs_v2_runner"] == (
        model.cfg.layer_types.count(SLIDING) not in (0, len(model.cfg.layer_types))
    )
    rope = hf.rope_parameters  # get_rope(rope_parameters=config.rope_parameters)
    assert rope["rope_theta"] == model.cfg.rope_theta and rope["rope_type"] == "default"


# --- SGLang --------------------------------------------------------------------------------------------


def test_sglang_loader(exported) -> None:
    """sgl-project/sglang python/sglang/srt/models/dflash.py and python/sglang/srt/speculative/dflash_utils.py."""
    model, _, raw, hf, tensors = exported
    got = sglang_loads(raw, hf, tensors)
    assert got["ignored"] == [] and set(got["filled"]) == set(got["params"])
    for name, parts in got["filled"].items():
        assert tiles(parts, got["params"][name]), (name, parts, got["params"][name])
    assert got["attention"] == _training_attention(model.cfg)
    assert got["block_size"] == model.cfg.block_size
    assert got["num_target_layers"] == model.cfg.num_target_layers
    assert got["target_layer_ids"] == list(model.cfg.target_layer_ids)
    assert got["mask_token_id"] == model.cfg.mask_token_id
    assert hf.rope_parameters["rope_theta"] == model.cfg.rope_theta  # get_rope_config(config)


# --- the z-lab reference -------------------------------------------------------------------------------


def test_reference_loader(exported) -> None:
    """z-lab/dflash dflash/model.py (DFlashDraftModel.from_pretrained: Qwen3Config, strict state dict)."""
    model, _, _, hf, tensors = exported
    got = reference_loads(hf)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == got["params"]  # from_pretrained: strict match
    assert got["attention"] == _training_attention(model.cfg)
    assert got["block_size"] == model.cfg.block_size and got["mask_token_id"] == model.cfg.mask_token_id
    assert got["target_layer_ids"] == list(model.cfg.target_layer_ids)
    positions = torch.arange(0, 300, 7)[None]
    cos, sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 1, hf.head_dim), positions)  # the reference's rotary
    ours = rope_cos_sin(model.inv_freq, positions, torch.float32, model.rope_scale)
    torch.testing.assert_close(ours[0][:, 0], cos)
    torch.testing.assert_close(ours[1][:, 0], sin)


def test_yarn_export_builds_the_same_rope_in_the_reference(tmp_path) -> None:
    scaling = VARIANTS["yarn (gpt-oss)"]
    model = tiny_drafter(
        tiny_config(rope_theta=150000.0, rope_scaling=scaling, max_position_embeddings=131072)
    )
    export_drafter(model, tmp_path)
    hf = Qwen3Config.from_pretrained(str(tmp_path))
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 32.0
    positions = torch.arange(0, 5000, 37)[None]
    cos, sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 1, hf.head_dim), positions)
    ours = rope_cos_sin(model.inv_freq, positions, torch.float32, model.rope_scale)
    torch.testing.assert_close(ours[0][:, 0], cos)
    torch.testing.assert_close(ours[1][:, 0], sin)


# --- our own loader (dflash-pipe eval) -----------------------------------------------------------------


def test_round_trip_through_our_loader(exported) -> None:
    model, path, raw, _, _ = exported
    again = load_exported(path, embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    assert again.cfg == model.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49, (2, 30), generator=g)
    feats = torch.randn(2, 30, model.cfg.feature_size, generator=g)
    anchors, valid = torch.tensor([[3, 12, 25], [8, 20, 27]]), torch.ones(2, 3, dtype=torch.bool)
    with torch.no_grad():
        a = model.to(torch.bfloat16).block_hidden(ids, feats, anchors, valid)
        b = again.block_hidden(ids, feats, anchors, valid)
    assert torch.equal(a, b)
    # a reference checkpoint (no dflash_pipe section, no manifest) reads back to the same shapes and attention
    stripped = {k: v for k, v in raw.items() if k != "dflash_pipe"}
    (Path(path) / "config.json").write_text(json.dumps(stripped))
    (Path(path) / "manifest.json").unlink()
    heard: list[str] = []
    cfg = load_exported(path, embed_tokens=model.embed_tokens, lm_head=model.lm_head, warn=heard.append).cfg
    assert len(heard) == 1 and "not verified" in heard[0]
    for name in (
        "layer_types",
        "sliding_window",
        "block_size",
        "target_layer_ids",
        "rope_theta",
        "rope_scaling",
        "num_target_layers",
        "mask_token_id",
        "hidden_size",
        "intermediate_size",
    ):
        assert getattr(cfg, name) == getattr(model.cfg, name), name
