"""The training mask, three ways (dense, flex mask_mod, flex BlockMask) vs a Python-loop reference."""

from __future__ import annotations

import torch

from dflash_pipe.drafter.masks import (
    dense_mask,
    flex_block_mask,
    key_block_table,
    make_mask_mod,
    pad_anchors,
    sample_anchors,
    training_eligible,
)


def loop_reference(anchors: list[list[int]], valid: list[list[bool]], seq_len: int, bs: int) -> torch.Tensor:
    """Written from the rule: block b sees context < anchor[b] (if real) and all of its own block."""
    bsz, n = len(anchors), len(anchors[0])
    out = torch.zeros(bsz, 1, n * bs, seq_len + n * bs, dtype=torch.bool)
    for b in range(bsz):
        for q in range(n * bs):
            blk = q // bs
            for kv in range(seq_len + n * bs):
                if kv < seq_len:
                    out[b, 0, q, kv] = valid[b][blk] and kv < anchors[b][blk]
                else:
                    out[b, 0, q, kv] = (kv - seq_len) // bs == blk
    return out


def random_anchors(seed: int, bsz: int = 2, seq_len: int = 23, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, seq_len - 1, (bsz, n), generator=g)
    valid = torch.rand(bsz, n, generator=g) > 0.3
    valid[:, -1] = False  # always at least one padded slot
    return anchors, valid


def eval_mask_mod(mask_mod, bsz: int, q_len: int, kv_len: int) -> torch.Tensor:
    b = torch.arange(bsz)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(q_len)[None, None, :, None]
    kv = torch.arange(kv_len)[None, None, None, :]
    return mask_mod(b, h, q, kv)


def test_dense_and_mask_mod_match_loop_reference() -> None:
    bs, seq_len = 3, 23
    for seed in range(4):
        anchors, valid = random_anchors(seed, seq_len=seq_len)
        ref = loop_reference(anchors.tolist(), valid.tolist(), seq_len, bs)
        assert torch.equal(dense_mask(anchors, valid, seq_len, bs), ref)
        kv_block = key_block_table(seq_len, anchors.shape[1], bs, anchors.device)
        mod = make_mask_mod(anchors, valid, kv_block, bs)
        assert torch.equal(eval_mask_mod(mod, 2, anchors.shape[1] * bs, seq_len + anchors.shape[1] * bs), ref)


def test_anchor_itself_is_not_visible_and_block_is_bidirectional() -> None:
    bs, seq_len = 4, 10
    anchors, valid = torch.tensor([[5]]), torch.tensor([[True]])
    m = dense_mask(anchors, valid, seq_len, bs)[0, 0]  # [4, 14]
    assert m[:, :5].all() and not m[:, 5:seq_len].any()  # `<` anchor, not `<=`
    assert m[:, seq_len:].all()  # every slot sees every slot of its block (slot 0 sees slot 3)


def test_padded_query_rows_are_clamped() -> None:
    """flex evaluates query rows past N*bs; the anchor lookup must clamp, not index out of range."""
    bs, seq_len = 3, 11
    anchors, valid = random_anchors(7, seq_len=seq_len, n=3)
    kv_block = key_block_table(seq_len, 3, bs, anchors.device)
    mod = make_mask_mod(anchors, valid, kv_block, bs)
    full = eval_mask_mod(mod, 2, 128, 128)  # beyond Q = 9 and K = 20: must not raise
    ref = loop_reference(anchors.tolist(), valid.tolist(), seq_len, bs)
    assert torch.equal(full[:, :, :9, :20], ref)


def test_padded_anchor_slots_see_only_their_block() -> None:
    anchors, valid = pad_anchors(torch.tensor([[4, 7]]), torch.tensor([[True, True]]), 8)
    assert anchors.shape == (1, 8) and valid.tolist() == [[True, True] + [False] * 6]
    m = dense_mask(anchors, valid, 12, 2)[0, 0]
    assert not m[4:, :12].any()  # padded slots: no context
    assert m.any(dim=1).all()  # no fully masked row (SDPA would return NaN)


def test_flex_block_mask_equals_dense() -> None:
    bs, seq_len = 4, 20
    anchors, valid = random_anchors(3, seq_len=seq_len, n=6)
    bm = flex_block_mask(anchors, valid, seq_len, bs, compile=False)
    assert bm.shape[1] == 1  # H=None: one mask for all heads
    dense_from_flex = eval_mask_mod(bm.mask_mod, 2, 6 * bs, seq_len + 6 * bs)
    assert torch.equal(dense_from_flex, dense_mask(anchors, valid, seq_len, bs))


def test_anchor_sampling_respects_eligibility_and_cap() -> None:
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(3, 40, generator=g) > 0.4
    loss_mask[2] = False
    loss_mask[2, 10:13] = True  # exactly two eligible anchors: 10, 11
    for cap in (1, 5, 100):
        anchors, valid = sample_anchors(training_eligible(loss_mask), cap, generator=g)
        assert anchors.shape[1] <= max(cap, 1)
        for b in range(3):
            got = anchors[b][valid[b]].tolist()
            assert len(got) == len(set(got))
            assert all(loss_mask[b, p] and loss_mask[b, p + 1] and p + 1 < 40 for p in got)
            eligible = int((loss_mask[b, :-1] & loss_mask[b, 1:]).sum())
            assert len(got) == min(cap, eligible)
    anchors, valid = sample_anchors(training_eligible(loss_mask[2:]), 100, generator=g)
    assert sorted(anchors[0][valid[0]].tolist()) == [10, 11]


def test_no_eligible_anchor_gives_one_disabled_slot() -> None:
    anchors, valid = sample_anchors(training_eligible(torch.zeros(2, 9, dtype=torch.bool)), 4)
    assert anchors.shape == (2, 1) and not valid.any()
