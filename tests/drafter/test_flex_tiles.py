"""The flex tiles the drafter asks for: only where they were measured faster (sm90, 128 < head_dim <= 256)."""

import pytest
import torch

from dflash_pipe.compute.compile import FLEX_SM90_WIDE_HEAD_TILES, flex_kernel_options


@pytest.mark.parametrize(
    ("capability", "head_dim", "expected"),
    [
        ((9, 0), 256, FLEX_SM90_WIDE_HEAD_TILES),
        ((9, 0), 192, FLEX_SM90_WIDE_HEAD_TILES),
        ((9, 0), 128, None),  # Inductor's own sm90 tiles at 128 are the fast ones (the 8B drafter)
        ((8, 0), 256, None),  # A100: not measured, Inductor decides
        ((10, 0), 256, None),  # Blackwell: not measured
    ],
)
def test_tiles_by_gpu_and_head_dim(monkeypatch, capability, head_dim, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert flex_kernel_options(head_dim, torch.device("cuda", 0)) == expected


def test_cpu_keeps_inductor_choice():
    assert flex_kernel_options(256, torch.device("cpu")) is None


def test_tiles_fit_the_mask_tiles():
    """Every block size divides flex's 128-row mask tile, the rule create_block_mask's tiles impose."""
    blocks = {k: v for k, v in FLEX_SM90_WIDE_HEAD_TILES.items() if "BLOCK" in k}
    assert blocks and all(128 % v == 0 for v in blocks.values())
    assert blocks["bwd_BLOCK_N1"] % blocks["bwd_BLOCK_M1"] == 0  # Inductor's backward requires these
    assert blocks["bwd_BLOCK_M2"] % blocks["bwd_BLOCK_N2"] == 0


def test_the_drafter_passes_its_tiles_to_each_compiled_flex_call(monkeypatch):
    """Decided once per step outside the compiled layers (Dynamo then sees a constant), for every layer
    pattern; the uncompiled kernel gets none."""
    import dflash_pipe.drafter.model as drafter_model
    from dflash_pipe.train.build import apply_attention_only

    from .conftest import tiny_config, tiny_drafter

    cfg = tiny_config(
        block_size=4,
        max_anchors=4,
        num_hidden_layers=2,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=8,
        attention_backend="flex",
    )
    model = tiny_drafter(cfg)
    real_flex_attend = drafter_model.flex_attend  # before it is replaced below
    asked, calls = [], []
    monkeypatch.setattr(
        drafter_model, "flex_kernel_options", lambda head_dim, device: asked.append(head_dim) or {"t": 1}
    )
    monkeypatch.setattr(model, "_compiles_attention", lambda device: True)
    monkeypatch.setattr(drafter_model, "flex_block_mask", lambda *a, **k: "mask")
    monkeypatch.setattr(drafter_model, "flex_attend", lambda mask, **kw: calls.append(kw))
    anchors, valid = torch.zeros(1, 32, dtype=torch.long), torch.ones(1, 32, dtype=torch.bool)
    model._attends("flex", anchors, valid, 128, torch.device("cpu"))
    assert asked == [cfg.head_dim, cfg.head_dim]  # one per layer pattern: sliding, full
    assert calls == [{"compile": True, "tiles": {"t": 1}}] * 2
    apply_attention_only(model)  # the compile check's fallback: Inductor's own tiles
    calls.clear()
    model._attends("flex", anchors, valid, 128, torch.device("cpu"))
    assert calls == [{"compile": True, "tiles": None}] * 2

    seen = {}
    monkeypatch.setattr(drafter_model, "_compiled_flex_attention", lambda: lambda *a, **kw: seen.update(kw))
    real_flex_attend("mask", compile=True, tiles={"t": 1})(*[torch.zeros(1, 2, 4, 16)] * 3)
    assert seen["kernel_options"] == {"t": 1}

    import torch.nn.attention.flex_attention as flex_module

    eager = {}
    monkeypatch.setattr(flex_module, "flex_attention", lambda *a, **kw: eager.update(kw))
    real_flex_attend("mask", compile=False, tiles={"t": 1})(*[torch.zeros(1, 2, 4, 16)] * 3)
    assert "kernel_options" in eager and eager["kernel_options"] is None
