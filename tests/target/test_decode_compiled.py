"""The slot stack's compiled layers (Inductor on CPU here) against its eager ones, one compiled graph for
every layer and model instance, and the fused projections leaving HF's own forward as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipe.target.decode import DecodeStack
from dflash_pipe.target.decode.fuse import fuse_layer
from dflash_pipe.target.layers import find_decoder_layers
from tests.tiny_models import tiny_qwen3_config

MAX_LEN = 96


def _model(seed: int = 0, head_dim: int = 8):
    torch.manual_seed(seed)
    config = tiny_qwen3_config(vocab_size=128, max_position_embeddings=MAX_LEN, head_dim=head_dim)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def _decode(stack: DecodeStack, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list]:
    """Prefills ``prompts`` (fresh), extends slot 0 by a few tokens (attention over its cached columns),
    then greedy steps at two spans: every logits tensor on the way, and the tokens picked."""
    cache = stack.new_cache(len(prompts) + 1)  # one idle slot writes to the trash column
    slots = list(range(len(prompts)))
    out = [stack.prefill(cache, slots, prompts, [0] * len(prompts))]
    out.append(stack.prefill(cache, [0], [[5, 6, 7]], [len(prompts[0])]))
    out.append(stack.prefill(cache, [1], [[9]], [len(prompts[1])]))  # one row, one token (padded if compiled)
    fed = [len(p) for p in prompts]
    fed[0] += 3
    fed[1] += 1
    tokens = torch.tensor([int(out[0][i].argmax()) for i in slots] + [0], device=stack.device)
    tokens[0], tokens[1] = out[1][0].argmax(), out[2][0].argmax()
    positions = torch.tensor([*fed, cache.trash], device=stack.device)
    picked = []
    for step in range(steps):
        span = 48 if step < steps // 2 else 64
        logits = stack.step(cache, tokens, positions, span)
        out.append(logits[: len(prompts)])
        tokens = logits.argmax(dim=-1)
        picked.append(tokens[: len(prompts)].tolist())
        positions = torch.where(positions == cache.trash, positions, positions + 1)
    return out, picked


@pytest.mark.slow
@torch.inference_mode()
def test_compiled_layers_give_the_eager_logits_and_tokens():
    """About 45 s in a full suite, most of it Inductor compiling the decode stack's prefill and decode graphs
    on CPU. The claim is about the compiled graphs, so they are compiled for real."""
    model = _model()
    prompts = [list(range(3, 3 + n)) for n in (17, 9, 30)]
    eager = DecodeStack(model, MAX_LEN, compile_layers=False)
    compiled = DecodeStack(model, MAX_LEN, compile_layers=True)
    assert not eager.compile_layers and compiled.compile_layers and compiled.compile_prefill
    want, want_tokens = _decode(eager, prompts, steps=6)
    got, got_tokens = _decode(compiled, prompts, steps=6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert got_tokens == want_tokens


@pytest.mark.slow
@torch.inference_mode()
def test_one_compiled_graph_serves_every_layer_and_another_model_instance():
    """The weights are inputs of the compiled functions, not constants: a second model (new modules, new
    weights) decodes without compiling anything again, at other slot counts, row counts and lengths
    (single rows and single tokens included: prefill pads them). Layers share the graphs the same way."""
    _decode(
        DecodeStack(_model(0), MAX_LEN, compile_layers=True), [list(range(3, 20)), list(range(40, 52))], 4
    )
    prompts = [list(range(3, 3 + n)) for n in (5, 33, 12, 21)]
    other = DecodeStack(_model(1), MAX_LEN, compile_layers=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        got, _ = _decode(other, prompts, steps=4)
    want, _ = _decode(DecodeStack(_model(1), MAX_LEN, compile_layers=False), prompts, steps=4)
    torch.testing.assert_close(got[-1], want[-1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_fused_projections_are_views_and_leave_hf_forward_unchanged():
    model = _model()
    ids = torch.tensor([list(range(3, 40))])
    before = model(input_ids=ids).logits
    layer = find_decoder_layers(model)[0]
    fused = fuse_layer(layer)
    assert fuse_layer(layer) is fused  # fused once, whichever stack asks
    attn, mlp = layer.self_attn, layer.mlp
    assert fused.qkv_weight is not None and fused.gate_up_weight is not None
    storage = fused.qkv_weight.untyped_storage().data_ptr()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == storage  # a view, not a second copy
    assert (
        mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up_weight.untyped_storage().data_ptr()
    )
    rows = attn.q_proj.out_features
    assert torch.equal(fused.qkv_weight[rows : rows + attn.k_proj.out_features], attn.k_proj.weight)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_fusion_keeps_biases_with_their_rows(bias):
    """Qwen2 and Llama with ``attention_bias`` carry q/k/v biases: they are fused by the same rows."""
    from transformers import Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    attn = find_decoder_layers(model)[0].self_attn
    if not bias:
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias = None
    x = torch.randn(3, 32)
    want = [proj(x) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
    fused = fuse_layer(find_decoder_layers(model)[0])
    assert (fused.qkv_bias is not None) == bias
    got = torch.nn.functional.linear(x, fused.qkv_weight, fused.qkv_bias)
    torch.testing.assert_close(got, torch.cat(want, dim=-1), rtol=0, atol=0)


def test_the_triton_kernel_is_refused_where_it_would_not_be_exact_or_run():
    """fp32 (Triton's dot rounds to tf32), odd head dims and CPUs keep SDPA/matmul; asked for by name there,
    the error says what it needs and what to use instead."""
    from dflash_pipe.target.decode import attention_kernel

    assert not attention_kernel.supported(torch.float32, 128, torch.device("cuda"))
    assert not attention_kernel.supported(torch.bfloat16, 80, torch.device("cuda"))
    assert not attention_kernel.supported(torch.bfloat16, 128, torch.device("cpu"))
    assert attention_kernel.supported(torch.bfloat16, 128, torch.device("cuda"))
    assert DecodeStack(_model(), MAX_LEN).decode_attention == "matmul"  # the CPU default
    with pytest.raises(ValueError, match="needs bf16/fp16 on CUDA.*use 'sdpa' or 'matmul'"):
        DecodeStack(_model(), MAX_LEN, decode_attention="triton")


@torch.inference_mode()
@pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="flex compiles on CUDA only"),
        ),
    ],
    ids=["eager", "compiled"],
)
def test_packed_prefill_equals_hf_forward_per_prompt_and_decodes_as_padded(compiled):
    """Fresh prompts back to back in one row (flex attention through a block mask): each prompt's last
    logits equal HF's own forward on that prompt alone, and what follows (an extend and greedy steps on
    the cache the packed prefill wrote) equals the padded prefill's."""
    model = _model(head_dim=16).to("cuda" if compiled else "cpu")  # compiled flex takes head dims >= 16
    prompts = [list(range(3, 3 + n)) for n in (17, 9, 30)]
    packed = DecodeStack(model, MAX_LEN, compile_layers=compiled, prefill_layout="packed")
    assert packed.prefill_layout == "packed"
    got, got_tokens = _decode(packed, prompts, steps=4)
    for row, prompt in enumerate(prompts):
        want = model(input_ids=torch.tensor([prompt], device=model.device)).logits[0, -1]
        torch.testing.assert_close(got[0][row], want, rtol=1e-4, atol=1e-4)
    padded, padded_tokens = _decode(DecodeStack(model, MAX_LEN, compile_layers=False), prompts, steps=4)
    for a, b in zip(got, padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert got_tokens == padded_tokens


def test_an_unknown_prefill_layout_and_packed_compiled_on_cpu_are_refused():
    with pytest.raises(ValueError, match="prefill_layout must be one of"):
        DecodeStack(_model(), MAX_LEN, prefill_layout="ragged")
    with pytest.raises(ValueError, match="needs CUDA and a head dim >= 16.*on cpu with head dim 16"):
        DecodeStack(_model(head_dim=16), MAX_LEN, compile_prefill=True, prefill_layout="packed")


@pytest.mark.parametrize(
    ("device", "head_dim", "compiled", "want"),
    [
        ("cpu", 16, False, "padded"),  # eager flex materialises the whole score matrix
        ("cpu", 16, True, "padded"),  # compiled flex needs CUDA
        pytest.param(
            "cuda", 16, True, "packed", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
        ),
        pytest.param(
            "cuda", 8, True, "padded", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
        ),  # below compiled flex's smallest head dim
    ],
)
def test_the_default_layout_is_packed_only_where_compiled_flex_runs(device, head_dim, compiled, want):
    stack = DecodeStack(_model(head_dim=head_dim).to(device), MAX_LEN, compile_layers=compiled)
    assert stack.prefill_layout == want
