"""Export format (golden key set), round trip, checkpoint conversion and the frozen target parts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipe.drafter import (
    DrafterConfig,
    export_checkpoint,
    export_drafter,
    load_exported,
    load_frozen_target_parts,
)
from dflash_pipe.drafter.export import EXPORT_FILES
from dflash_pipe.run.manifest import write_manifest
from tests.tiny_models import tiny_qwen3_config

from .conftest import tiny_config, tiny_drafter

GOLDEN_KEYS_2_LAYERS = sorted(
    ["norm.weight", "fc.weight", "hidden_norm.weight"]
    + [
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ]
)


def test_export_key_set_and_config(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    keys = sorted(load_file(str(tmp_path / "model.safetensors")))
    assert keys == GOLDEN_KEYS_2_LAYERS
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {
        "target_layer_ids": [0, 2],
        "block_size": 4,
        "mask_token_id": 49,
        "num_target_layers": 4,
    }
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 4
    Qwen3Config(
        **{k: v for k, v in cfg.items() if k not in ("dflash_config", "dflash_pipe")}
    )  # loads as Qwen3


def test_round_trip_identical_outputs(tmp_path) -> None:
    model = tiny_drafter(tiny_config(attention_backend="sdpa"))
    export_drafter(model, tmp_path)
    again = load_exported(tmp_path, embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    assert again.cfg == model.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49, (2, 14), generator=g)
    feats = torch.randn(2, 14, model.cfg.feature_size, generator=g)
    lm = torch.ones(2, 14, dtype=torch.bool)
    with torch.no_grad():
        a = model(ids, feats, lm, generator=torch.Generator().manual_seed(1))
        b = again(ids, feats, lm, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(a.slot_correct, b.slot_correct)


def test_load_rejects_bad_shapes(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["fc.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    write_manifest(tmp_path, EXPORT_FILES)  # intact as files: the shapes are what is wrong
    with pytest.raises(ValueError, match="fc.weight"):
        load_exported(tmp_path, embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    del state["fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    write_manifest(tmp_path, EXPORT_FILES)
    with pytest.raises(ValueError, match="missing"):
        load_exported(tmp_path, embed_tokens=model.embed_tokens, lm_head=model.lm_head)


def test_export_checkpoint_without_target(tmp_path) -> None:
    model = tiny_drafter()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "drafter.safetensors"))
    (ckpt / "drafter_config.json").write_text(json.dumps(model.cfg.to_dict()))
    export_checkpoint(ckpt, tmp_path / "out", dtype=torch.bfloat16)
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(state) == GOLDEN_KEYS_2_LAYERS
    assert state["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(state["fc.weight"], model.fc.weight.detach().bfloat16())
    with pytest.raises(FileNotFoundError, match="drafter.safetensors"):
        export_checkpoint(tmp_path / "out", tmp_path / "again")


def _tiny_target(tmp_path, tied: bool, shard: str | None = None):
    tc = tiny_qwen3_config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tc)
    path = tmp_path / ("tied" if tied else "untied")
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return model, path


@pytest.mark.parametrize("tied", [True, False])
def test_frozen_target_parts(tmp_path, tied: bool) -> None:
    model, path = _tiny_target(tmp_path, tied, shard="10KB" if not tied else None)
    if not tied:
        assert (path / "model.safetensors.index.json").is_file()
    embed, head = load_frozen_target_parts(path, dtype=torch.float32, device="cpu")
    assert torch.equal(embed.weight, model.model.embed_tokens.weight)
    assert torch.equal(head.weight, model.lm_head.weight)
    assert not embed.weight.requires_grad and not head.weight.requires_grad
    if tied:
        assert head.weight is embed.weight  # never a random LM head for a tied target
    else:
        assert not torch.equal(head.weight, embed.weight)


def test_frozen_target_parts_missing_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_frozen_target_parts(tmp_path / "nope", dtype=torch.float32, device="cpu")


def test_config_from_target_matches_parts(tmp_path) -> None:
    model, path = _tiny_target(tmp_path, tied=True)
    cfg = DrafterConfig.from_target(model.config, num_layers=1, block_size=4, mask_token_id=59)
    embed, head = load_frozen_target_parts(path, dtype=torch.float32, device="cpu")
    assert embed.weight.shape == (cfg.vocab_size, cfg.hidden_size)
    assert cfg.target_layer_ids == (0,)  # a 2-layer target: never the last layer, which no engine captures


def test_load_rejects_a_target_of_another_hidden_size(tmp_path) -> None:
    model = tiny_drafter()
    export_drafter(model, tmp_path)
    hidden = model.embed_tokens.weight.shape[1]
    embed = torch.nn.Embedding(model.embed_tokens.weight.shape[0], hidden * 2)
    with pytest.raises(ValueError, match=f"hidden size {hidden}, but this target's is {hidden * 2}"):
        load_exported(tmp_path, embed_tokens=embed, lm_head=model.lm_head)
