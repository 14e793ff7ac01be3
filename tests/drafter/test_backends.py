"""flex_attention and SDPA give the same drafter outputs; the mask's meaning holds end to end.

On CPU flex_attention runs uncompiled (forward only: torch has no CPU flex backward), so the
compiled path is exercised by bench/drafter_step.py on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_pipe.drafter.masks import sample_anchors, training_eligible
from dflash_pipe.drafter.model import run_layer
from dflash_pipe.train.build import CompiledLayers, apply_compile

from .conftest import tiny_config, tiny_drafter


def _inputs(cfg, seed: int = 0, bsz: int = 2, seq_len: int = 30):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49, (bsz, seq_len), generator=g)
    feats = torch.randn(bsz, seq_len, cfg.feature_size, generator=g)
    loss_mask = torch.rand(bsz, seq_len, generator=g) > 0.2
    loss_mask[-1, seq_len - 7 :] = False
    return ids, feats, loss_mask


@torch.no_grad()
def test_flex_and_sdpa_forward_agree() -> None:
    cfg = tiny_config(block_size=4, max_anchors=9)
    sdpa = tiny_drafter(dataclasses.replace(cfg, attention_backend="sdpa"))
    flex = tiny_drafter(dataclasses.replace(cfg, attention_backend="flex"))
    flex.load_state_dict(sdpa.state_dict())
    flex._target_parts = sdpa._target_parts
    ids, feats, loss_mask = _inputs(cfg)
    anchors, valid = sample_anchors(
        training_eligible(loss_mask), 9, generator=torch.Generator().manual_seed(0)
    )
    hs = sdpa.block_hidden(ids, feats, anchors, valid)
    hf = flex.block_hidden(ids, feats, anchors, valid)  # pads S to 128 and N to a tile multiple inside
    assert hs.shape == hf.shape
    assert torch.allclose(hs, hf, atol=1e-5)
    out_s = sdpa(ids, feats, loss_mask, generator=torch.Generator().manual_seed(1))
    out_f = flex(ids, feats, loss_mask, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(out_s.loss_sum, out_f.loss_sum, atol=1e-4)
    assert torch.equal(out_s.slot_total, out_f.slot_total)


@torch.no_grad()
def test_context_at_or_after_anchor_is_invisible() -> None:
    cfg = tiny_config(block_size=4, attention_backend="sdpa")
    model = tiny_drafter(cfg)
    ids, feats, _ = _inputs(cfg, bsz=1)
    anchors, valid = torch.tensor([[10, 20]]), torch.tensor([[True, True]])
    base = model.block_hidden(ids, feats, anchors, valid)
    later = feats.clone()
    later[:, 10:] += 5.0  # features at and after the first anchor
    moved = model.block_hidden(ids, later, anchors, valid)
    assert torch.allclose(base[:, 0], moved[:, 0], atol=1e-6)  # block 0 cannot see position >= 10
    assert not torch.allclose(base[:, 1], moved[:, 1], atol=1e-3)  # block 1 sees 10..19
    earlier = feats.clone()
    earlier[:, 9] += 5.0  # the last visible position for block 0
    assert not torch.allclose(base[:, 0], model.block_hidden(ids, earlier, anchors, valid)[:, 0], atol=1e-3)


@torch.no_grad()
def test_blocks_are_independent_and_padded_slots_are_harmless() -> None:
    cfg = tiny_config(block_size=4, attention_backend="sdpa")
    model = tiny_drafter(cfg)
    ids, feats, _ = _inputs(cfg, bsz=1)
    one = model.block_hidden(ids, feats, torch.tensor([[12]]), torch.tensor([[True]]))
    many = model.block_hidden(
        ids, feats, torch.tensor([[3, 12, 25, 0]]), torch.tensor([[True, True, True, False]])
    )
    assert torch.allclose(one[:, 0], many[:, 1], atol=1e-5)
    assert torch.isfinite(many).all()  # the padded slot sees its own block: no NaN row


@pytest.mark.slow
def test_compiled_layers_keep_names_and_match_eager() -> None:
    """Compiled layers apply in place: same state_dict keys, same loss and gradients (SDPA on CPU)."""
    cfg = dataclasses.replace(tiny_config(block_size=4, max_anchors=5), attention_backend="sdpa")
    eager = tiny_drafter(cfg)
    compiled = tiny_drafter(cfg)
    apply_compile(compiled, attention=False, layers=True)
    ids, feats, loss_mask = _inputs(cfg)
    losses, grads = [], []
    for model in (eager, compiled):
        out = model(ids, feats, loss_mask, generator=torch.Generator().manual_seed(4))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert isinstance(compiled.kernels.layer, CompiledLayers) and eager.kernels.layer is run_layer
    assert list(compiled.state_dict()) == list(eager.state_dict())
    torch.testing.assert_close(losses[1], losses[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_a_failing_layer_compile_falls_back_to_eager_with_one_warning(monkeypatch) -> None:
    """An Inductor bug on the layers must cost speed, not the run: eager layers, same loss, one warning."""
    from dflash_pipe.train import build as build_module

    class CompilerBug(Exception):
        pass

    calls = []

    def broken(*_args):
        calls.append(1)
        raise CompilerBug("AssertionError in tiling_utils")

    monkeypatch.setattr(build_module, "_compiled_layer", lambda: broken)
    monkeypatch.setattr(build_module, "compiler_errors", lambda: (CompilerBug,))
    cfg = dataclasses.replace(tiny_config(block_size=4, max_anchors=5), attention_backend="sdpa")
    eager, compiled = tiny_drafter(cfg), tiny_drafter(cfg)
    apply_compile(compiled, attention=False, layers=True)
    ids, feats, loss_mask = _inputs(cfg)
    want = eager(ids, feats, loss_mask, generator=torch.Generator().manual_seed(4)).loss
    with pytest.warns(RuntimeWarning, match="drafter layers failed"):
        got = compiled(ids, feats, loss_mask, generator=torch.Generator().manual_seed(4)).loss
    torch.testing.assert_close(got, want)
    compiled(ids, feats, loss_mask, generator=torch.Generator().manual_seed(5))  # no second attempt
    assert calls == [1] and compiled.kernels.layer.failed


def test_auto_backend_is_flex_on_cuda_only_from_head_dim_16() -> None:
    """Inductor's flex kernels refuse head_dim < 16 ("NYI"), so "auto" picks SDPA there (no GPU needed)."""
    cuda = torch.device("cuda")
    assert tiny_drafter(tiny_config(head_dim=8)).backend(cuda) == "sdpa"
    assert tiny_drafter(tiny_config(head_dim=16)).backend(cuda) == "flex"
    assert tiny_drafter(tiny_config(head_dim=16)).backend(torch.device("cpu")) == "sdpa"


