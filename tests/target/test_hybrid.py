"""Hybrid targets (linear attention + full attention) give exact features on packed rows: every sample of a
packed row equals that sample alone through the plain HF model (fp32, relative error <= 1e-5), for each
hybrid family the installed transformers has, on the per-sample path and on the varlen-kernel path; and a
layer the packed path does not know turns the target to padded rows with one warning."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_pipe.target import TargetCore
from dflash_pipe.target import core as core_module
from dflash_pipe.target.gated_deltanet import Kernels
from dflash_pipe.target.hybrid import Segments, inspect_layers
from dflash_pipe.target.layers import find_decoder_layers
from tests.target.hybrid_models import HYBRIDS, per_sample_reference, relative_errors, save_hybrid
from tests.target.inputs import packed_batch
from tests.tiny_models import tiny_qwen3_config

needs_no_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None,
    reason="runs a hybrid forward on CPU: with fla installed transformers sends CPU tensors to fla's Triton "
    "kernels (test_hybrid_cuda.py covers that machine)",
)
"""Only for the tests that run a hybrid model's forward; the rest (layer inspection, padding decisions,
segments) hold with or without fla."""

LENGTHS = [7, 13, 1, 10]
LAYERS = (0, 1, 2, 3, 4)
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request, tmp_path_factory) -> tuple[str, Path, list[torch.Tensor]]:
    family = request.param
    model_dir = save_hybrid(family, tmp_path_factory.mktemp(family))
    return family, model_dir, per_sample_reference(model_dir, packed_batch(LENGTHS), LENGTHS, LAYERS)


@needs_no_fla
def test_packing_without_boundaries_is_wrong(hybrid):
    """The failure this module exists for: the plain HF forward on one packed row (position ids restarting,
    transformers' block-diagonal mask) matches sample 0 and is far off on every later sample."""
    _family, model_dir, reference = hybrid
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = packed_batch(LENGTHS)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        hs = model(input_ids=ids[None], position_ids=positions[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in LAYERS], dim=-1)
    errors = relative_errors(feats, reference, LENGTHS)
    assert errors[0] <= TOLERANCE
    assert min(errors[1], errors[3]) > 1e-3, errors  # samples of 13 and 10 tokens after others


@needs_no_fla
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "layout", [{"packing": "packed"}, {"packing": "packed", "attention": "flex"}, {"packing": "padded"}]
)
def test_features_equal_each_sample_alone(hybrid, layout, caplog):
    family, model_dir, reference = hybrid
    if layout.get("attention") == "flex" and family == "kimi_linear":  # MLA attention: flex not proven
        with pytest.raises(ValueError, match="FLEX_HYBRIDS"):
            TargetCore(model_dir, LAYERS, torch.device("cpu"), torch.float32, **layout)
        return
    with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
        core = TargetCore(model_dir, LAYERS, torch.device("cpu"), torch.float32, **layout)
    assert core.packing == layout["packing"]
    feats = core.features(packed_batch(LENGTHS), LENGTHS)
    errors = relative_errors(feats, reference, LENGTHS)
    assert max(errors) <= TOLERANCE, errors
    if layout["packing"] == "packed":
        assert "3 per sample on right-padded rows" in caplog.text  # the CPU path: HF's forward per sample
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@needs_no_fla
def test_greedy_next_of_a_packed_hybrid_equals_each_sample_alone(tmp_path):
    model_dir = save_hybrid("qwen3_5_text", tmp_path / "m")
    core = TargetCore(model_dir, (0,), torch.device("cpu"), torch.float32)
    ids = packed_batch(LENGTHS)
    got = core.greedy_next(ids, LENGTHS)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.cat([model(input_ids=c[None]).logits[0].argmax(-1) for c in ids.split(LENGTHS)])
    assert torch.equal(got, want)


# --- the varlen-kernel path (flash-linear-attention on CUDA), its glue checked on CPU ---------------------


def _torch_varlen_kernels(modeling) -> Kernels:
    """Kernels with fla's varlen contract, computed by HF's own torch conv1d and chunked delta rule run on
    each segment alone: the packed forward around them must then give HF's per-sample features."""

    def conv(x, weight, bias, activation, segments: Segments):  # x [1, T, D]
        outs = []
        for part in x[0].split(list(segments.lengths)):  # [n, D]
            y = F.conv1d(
                part.T[None], weight[:, None], bias, padding=weight.shape[-1] - 1, groups=weight.shape[0]
            )
            outs.append(F.silu(y[0, :, : part.shape[0]]).T)
        return torch.cat(outs)[None]

    def delta_rule(q, k, v, g, beta, segments: Segments):
        groups = v.shape[2] // q.shape[2]  # grouped values: fla maps value head i to key head i // groups
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        outs = []
        for s, e in zip(
            segments.cu_seqlens_cpu[:-1].tolist(), segments.cu_seqlens_cpu[1:].tolist(), strict=True
        ):
            out, _ = modeling.torch_chunk_gated_delta_rule(
                q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], use_qk_l2norm_in_kernel=True
            )
            outs.append(out)
        return torch.cat(outs, dim=1)

    return Kernels(name="torch-varlen", conv=conv, delta_rule=delta_rule)


