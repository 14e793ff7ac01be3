"""TargetCore.features equals HF's output_hidden_states (packed and padded layouts), and stops after the last
needed layer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipe.target import TargetCore
from tests.target.inputs import NUM_LAYERS, packed_batch

LENGTHS = [7, 13, 1, 10]


def _padded(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent right-padding: input_ids [B, S], attention_mask [B, S]."""
    width = max(lengths)
    out = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, chunk in enumerate(ids.split(lengths)):
        out[b, : len(chunk)] = chunk
        mask[b, : len(chunk)] = 1
    return out, mask


def _plain_model(model_dir, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The target as a plain HF model (sdpa, no hooks): what an offline hidden-state dumper runs."""
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="sdpa"
    ).eval()


LAYOUTS = [
    pytest.param({"packing": "padded"}, id="padded"),
    pytest.param({"packing": "packed", "attention": "sdpa"}, id="packed-sdpa"),
    pytest.param({"packing": "packed", "attention": "flex"}, id="packed-flex"),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("layer_ids", [(1, 3), (3, 0, 2), (0, NUM_LAYERS - 1), (NUM_LAYERS - 1,)])
def test_features_equal_output_hidden_states(model_dir, layer_ids, layout):
    core = TargetCore(model_dir, layer_ids, torch.device("cpu"), torch.float32, **layout)
    ids = packed_batch(LENGTHS)
    feats = core.features(ids, LENGTHS)
    assert feats.shape == (sum(LENGTHS), len(layer_ids) * core.hidden_size)
    assert feats.dtype == torch.float32

    # A plain HF forward (sdpa) of the padded batch with output_hidden_states=True, its selected layers:
    # bit-exact for the padded layout (same kernels), within fp32 rounding for the packed one.
    plain = _plain_model(model_dir)
    padded, mask = _padded(ids, LENGTHS)
    with torch.no_grad():
        hs = plain(input_ids=padded, attention_mask=mask, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[mask.bool()]  # [T, k*H]
    if layout["packing"] == "padded":
        assert torch.equal(feats, ref)
    else:
        torch.testing.assert_close(feats, ref, rtol=1e-5, atol=1e-5)

    # Close: every sample alone, unpadded (padding must not leak into real positions).
    for chunk, got in zip(ids.split(LENGTHS), feats.split(LENGTHS), strict=True):
        with torch.no_grad():
            hs = plain(input_ids=chunk[None], output_hidden_states=True).hidden_states
        alone = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_on_cuda(model_dir, dtype):
    layer_ids = (3, 1, NUM_LAYERS - 1)
    core = TargetCore(model_dir, layer_ids, torch.device("cuda"), dtype)
    ids = packed_batch(LENGTHS)  # on the CPU: features moves it
    feats = core.features(ids, LENGTHS)
    assert feats.device.type == "cuda" and feats.dtype == dtype
    padded, mask = _padded(ids, LENGTHS)
    plain = _plain_model(model_dir, dtype).cuda()
    with torch.no_grad():
        hs = plain(
            input_ids=padded.cuda(), attention_mask=mask.cuda(), output_hidden_states=True
        ).hidden_states
    ref = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[mask.cuda().bool()]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert core.attention == "flex"  # the default on CUDA for plain causal models
    torch.testing.assert_close(feats, ref, rtol=tol, atol=tol)
    cpu = TargetCore(model_dir, layer_ids, "cpu", torch.float32, packing="padded").features(ids, LENGTHS)
    torch.testing.assert_close(feats.float().cpu(), cpu, rtol=tol, atol=tol)
    greedy = core.greedy_next(ids.cuda(), LENGTHS)
    assert greedy.device.type == "cuda" and greedy.shape == (sum(LENGTHS),)


def test_features_in_requested_dtype(qwen3_dir):
    core = TargetCore(qwen3_dir, [1, 2], "cpu", torch.bfloat16)
    feats = core.features(packed_batch([4, 6]).int(), [4, 6])
    assert feats.dtype == torch.bfloat16 and feats.device.type == "cpu"
    assert torch.isfinite(feats.float()).all()


def test_later_layers_and_lm_head_never_run(model_dir):
    core = TargetCore(model_dir, [2, 0], "cpu", torch.float32)
    calls: dict[str, int] = {}

    def counter(name: str):
        def pre_hook(_module, _args):
            calls[name] = calls.get(name, 0) + 1

        return pre_hook

    watched = {f"layer{i}": layer for i, layer in enumerate(core.layers)}
    watched["norm"] = core.model.model.norm
    watched["lm_head"] = core.model.get_output_embeddings()
    handles = [m.register_forward_pre_hook(counter(n)) for n, m in watched.items()]
    try:
        core.features(packed_batch(LENGTHS), LENGTHS)
    finally:
        for h in handles:
            h.remove()
    assert calls == {"layer0": 1, "layer1": 1, "layer2": 1}
    # The hooks are removed afterwards: a plain forward runs to the end.
    out = core.model(input_ids=packed_batch([5])[None])
    assert out.logits.shape == (1, 5, core.vocab_size)


def test_bad_inputs_error(qwen3_dir):
    core = TargetCore(qwen3_dir, [1], "cpu", torch.float32)
    with pytest.raises(ValueError, match="lengths sum to 5 but input_ids has 6"):
        core.features(torch.zeros(6, dtype=torch.long), [2, 3])
    with pytest.raises(ValueError, match="packed 1-D"):
        core.features(torch.zeros(2, 3, dtype=torch.long), [3, 3])
    with pytest.raises(ValueError, match="positive"):
        core.features(torch.zeros(3, dtype=torch.long), [3, 0])
