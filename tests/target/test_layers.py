"""Decoder-layer discovery and layer-id validation fail early and clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from dflash_pipe.target import TargetCore, find_decoder_layers
from tests.target.inputs import NUM_LAYERS


def test_finds_layers_of_common_architectures(qwen3_dir, llama_dir):
    for path in (qwen3_dir, llama_dir):
        core = TargetCore(path, [0], "cpu", torch.float32)
        assert core.layers is core.model.model.layers
        assert core.num_layers == NUM_LAYERS == len(core.layers)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    assert find_decoder_layers(gpt2) is gpt2.transformer.h


class Blob(nn.Module):
    """A model whose layers live nowhere we know, with two equally plausible lists."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"num_hidden_layers": 2})()
        self.stack_a = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.stack_b = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


def test_unfindable_layers_error_names_the_model_class():
    with pytest.raises(ValueError, match=r"cannot find the decoder layers of Blob.*stack_a, stack_b"):
        find_decoder_layers(Blob())
    blob = Blob()
    del blob.stack_b
    assert find_decoder_layers(blob) is blob.stack_a  # the unique list of the configured depth


def test_unfindable_layers_error_from_target_core(qwen3_dir, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Blob())
    with pytest.raises(ValueError, match="decoder layers of Blob"):
        TargetCore(qwen3_dir, [0], "cpu", torch.float32)


@pytest.mark.parametrize(
    ("layer_ids", "match"),
    [
        (
            [1, NUM_LAYERS],
            rf"\[1, {NUM_LAYERS}\].*{NUM_LAYERS} decoder layers.*out of range: \[{NUM_LAYERS}\]",
        ),
        ([-1], r"out of range: \[-1\].*0\.\.4"),
        ([], "empty"),
        ([2, 2], "duplicates"),
    ],
)
def test_bad_layer_ids(qwen3_dir, layer_ids, match):
    with pytest.raises(ValueError, match=match):
        TargetCore(qwen3_dir, layer_ids, "cpu", torch.float32)


def test_loaded_frozen_in_eval_mode(qwen3_dir):
    core = TargetCore(qwen3_dir, [0], "cpu", torch.float32)
    assert not core.model.training
    assert not any(p.requires_grad for p in core.model.parameters())
    assert core.model.config._attn_implementation == "sdpa"
    assert (core.hidden_size, core.vocab_size) == (32, 97)
