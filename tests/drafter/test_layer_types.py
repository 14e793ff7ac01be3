"""Sliding and full draft layers end to end: the training forward, the drafted tokens of the simulated tau,
against a reference that drafts one block at a time the way the serving engines do.

The reference holds the context keys/values of positions 0..a-1 (what an engine's draft KV cache holds when
the block at anchor a is drafted), appends the block, and attends per query with the serving rule written
plainly (docs/drafter.md): full_attention layers see the whole cache and block; sliding_attention layers see
keys at positions q - W < k <= q. RoPE comes from transformers' own Qwen3RotaryEmbedding, not ours.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half

from dflash_pipe.drafter.acceptance import acceptance, draft_tokens
from dflash_pipe.drafter.masks import sample_anchors, training_eligible

from .conftest import tiny_config, tiny_drafter

MIXED = dict(
    num_hidden_layers=3,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    sliding_window=5,
)


def _rotary(model):
    cfg = model.cfg
    hf = Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )
    rot = Qwen3RotaryEmbedding(hf)

    def rope(x, positions):  # x [L, heads, D], positions [L]
        cos, sin = rot(x, positions[None])
        return x * cos[0, :, None] + rotate_half(x) * sin[0, :, None]

    return rope


@torch.no_grad()
def reference_block(model, ids, feats, b: int, a: int, real: bool) -> torch.Tensor:
    """Final-norm hidden states [bs, H] of the block at anchor a of row b, drafted alone."""
    cfg, bs, rope = model.cfg, model.cfg.block_size, _rotary(model)
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    ctx = model.hidden_norm(model.fc(feats[b, :a] if real else feats[b, :0]))  # the draft KV cache
    x = model.embed_tokens(torch.tensor([int(ids[b, a])] + [cfg.mask_token_id] * (bs - 1)))
    q_pos = a + torch.arange(bs)
    k_pos = torch.cat([torch.arange(ctx.shape[0]), q_pos])
    for layer, kind in zip(model.layers, cfg.layer_types, strict=True):
        att = layer.self_attn
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h])
        q = rope(att.q_norm(att.q_proj(h).view(bs, hq, d)), q_pos)
        k = rope(att.k_norm(att.k_proj(kv_in).view(-1, hkv, d)), k_pos)
        v = att.v_proj(kv_in).view(-1, hkv, d)
        out = torch.zeros(bs, hq, d)
        for j in range(bs):
            seen = [
                i
                for i, kp in enumerate(k_pos.tolist())
                if (i < ctx.shape[0] or i - ctx.shape[0] <= j or kind == "full_attention")
                and (kind == "full_attention" or (kp <= q_pos[j] and q_pos[j] - kp < cfg.sliding_window))
            ]
            for head in range(hq):
                kvh = head // (hq // hkv)
                scores = k[seen, kvh] @ q[j, head] / math.sqrt(d)
                out[j, head] = torch.softmax(scores, dim=0) @ v[seen, kvh]
        x = x + att.o_proj(out.view(bs, hq * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def _batch(cfg, seq_len: int = 26, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49, (2, seq_len), generator=g)
    feats = torch.randn(2, seq_len, cfg.feature_size, generator=g)
    loss_mask = torch.ones(2, seq_len, dtype=torch.bool)
    loss_mask[1, 20:] = False
    anchors, valid = sample_anchors(
        training_eligible(loss_mask), 5, generator=torch.Generator().manual_seed(3)
    )
    return ids, feats, loss_mask, anchors, valid


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_mixed_layers_match_one_block_at_a_time_reference(backend) -> None:
    model = tiny_drafter(tiny_config(attention_backend=backend, **MIXED))
    ids, feats, _, anchors, valid = _batch(model.cfg)
    assert anchors.max() > MIXED["sliding_window"]  # the window is shorter than the context it could see
    with torch.no_grad():
        got = model.block_hidden(ids, feats, anchors, valid)  # [B, N, bs, H]
    for b in range(2):
        for n in range(anchors.shape[1]):
            ref = reference_block(model, ids, feats, b, int(anchors[b, n]), bool(valid[b, n]))
            torch.testing.assert_close(got[b, n], ref, atol=2e-5, rtol=1e-4)


def test_sliding_window_changes_the_drafted_block_and_tau() -> None:
    """Same weights, sliding vs full: the outputs differ (the window cuts context), and the simulated tau's
    drafted tokens are exactly the reference's argmax, for the layer types training used."""
    mixed = tiny_drafter(tiny_config(attention_backend="sdpa", **MIXED))
    full_cfg = dataclasses.replace(mixed.cfg, layer_types=None, sliding_window=None)
    full = tiny_drafter(full_cfg)
    full.load_state_dict(mixed.state_dict())
    full._target_parts = mixed._target_parts
    ids, feats, loss_mask, anchors, valid = _batch(mixed.cfg)
    with torch.no_grad():
        h_mixed = mixed.block_hidden(ids, feats, anchors, valid)
        h_full = full.block_hidden(ids, feats, anchors, valid)
    assert (h_mixed - h_full).abs().max() > 1e-3
    drafted = draft_tokens(mixed, ids, feats, anchors, valid)  # what acceptance() scores
    for b in range(2):
        for n in range(anchors.shape[1]):
            if valid[b, n]:
                ref = reference_block(mixed, ids, feats, b, int(anchors[b, n]), True)
                assert drafted[b, n].tolist() == mixed.lm_head(ref[1:]).argmax(-1).tolist()
    target_next = torch.roll(ids, -1, dims=1)
    counts = [
        acceptance(
            m, ids, feats, loss_mask, target_next, num_anchors=8, generator=torch.Generator().manual_seed(0)
        )
        for m in (mixed, full)
    ]
    assert counts[0].anchors == counts[1].anchors > 0  # same anchors, each model drafts with its own types
