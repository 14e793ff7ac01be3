"""Labels, positions, slot weights and the chunked LM-head CE against independent references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_pipe.drafter.loss import (
    _eager_grad_terms,
    _grad_terms,
    build_block_targets,
    chunked_lm_head_ce,
)
from dflash_pipe.drafter.masks import sample_anchors, training_eligible

from .conftest import tiny_config, tiny_drafter


def test_block_targets_match_loop_reference() -> None:
    bs, gamma, mask_id, seq_len = 4, 1.5, 99, 12
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, seq_len), generator=g)
    loss_mask = torch.rand(2, seq_len, generator=g) > 0.3
    anchors = torch.tensor([[0, 9, 3], [10, 2, 0]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    t = build_block_targets(ids, loss_mask, anchors, valid, block_size=bs, mask_token_id=mask_id, gamma=gamma)
    for b in range(2):
        for n in range(3):
            a = int(anchors[b, n])
            assert t.block_ids[b, n].tolist() == [int(ids[b, a])] + [mask_id] * (bs - 1)
            assert t.positions[b, n].tolist() == [a + k for k in range(bs)]
            for k in range(bs):
                scored = bool(valid[b, n]) and k >= 1 and a + k < seq_len and bool(loss_mask[b, a + k])
                want = math.exp(-(k - 1) / gamma) if scored else 0.0
                assert abs(float(t.weights[b, n, k]) - want) < 1e-6, (b, n, k)
                if scored:
                    assert int(t.labels[b, n, k]) == int(ids[b, a + k])  # slot k -> token anchor+k


def test_chunked_ce_equals_unchunked_values_and_grads() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(29, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 29, (37,), generator=g)
    weights = torch.rand(37, generator=g, dtype=torch.float64)
    loss, correct = chunked_lm_head_ce(h, w, labels, weights.float(), chunk=8)
    (gh,) = torch.autograd.grad(loss, h)
    logits = h @ w.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights.float()).sum()
    (gref,) = torch.autograd.grad(ref, h)
    assert torch.allclose(loss.double(), ref.double(), atol=1e-5)
    assert torch.allclose(gh, gref, atol=1e-5)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_drafter_loss_equals_full_logits_reference() -> None:
    cfg = tiny_config(block_size=4, max_anchors=5)
    model = tiny_drafter(cfg)
    model.ce_chunk = 7  # force several chunks
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 49, (2, 16), generator=g)
    feats = torch.randn(2, 16, cfg.feature_size, generator=g)
    loss_mask = torch.rand(2, 16, generator=g) > 0.25
    loss_mask[1, 12:] = False  # padding
    out = model(ids, feats, loss_mask, generator=torch.Generator().manual_seed(9))
    # independent recomputation with the same anchors
    anchors, valid = sample_anchors(
        training_eligible(loss_mask), 5, generator=torch.Generator().manual_seed(9)
    )
    hidden = model.block_hidden(ids, feats, anchors, valid)
    logits = model.lm_head(hidden).float().detach()  # [B, N, bs, V]
    loss_sum = weight_sum = 0.0
    slot_total = torch.zeros(4)
    for b in range(2):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            for k in range(1, 4):
                if valid[b, n] and a + k < 16 and loss_mask[b, a + k]:
                    w = math.exp(-(k - 1) / cfg.gamma)
                    loss_sum += w * float(F.cross_entropy(logits[b, n, k][None], ids[b, a + k][None]))
                    weight_sum += w
                    slot_total[k] += 1
    assert out.slot_total[0] == 0 and out.slot_correct[0] == 0  # slot 0 is never scored
    assert torch.equal(out.slot_total, slot_total)
    assert abs(float(out.weight_sum) - weight_sum) < 1e-5
    assert abs(float(out.loss_sum.detach()) - loss_sum) < 1e-4
    assert out.num_anchors == int(valid.sum())
    out.loss.backward()
    assert all(p.grad is not None for p in model.trainable_parameters())


def test_loss_masked_tokens_never_scored() -> None:
    cfg = tiny_config(block_size=4, max_anchors=50)
    model = tiny_drafter(cfg)
    ids = torch.randint(0, 49, (1, 20))
    loss_mask = torch.zeros(1, 20, dtype=torch.bool)
    loss_mask[0, 5:8] = True  # anchors 5, 6; labels only at 6, 7
    out = model(ids, torch.randn(1, 20, cfg.feature_size), loss_mask)
    assert out.num_anchors == 2
    assert out.slot_total.tolist() == [0.0, 2.0, 1.0, 0.0]  # 5->6,7 ; 6->7


def test_frozen_target_parts() -> None:
    model = tiny_drafter()
    assert not model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    trainable = {id(p) for p in model.trainable_parameters()}
    assert id(model.embed_tokens.weight) not in trainable and id(model.lm_head.weight) not in trainable
    assert not any("embed" in k or "lm_head" in k for k in model.state_dict())


def test_chunked_ce_gradient_scales_with_the_upstream_gradient() -> None:
    g = torch.Generator().manual_seed(4)
    h = torch.randn(21, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 13, (21,), generator=g)
    weights = torch.rand(21, generator=g, dtype=torch.float64)
    weights[::3] = 0.0  # unscored rows get no gradient
    loss, _ = chunked_lm_head_ce(h, w, labels, weights, chunk=5)
    (gh,) = torch.autograd.grad(loss * -2.5, h)
    ref = (F.cross_entropy(h @ w.T, labels, reduction="none") * weights).sum() * -2.5
    (gref,) = torch.autograd.grad(ref, h)
    assert torch.allclose(gh, gref, atol=1e-5)  # logits are computed in fp32 by design
    assert torch.all(gh[::3] == 0)


def test_chunked_ce_refuses_a_trainable_head() -> None:
    h = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="frozen"):
        chunked_lm_head_ce(
            h, torch.randn(5, 8, requires_grad=True), torch.zeros(4, dtype=torch.long), torch.ones(4)
        )


def _logits_case(rows: int = 37, vocab: int = 300) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g) * 4
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(rows, generator=g) * (torch.rand(rows, generator=g) > 0.2)
    return logits, labels, weights


def test_functional_grad_terms_equal_the_in_place_ones_and_autograd() -> None:
    """The formula Inductor fuses on CUDA gives the eager path's loss, hits and d(loss)/d(logits)."""
    logits, labels, weights = _logits_case()
    loss_f, hit_f, grad_f = _grad_terms(logits, labels, weights)
    loss_e, hit_e, grad_e = _eager_grad_terms(logits.clone(), labels, weights)
    leaf = logits.clone().requires_grad_(True)
    ref = (F.cross_entropy(leaf, labels, reduction="none") * weights).sum()
    ref.backward()
    torch.testing.assert_close(loss_f, ref.detach())
    torch.testing.assert_close(loss_e, ref.detach())
    assert torch.equal(hit_f, hit_e) and torch.equal(hit_f, logits.argmax(-1) == labels)
    torch.testing.assert_close(grad_f, leaf.grad)
    torch.testing.assert_close(grad_e, leaf.grad)


def test_compiled_grad_terms_match_eager_with_changing_row_counts() -> None:
    """The compiled kernel (dynamic shapes: the last chunk is shorter) equals the eager formula."""
    compiled = torch.compile(_grad_terms, dynamic=True)
    for rows in (37, 20):
        logits, labels, weights = _logits_case(rows)
        for got, want in zip(
            compiled(logits, labels, weights), _grad_terms(logits, labels, weights), strict=True
        ):
            torch.testing.assert_close(got, want)


def test_fused_chunked_ce_equals_the_eager_one() -> None:
    """train.compile=full routes the CE terms through the compiled kernel: same loss, hits and gradients."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(29, 16, generator=g)
    labels = torch.randint(0, 29, (37,), generator=g)
    weights = torch.rand(37, generator=g)
    results = []
    for fused in (False, True):
        h = torch.randn(37, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
        loss, correct = chunked_lm_head_ce(h, w, labels, weights, chunk=8, fused=fused)
        loss.backward()
        results.append((loss.detach(), correct, h.grad))
    (la, ca, ga), (lb, cb, gb) = results
    torch.testing.assert_close(lb, la)
    assert torch.equal(cb, ca)
    torch.testing.assert_close(gb, ga)