def test_attention_inputs_share_the_autocast_dtype(monkeypatch) -> None:
    """fp32 master weights of q_norm/k_norm promote q and k to fp32 under bf16 autocast while v stays bf16;
    a compiled flex kernel would then run in fp32. The layer casts q and k to v's dtype first."""
    import dflash_pipe.drafter.model as drafter_model

    cfg = tiny_config(block_size=4, max_anchors=4, attention_backend="sdpa")
    model = tiny_drafter(cfg)
    seen, real = [], drafter_model.sdpa_attend

    def spy(mask):
        attend = real(mask)
        return lambda q, k, v: seen.append((q.dtype, k.dtype, v.dtype)) or attend(q, k, v)

    monkeypatch.setattr(drafter_model, "sdpa_attend", spy)
    ids, feats, loss_mask = _inputs(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, feats, loss_mask)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}


@torch.no_grad()
def test_a_draft_step_is_the_same_through_flex_and_sdpa() -> None:
    """Speculative decoding drafts one block at the end of the context: flex pads it to a tile of anchors and
    the context to a multiple of 128, SDPA takes a small dense mask. ``use_attention`` switches a loaded
    drafter between them (the real-model bench times both); the block and the draft are the same."""
    from dflash_pipe.drafter.speculate import drafter_proposer

    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(3)
    n = 37  # verified tokens: neither a multiple of the block nor of the 128-row tile
    tokens = torch.randint(0, 49, (n + 1,), generator=g)
    features = torch.randn(n, drafter.cfg.feature_size, generator=g)
    padded = torch.cat([features, features.new_zeros(1, features.shape[1])])[None]
    anchors, valid = torch.tensor([[n]]), torch.ones(1, 1, dtype=torch.bool)
    out = {}
    for backend in ("flex", "sdpa"):
        drafter.use_attention(backend)
        assert drafter.backend(torch.device("cpu")) == backend
        hidden = drafter.block_hidden(tokens[None], padded, anchors, valid)
        out[backend] = (hidden, drafter_proposer(drafter)(tokens, features))
    torch.testing.assert_close(out["flex"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    assert out["flex"][0].shape == (1, 1, drafter.cfg.block_size, drafter.cfg.hidden_size)
    assert torch.equal(out["flex"][1], out["sdpa"][1])
    with pytest.raises(ValueError, match="attention_backend='xformers'"):
        drafter.use_attention("xformers")
