"""Packed layout: one row, position ids restarting per sample, no attention across sample boundaries."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.target import TargetCore, packing
from dflash_pipe.target.packing import PackedLayout, plain_causal
from tests.target.inputs import packed_batch
from tests.tiny_models import tiny_qwen3_config

LENGTHS = [9, 1, 14, 6]
LAYERS = (0, 2, 4)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_packed_equals_padded(model_dir, attention):
    ids = packed_batch(LENGTHS, seed=5)
    padded = TargetCore(model_dir, LAYERS, "cpu", torch.float32, packing="padded").features(ids, LENGTHS)
    packed = TargetCore(model_dir, LAYERS, "cpu", torch.float32, attention=attention).features(ids, LENGTHS)
    assert (packed - padded).abs().max().item() <= 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_no_attention_across_samples(model_dir, attention):
    core = TargetCore(model_dir, LAYERS, "cpu", torch.float32, attention=attention)
    ids = packed_batch(LENGTHS, seed=6)
    changed = ids.clone()
    changed[: LENGTHS[0]] = (changed[: LENGTHS[0]] + 1) % 97  # sample A (the first) gets other tokens
    before = core.features(ids, LENGTHS).split(LENGTHS)
    after = core.features(changed, LENGTHS).split(LENGTHS)
    assert (before[0] - after[0]).abs().max().item() > 1e-3  # A's features do depend on A's tokens
    for b, a in zip(before[1:], after[1:], strict=True):  # every later sample is untouched by A
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_position_ids_restart_per_sample():
    layout = PackedLayout.build(torch.arange(6), [2, 3, 1], torch.device("cpu"), "sdpa", compile=False)
    assert layout.input_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert layout.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert layout.attention_mask is None  # sdpa: transformers builds the block-diagonal mask itself


def test_flex_block_mask_is_block_diagonal_causal():
    layout = PackedLayout.build(torch.arange(5), [2, 3], torch.device("cpu"), "flex", compile=False)
    dense = layout.attention_mask.to_dense()  # [1, 1, q blocks, kv blocks]: one 128-tile here
    assert dense.shape[-2:] == (1, 1) and int(dense.sum()) == 1
    q = torch.arange(5)
    sample = torch.tensor([0, 0, 1, 1, 1])
    want = (q[None, :] <= q[:, None]) & (sample[:, None] == sample[None, :])
    got = layout.attention_mask.mask_mod(0, 0, q[:, None], q[None, :])
    assert torch.equal(got, want)


def test_single_sample_is_plain_causal(model_dir):
    """One sample in the row: HF sees no restart and runs ordinary causal attention."""
    ids = packed_batch([12], seed=7)
    padded = TargetCore(model_dir, LAYERS, "cpu", torch.float32, packing="padded").features(ids, [12])
    packed = TargetCore(model_dir, LAYERS, "cpu", torch.float32).features(ids, [12])
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_attention_choice(qwen3_dir):
    assert TargetCore(qwen3_dir, [0], "cpu", torch.float32).attention == "sdpa"  # CPU default
    with pytest.raises(ValueError, match='needs packing="packed"'):
        TargetCore(qwen3_dir, [0], "cpu", torch.float32, packing="padded", attention="flex")
    with pytest.raises(ValueError, match="packing must be"):
        TargetCore(qwen3_dir, [0], "cpu", torch.float32, packing="ragged")  # type: ignore[arg-type]
    assert plain_causal(tiny_qwen3_config())
    assert not plain_causal(tiny_qwen3_config(use_sliding_window=True, sliding_window=8, max_window_layers=0))


def test_flex_needs_head_dim_16_on_cuda():
    """Inductor's flex kernels refuse head_dim < 16: the automatic choice is then SDPA, and asking for flex
    on CUDA is an error that says so (the choice needs no GPU)."""
    from dflash_pipe.target.core import _pick_attention

    cuda = torch.device("cuda")
    small, ok = tiny_qwen3_config(head_dim=8), tiny_qwen3_config(head_dim=16)
    assert _pick_attention("packed", None, ok, cuda) == "flex"
    assert _pick_attention("packed", None, small, cuda) == "sdpa"
    with pytest.raises(ValueError, match="head_dim >= 16"):
        _pick_attention("packed", "flex", small, cuda)
    assert _pick_attention("packed", "flex", small, torch.device("cpu")) == "flex"  # eager flex is fine
    assert _pick_attention("packed", None, ok, cuda, split=True) == "sdpa"  # the mask lives on one device
    with pytest.raises(ValueError, match="split across devices"):
        _pick_attention("packed", "flex", ok, cuda, split=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_on_cuda_matches_padded_across_shapes(model_dir):
    """Compiled flex (dynamic shapes) against the padded reference for several batch shapes in a row."""
    flex = TargetCore(model_dir, LAYERS, "cuda", torch.float32)
    ref = TargetCore(model_dir, LAYERS, "cuda", torch.float32, packing="padded")
    assert flex.attention == "flex"
    for seed, lengths in enumerate([LENGTHS, [200, 3, 77], [129], [64] * 5]):
        ids = packed_batch(lengths, seed=seed)
        torch.testing.assert_close(
            flex.features(ids, lengths), ref.features(ids, lengths), rtol=1e-4, atol=1e-4
        )


@pytest.mark.slow
def test_compiled_block_mask_equals_the_eager_one():
    """compile=True goes through the compile lock with the device keyword (runs Inductor on CPU here)."""
    ids = torch.arange(300)
    eager = PackedLayout.build(ids, [100, 150, 50], torch.device("cpu"), "flex", compile=False)
    compiled = PackedLayout.build(ids, [100, 150, 50], torch.device("cpu"), "flex", compile=True)
    assert torch.equal(compiled.attention_mask.to_dense(), eager.attention_mask.to_dense())


def test_first_compiled_call_per_length_class_holds_the_compile_lock(monkeypatch):
    """Target replicas are threads: each first call (which compiles) must be serialised, later ones not."""
    held = []

    def fake(*_args, **_kwargs):
        held.append(packing._COMPILE_LOCK.locked())

    monkeypatch.setattr(packing, "_compiled", lambda _name: fake)
    monkeypatch.setattr(packing, "_compiled_for", set())
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    for length, device in [(300, cuda0), (500, cuda0), (300, cuda1), (64, cuda0), (1, cuda0), (70, cuda0)]:
        packing.call_compiled("flex_attention", length, device)
    assert held == [True, False, True, True, True, False]


@pytest.mark.slow
def test_compiled_layers_give_the_eager_features(qwen3_dir):
    """compile_layers runs every decoder layer through one compiled function (Inductor on CPU here): the
    same features as eager layers, across batch shapes, with the forward still stopped by the hooks."""
    eager = TargetCore(qwen3_dir, (0, 2), "cpu", torch.float32, compile_layers=False)
    compiled = TargetCore(qwen3_dir, (0, 2), "cpu", torch.float32, compile_layers=True)
    assert compiled.compile_layers and not eager.compile_layers
    for seed, lengths in enumerate([LENGTHS, [40, 7]]):
        ids = packed_batch(lengths, seed=seed)
        torch.testing.assert_close(
            compiled.features(ids, lengths), eager.features(ids, lengths), rtol=1e-5, atol=1e-5
        )
    assert compiled.layers_compiled


def test_a_failing_layer_compile_falls_back_to_eager_layers(qwen3_dir, monkeypatch, caplog):
    """An Inductor failure must not end the run: one warning, then eager layers with the same features."""
    from torch._inductor.exc import InductorError

    from dflash_pipe.target import core

    calls = []

    def failing(layer, *args, **kwargs):
        calls.append(layer)
        raise InductorError(RuntimeError("simulated Inductor bug"), None)

    monkeypatch.setattr(core, "compiled_layer_forward", failing)
    eager = TargetCore(qwen3_dir, LAYERS, "cpu", torch.float32, compile_layers=False)
    broken = TargetCore(qwen3_dir, LAYERS, "cpu", torch.float32, compile_layers=True)
    ids = packed_batch(LENGTHS, seed=1)
    with caplog.at_level("WARNING", logger="dflash_pipe.target"):
        for _ in range(2):
            torch.testing.assert_close(broken.features(ids, LENGTHS), eager.features(ids, LENGTHS))
    assert len(calls) == 1 and not broken.layers_compiled
    assert [r.message for r in caplog.records if "simulated Inductor bug" in r.message]
    assert TargetCore(qwen3_dir, LAYERS, "cpu", torch.float32).compile_layers is False  # None: CUDA only


@pytest.mark.slow
def test_compiled_flex_rows_are_padded_to_whole_tiles():
    """Compiled flex gets whole 128-token tiles (torch 2.11's compiled layers were wrong on partial ones):
    the padding is its own sample, position ids restart in it, and pack() returns the real tokens only."""
    ids = torch.arange(1, 301)
    layout = PackedLayout.build(ids, [100, 150, 50], torch.device("cpu"), "flex", compile=True)
    assert layout.input_ids.shape == (1, 384) and layout.total == 300
    assert torch.equal(layout.input_ids[0, :300], ids) and not layout.input_ids[0, 300:].any()
    assert torch.equal(layout.position_ids[0, 300:], torch.arange(84))
    mask_mod, t = layout.attention_mask.mask_mod, torch.tensor
    assert mask_mod(0, 0, t(320), t(310)) and mask_mod(0, 0, t(299), t(250))  # within the padding / a sample
    assert not mask_mod(0, 0, t(320), t(299)) and not mask_mod(0, 0, t(299), t(320))  # never across them
    assert torch.equal(layout.pack(torch.zeros(1, 384, 3)), torch.zeros(300, 3))
    sdpa = PackedLayout.build(ids, [100, 150, 50], torch.device("cpu"), "sdpa", compile=False)
    assert sdpa.input_ids.shape == (1, 300)  # only compiled flex pads