@needs_no_fla
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5"])
def test_varlen_kernel_path_equals_each_sample_alone(family, tmp_path, monkeypatch, caplog):
    model_type = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}.get(family, family)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    monkeypatch.setattr(core_module, "linear_kernels", lambda _device: _torch_varlen_kernels(modeling))
    model_dir = save_hybrid(family, tmp_path / family)
    with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
        core = TargetCore(model_dir, LAYERS, torch.device("cpu"), torch.float32)
    assert "3 through flash-linear-attention with sample boundaries" in caplog.text
    feats = core.features(packed_batch(LENGTHS), LENGTHS)
    reference = per_sample_reference(model_dir, packed_batch(LENGTHS), LENGTHS, LAYERS)
    errors = relative_errors(feats, reference, LENGTHS)
    assert max(errors) <= TOLERANCE, errors


# --- what the packed path does not know runs padded -----------------------------------------------------


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "dflash_pipe.target" and r.levelno >= logging.WARNING]


def test_unknown_layer_type_runs_padded_with_one_warning(tmp_path, caplog):
    """lfm2's short-conv layers (``layer_types`` "conv") are no attention and no known linear attention."""
    config = AutoConfig.for_model(
        "lfm2",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
        core = TargetCore(tmp_path / "m", (0, 2), torch.device("cpu"), torch.float32)
    assert core.packing == "padded"
    (record,) = _warnings(caplog)
    message = record.getMessage()
    assert "['conv']" in message and "layers 0, 2" in message and "right-padded rows" in message
    feats = core.features(packed_batch(LENGTHS), LENGTHS)
    reference = per_sample_reference(tmp_path / "m", packed_batch(LENGTHS), LENGTHS, (0, 2))
    assert max(relative_errors(feats, reference, LENGTHS)) <= TOLERANCE


def test_a_sequence_mixer_without_layer_types_is_found_by_its_module():
    """No ``layer_types`` (a remote-code or Mamba-style model): a Conv1d or a recurrent block in a decoder
    layer, outside the known mixers, is what marks the model unproven."""

    class ShortConvMixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 8, 4, groups=8)

    config = tiny_qwen3_config(num_hidden_layers=3)
    model = AutoModelForCausalLM.from_config(config)
    layers = find_decoder_layers(model)
    assert inspect_layers(config, layers).unproven is None
    layers[1].mlp.add_module("mixer", ShortConvMixer())
    found = inspect_layers(config, layers).unproven
    assert found is not None and "layer 1 holds Conv1d, ShortConvMixer" in found
    layers[1].mlp.mixer = torch.nn.Identity()
    layers[2].add_module("state", type("RwkvBlock", (torch.nn.Module,), {})())
    assert "layer 2 holds RwkvBlock" in inspect_layers(config, layers).unproven


def test_known_types_with_an_unknown_mixer_class_run_padded(tmp_path, caplog):
    """A ``linear_attention`` layer whose mixer class is not one of the proven ones is not packed."""
    from dflash_pipe.target import hybrid

    config = HYBRIDS["qwen3_5_text"]()
    saved = dict(hybrid.LINEAR_MIXERS)
    hybrid.LINEAR_MIXERS.pop("Qwen3_5GatedDeltaNet")
    try:
        with caplog.at_level(logging.INFO, logger="dflash_pipe.target"):
            core = TargetCore(config, (0,), torch.device("cpu"), torch.float32)
    finally:
        hybrid.LINEAR_MIXERS.clear()
        hybrid.LINEAR_MIXERS.update(saved)
    assert core.packing == "padded"
    (record,) = _warnings(caplog)
    assert "Qwen3_5GatedDeltaNet" in record.getMessage()


def test_segments_round_trip():
    lengths = [3, 1, 4]
    segments = Segments.build(lengths, torch.device("cpu"))
    x = torch.arange(8.0).view(1, 8, 1)
    rows, mask = segments.unpack(x)
    assert rows.shape == (3, 4, 1) and mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert rows[2, :, 0].tolist() == [4.0, 5.0, 6.0, 7.0] and rows[1, 1:].abs().sum() == 0
    assert torch.equal(segments.pack(rows), x)
    assert segments.cu_seqlens.tolist() == [0, 3, 4, 8]


_SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
}
ATTENTION_ONLY = {
    "qwen3": {},
    "llama": {},
    "mistral": {},
    "gemma3_text": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        **_MOE,
        "kv_lora_rank": 8,
        "q_lora_rank": 8,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
    },
    "glm4_moe": {**_MOE, "n_group": 1, "topk_group": 1},
}


@pytest.mark.parametrize("model_type", sorted(ATTENTION_ONLY))
def test_attention_only_families_are_not_taken_for_sequence_mixers(model_type):
    """The families that pack fine today stay packed (a case-blind "ssm" once matched GptOssMLP)."""
    config = AutoConfig.for_model(model_type, **_SMALL, **_HEADS, **ATTENTION_ONLY[model_type])
    model = AutoModelForCausalLM.from_config(config)
    plan = inspect_layers(config, find_decoder_layers(model))
    assert plan.unproven is None and not plan.hybrid
