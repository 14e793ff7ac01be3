"""Sliding-attention layers: dense mask, flex mask_mod and the flex BlockMask against a brute-force reference.

The reference is the serving rule written plainly, per (query, key) pair: query slot j of a block sits at
position a + j; a full_attention layer sees context positions p < a and its whole block; a
sliding_attention layer with window W sees a key at position k only if k <= q and q - k < W (the window
counts the query itself: vLLM's flash-attn window (W-1, 0), SGLang's window_left W-1, the reference's
`query_position - key_position < sliding_window`), context still limited to p < a (docs/drafter.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_pipe.drafter.masks import dense_mask, flex_block_mask, key_block_table, make_mask_mod

from .test_masks import eval_mask_mod, random_anchors


def brute_force(
    anchors: list[list[int]], valid: list[list[bool]], seq_len: int, bs: int, window: int | None
) -> torch.Tensor:
    bsz, n = len(anchors), len(anchors[0])
    out = torch.zeros(bsz, 1, n * bs, seq_len + n * bs, dtype=torch.bool)
    for b in range(bsz):
        for qi in range(n * bs):
            blk, j = divmod(qi, bs)
            a = anchors[b][blk]
            q_pos = a + j
            for ki in range(seq_len + n * bs):
                if ki < seq_len:  # context key at position ki
                    k_pos, allowed = ki, valid[b][blk] and ki < a
                else:  # block key: slot j2 of block blk2, at position anchor[blk2] + j2
                    blk2, j2 = divmod(ki - seq_len, bs)
                    k_pos, allowed = anchors[b][blk2] + j2, blk2 == blk
                if window is not None:  # sliding_attention: causal, at most `window` keys back
                    allowed = allowed and k_pos <= q_pos and q_pos - k_pos < window
                out[b, 0, qi, ki] = allowed
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 4, 7, 100])
def test_dense_and_mask_mod_match_brute_force(window) -> None:
    bs, seq_len = 4, 23
    for seed in range(3):
        anchors, valid = random_anchors(seed, seq_len=seq_len)
        ref = brute_force(anchors.tolist(), valid.tolist(), seq_len, bs, window)
        assert torch.equal(dense_mask(anchors, valid, seq_len, bs, window), ref)
        n = anchors.shape[1]
        mod = make_mask_mod(anchors, valid, key_block_table(seq_len, n, bs, anchors.device), bs, window)
        assert torch.equal(eval_mask_mod(mod, 2, n * bs, seq_len + n * bs), ref)
        if window is not None:  # padded flex rows past N*bs must not index out of range
            eval_mask_mod(mod, 2, 128, 256)


def test_sliding_window_shape_on_one_block() -> None:
    """Anchor 10, window 4, bs 4: slot j sees context 10+j-3 .. 9 and slots 0..j of its own block."""
    m = dense_mask(torch.tensor([[10]]), torch.tensor([[True]]), 12, 4, window=4)[0, 0]  # [4, 16]
    assert m[0, :12].nonzero().flatten().tolist() == [7, 8, 9]
    assert m[3, :12].nonzero().flatten().tolist() == []  # 13 - 3 = 10 = the anchor: no context left
    assert m[:, 12:].tolist() == [[j2 <= j for j2 in range(4)] for j in range(4)]  # causal in block
    full = dense_mask(torch.tensor([[10]]), torch.tensor([[True]]), 12, 4)[0, 0]
    assert full[:, :10].all() and full[:, 12:].all()  # full_attention: all context < anchor, bidirectional


@pytest.mark.parametrize("window", [None, 40])
def test_flex_block_mask_attention_equals_sdpa_dense(window) -> None:
    """The BlockMask's block sparsity (whole 128-tiles skipped) must not drop a visible key: flex attention
    with it equals SDPA with the dense mask, at a context long enough for the window to skip tiles."""
    bs, seq_len, n = 4, 300, 64
    g = torch.Generator().manual_seed(0)
    anchors = torch.randint(0, seq_len - 1, (2, n), generator=g).sort(dim=1).values
    valid = torch.rand(2, n, generator=g) > 0.2
    mask = dense_mask(anchors, valid, seq_len, bs, window)
    q = torch.randn(2, 2, n * bs, 16, generator=g)
    k, v = (
        torch.randn(2, 2, seq_len + n * bs, 16, generator=g),
        torch.randn(2, 2, seq_len + n * bs, 16, generator=g),
    )
    from torch.nn.attention.flex_attention import flex_attention

    bm = flex_block_mask(anchors, valid, seq_len, bs, compile=False, window=window)
    if window is not None:
        assert (bm.kv_num_blocks < bm.kv_num_blocks.new_full((), -(-(seq_len + n * bs) // 128))).any()
    out_flex = flex_attention(q, k, v, block_mask=bm)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)
