"""Anchor sampling and the DFlash training attention mask (dense boolean for SDPA, mask_mod for flex).

Layout: keys = [context 0..S-1 | block 0 (bs keys) | block 1 | ...], queries = the N*bs block tokens.
Query slot j of block b sits at position anchor[b] + j. What it sees depends on the layer type, exactly as
vLLM, SGLang and the reference run that type at serving time (docs/drafter.md has the sources):

- ``full_attention`` (window None): context keys at positions strictly before anchor[b] (only when the
  anchor slot is real) and every key of its own block (bidirectional).
- ``sliding_attention`` (window W): the same, further limited to keys at positions p with
  (anchor[b] + j) - p < W (the window includes the query itself), and causal inside the block: slot j sees
  slots j' <= j of its own block.

Padded anchor slots see only their own block (at least the query itself), so no row is ever fully masked
(a fully masked row is NaN in SDPA).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

FLEX_BLOCK = 128  # flex_attention's default tile; shapes are padded to multiples of it


def sample_anchors(
    eligible: Tensor, max_anchors: int, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Up to max_anchors positions per row, uniformly without replacement among eligible ones.

    eligible [B, P] bool. Returns anchors [B, N] int64 (sorted per row, padded slots = 0) and
    valid [B, N] bool, with N = max(1, min(max_anchors, max eligible count)). N >= 1 keeps the graph
    connected (every parameter gets a gradient) even for a batch with nothing to train on.
    """
    bsz, width = eligible.shape
    gen_device = generator.device if generator is not None else eligible.device
    scores = torch.rand((bsz, width), generator=generator, device=gen_device).to(eligible.device)
    scores = torch.where(eligible, scores, torch.full_like(scores, -1.0))  # [B, P]
    count = int(eligible.sum(dim=1).max().item()) if width else 0
    n = max(1, min(max_anchors, count))
    if width == 0:
        zeros = torch.zeros((bsz, n), dtype=torch.long, device=eligible.device)
        return zeros, zeros.bool()
    k = min(n, width)
    top, idx = scores.topk(k, dim=1)  # [B, k]
    valid = top >= 0
    idx = torch.where(valid, idx, torch.full_like(idx, width))  # push padding to the end when sorting
    idx, order = idx.sort(dim=1)
    valid = valid.gather(1, order)
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    if k < n:
        pad = n - k
        idx = torch.cat([idx, idx.new_zeros((bsz, pad))], dim=1)
        valid = torch.cat([valid, valid.new_zeros((bsz, pad))], dim=1)
    return idx, valid


def training_eligible(loss_mask: Tensor) -> Tensor:
    """Anchor candidates for training: p with loss_mask[p] and loss_mask[p+1] (so p+1 < S). [B, S-1]"""
    return loss_mask[:, :-1] & loss_mask[:, 1:]


def anchor_pad_multiple(block_size: int) -> int:
    """Anchor-count multiple that makes N*bs a multiple of the 128-row flex tile."""
    return FLEX_BLOCK // math.gcd(FLEX_BLOCK, block_size)


