"""bench/drafter_step.count_flops, the MFU numerator of the drafter benches: attention over the visible
pairs only, a sliding layer's over its window, against pairs counted by hand from DFlash's mask rule."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from dflash_pipe.drafter import DrafterConfig
from tests.bench.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from drafter_step import count_flops  # noqa: E402

S, BS, WINDOW, HEADS, HEAD_DIM = 40, 4, 8, 4, 16


def _flops(layer_types: tuple[str, ...]) -> dict:
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=WINDOW if "sliding_attention" in layer_types else None,
        vocab_size=100,
        block_size=BS,
        mask_token_id=99,
        target_layer_ids=(1, 2),
        num_target_layers=4,
        max_anchors=64,  # more than the S - 1 eligible positions: every one is an anchor
    )
    ids, mask = torch.zeros(1, S, dtype=torch.long), torch.ones(1, S, dtype=torch.bool)
    return count_flops(SimpleNamespace(cfg=cfg), (ids, None, mask))


def _pairs_by_hand(window: int | None) -> int:
    """Block slot j of the anchor at a (position a + j) sees context keys k < a, within the window when
    sliding (a + j - k < W), and the slots j' of its own block (all of them; sliding: 0 <= j - j' < W)."""
    pairs = 0
    for a in range(S - 1):  # every eligible anchor
        for j in range(BS):
            pairs += sum(1 for k in range(a) if window is None or a + j - k < window)
            pairs += sum(1 for jj in range(BS) if window is None or 0 <= j - jj < window)
    return pairs


def test_attention_counts_the_visible_pairs_of_each_layer_pattern() -> None:
    full = _flops(("full_attention",) * 2)
    mixed = _flops(("sliding_attention", "full_attention"))
    assert full["attention_pairs_visible"] == _pairs_by_hand(None)
    per_pair = 3 * 2 * 2 * HEADS * HEAD_DIM  # QK^T and PV, x3: forward and the two backward matmuls
    assert full["train_step"] - mixed["train_step"] == per_pair * (
        _pairs_by_hand(None) - _pairs_by_hand(WINDOW)
    )
    assert _pairs_by_hand(WINDOW) < _pairs_by_hand(None)