def pad_anchors(anchors: Tensor, valid: Tensor, multiple: int) -> tuple[Tensor, Tensor]:
    """Pad the anchor axis to a multiple (disabled slots), so shapes repeat across steps."""
    n = anchors.shape[1]
    target = -(-n // multiple) * multiple
    if target == n:
        return anchors, valid
    pad = target - n
    return (
        torch.cat([anchors, anchors.new_zeros((anchors.shape[0], pad))], dim=1),
        torch.cat([valid, valid.new_zeros((valid.shape[0], pad))], dim=1),
    )


def key_block_table(seq_len: int, num_anchors: int, block_size: int, device: torch.device) -> Tensor:
    """[S + N*bs] int64: -1 for context keys, the block index for block keys."""
    ctx = torch.full((seq_len,), -1, dtype=torch.long, device=device)
    blocks = torch.arange(num_anchors * block_size, device=device) // block_size
    return torch.cat([ctx, blocks])


def make_mask_mod(
    anchors: Tensor, valid: Tensor, kv_block: Tensor, block_size: int, window: int | None = None
) -> Callable:
    """flex_attention mask_mod for the DFlash training layout; ``window`` None = a full-attention layer,
    an int W = a sliding-attention layer (see the module docstring).

    anchors/valid [B, N]; kv_block [K] from key_block_table. The query's anchor index q // bs is clamped
    to N-1 because flex evaluates padded query rows past N*bs. Context keys (kv_block == -1) satisfy
    kv < anchor only when they precede the anchor; block keys sit at kv >= S > anchor, so the `<` test
    never admits another block. Sizes are read from tensor shapes (not Python ints) so one compiled
    create_block_mask serves every S and N.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        qa = torch.clamp(q_idx // block_size, max=anchors.shape[1] - 1)
        kv = torch.clamp(kv_idx, max=kv_block.shape[0] - 1)
        anchor = anchors[b, qa]
        sees_context = (kv_idx < anchor) & valid[b, qa]
        own_block = kv_block[kv] == qa
        if window is not None:
            q_off = q_idx % block_size
            kv_off = (kv_idx - (kv_block.shape[0] - anchors.shape[1] * block_size)) % block_size
            sees_context = sees_context & (anchor + q_off - kv_idx < window)
            own_block = own_block & (kv_off <= q_off) & (q_off - kv_off < window)
        return sees_context | own_block

    return mask_mod


def dense_mask(
    anchors: Tensor, valid: Tensor, seq_len: int, block_size: int, window: int | None = None
) -> Tensor:
    """The same mask as a dense boolean tensor [B, 1, N*bs, S + N*bs] for SDPA (True = attend)."""
    bsz, n = anchors.shape
    device = anchors.device
    q_idx = torch.arange(n * block_size, device=device)
    q_block, q_off = q_idx // block_size, q_idx % block_size  # [Q]
    kv_pos = torch.arange(seq_len, device=device)  # [S]
    q_anchor = anchors[:, q_block]  # [B, Q]
    q_valid = valid[:, q_block]  # [B, Q]
    ctx = (kv_pos[None, None, :] < q_anchor[:, :, None]) & q_valid[:, :, None]  # [B, Q, S]
    own = q_block[:, None] == q_block[None, :]  # [Q, Q]
    if window is not None:
        q_pos = q_anchor + q_off  # [B, Q]
        ctx = ctx & (q_pos[:, :, None] - kv_pos[None, None, :] < window)
        lag = q_off[:, None] - q_off[None, :]  # [Q, Q]: j - j'
        own = own & (lag >= 0) & (lag < window)
    return torch.cat([ctx, own.expand(bsz, -1, -1)], dim=2)[:, None]  # [B, 1, Q, S+Q]


@functools.cache
def _compiled_create_block_mask() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=True)


def flex_block_mask(
    anchors: Tensor, valid: Tensor, seq_len: int, block_size: int, *, compile: bool, window: int | None = None
):
    """BlockMask for flex_attention: B = batch, H = None (one mask shared by all heads; H=num_heads
    multiplies the mask's memory by the head count). Compiled, so the full Q x K grid is never
    materialised; dynamic=True so new S / N values reuse the compiled graph instead of recompiling."""
    from torch.nn.attention.flex_attention import create_block_mask

    kv_block = key_block_table(seq_len, anchors.shape[1], block_size, anchors.device)
    mask_mod = make_mask_mod(anchors, valid, kv_block, block_size, window)
    q_len = anchors.shape[1] * block_size
    kv_len = seq_len + q_len
    fn = _compiled_create_block_mask() if compile else create_block_mask
    return fn(mask_mod, anchors.shape[0], None, q_len, kv_len, device=anchors.device)
