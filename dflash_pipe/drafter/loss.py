"""Training targets (block inputs, positions, labels, slot weights) and the chunked LM-head CE."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_pipe.compute.compile import INDUCTOR_OPTIONS

DEFAULT_CE_CHUNK = 4096  # rows of the LM head evaluated at once


@dataclass
class DrafterOutput:
    """Sums (not means) so workers can all-reduce them before dividing."""

    loss_sum: Tensor  # scalar, sum of decay-weighted CE (differentiable)
    weight_sum: Tensor  # scalar, sum of the weights used
    slot_correct: Tensor  # [bs] float, argmax == label counts per slot (slot 0 always 0)
    slot_total: Tensor  # [bs] float, scored positions per slot
    num_anchors: int  # real (non-padded) anchors in the batch

    @property
    def loss(self) -> Tensor:
        return self.loss_sum / self.weight_sum.clamp_min(1e-8)


@dataclass
class BlockTargets:
    """Everything derived from the anchors, shaped [B, N, bs]."""

    block_ids: Tensor  # [B, N, bs] int64: token at anchor, then MASK
    positions: Tensor  # [B, N, bs] int64: anchor + [0..bs-1]
    labels: Tensor  # [B, N, bs] int64: token at anchor + k (0 where out of range)
    weights: Tensor  # [B, N, bs] float32: exp(-(k-1)/gamma) where scored, else 0


def slot_weights(block_size: int, gamma: float) -> Tensor:
    """[bs] float32: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.float()


def build_block_targets(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockTargets:
    """input_ids/loss_mask [B, S], anchors/valid [B, N]. Slot k of block b predicts token anchor+k,
    scored only when the anchor is real, k >= 1, anchor+k < S and loss_mask[anchor+k]."""
    seq_len = input_ids.shape[1]
    offs = torch.arange(block_size, device=input_ids.device)  # [bs]
    positions = anchors[:, :, None] + offs  # [B, N, bs]
    in_range = positions < seq_len
    idx = positions.clamp(max=seq_len - 1).flatten(1)  # [B, N*bs]
    labels = input_ids.gather(1, idx).view_as(positions)
    label_mask = loss_mask.gather(1, idx).view_as(positions)
    scored = valid[:, :, None] & in_range & label_mask & (offs >= 1)
    weights = slot_weights(block_size, gamma).to(input_ids.device) * scored
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    return BlockTargets(block_ids=block_ids, positions=positions, labels=labels * in_range, weights=weights)


def _ce_chunk(hidden: Tensor, lm_weight: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden.to(lm_weight.dtype), lm_weight).float()  # [r, V]
    ce = F.cross_entropy(logits, labels, reduction="none")  # [r]
    correct = logits.argmax(dim=-1) == labels
    return (ce * weights).sum(), correct


def _ce_stats(lf: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 logits [r, V] -> logsumexp [r], the weighted CE sum, argmax hits [r]."""
    lse = torch.logsumexp(lf, dim=-1)  # [r]
    picked = lf.gather(1, labels[:, None]).squeeze(1)  # [r]
    return lse, ((lse - picked) * weights).sum(), lf.argmax(dim=-1) == labels


def _grad_terms(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's weighted CE sum, argmax hits and d(loss)/d(logits) = (softmax - onehot) * w.

    logits [r, V] in the head dtype. Written functionally so Inductor fuses it into a couple of passes
    over the logits (eager needs about ten full fp32 passes); see ``_fused_grad_terms``.
    """
    lf = logits.float()
    lse, loss, correct = _ce_stats(lf, labels, weights)
    cols = torch.arange(lf.shape[1], device=lf.device)
    probs = torch.exp(lf - lse[:, None])
    dlogits = torch.where(cols[None, :] == labels[:, None], probs - 1.0, probs) * weights[:, None]
    return loss, correct, dlogits.to(logits.dtype)


@functools.cache
def _fused_grad_terms():
    return torch.compile(_grad_terms, dynamic=True, options=INDUCTOR_OPTIONS)


def _eager_grad_terms(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Same as ``_grad_terms`` with the fp32 logits reused in place (eager peak memory: one fp32 copy)."""
    lf = logits.float()
    lse, loss, correct = _ce_stats(lf, labels, weights)
    probs = lf.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    probs.scatter_add_(1, labels[:, None], probs.new_full((probs.shape[0], 1), -1.0))
    probs.mul_(weights[:, None])
    return loss, correct, probs.to(logits.dtype)


class _FrozenHeadCE(torch.autograd.Function):
    """Weighted CE through a frozen LM head, one chunk of rows at a time.

    The head is frozen, so the only gradient needed is d(loss)/d(hidden) = ((softmax - onehot) * w) @ W.
    The forward computes it chunk by chunk while that chunk's logits are live and keeps only the [R, H]
    result: two matmuls per chunk instead of the three of a checkpointed recompute, and never more than
    one chunk of [r, V] logits in memory. With ``fused`` the softmax/CE terms run as one compiled kernel.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, lm_weight: Tensor, labels: Tensor, weights: Tensor, chunk: int, fused: bool
    ):
        terms = _fused_grad_terms() if fused else _eager_grad_terms
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            logits = F.linear(hidden[sl].to(lm_weight.dtype), lm_weight)  # [r, V]
            part, correct[sl], dlogits = terms(logits, labels[sl], weights[sl])
            total += part
            grad[sl] = (dlogits @ lm_weight).to(hidden.dtype)  # [r, H]
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_correct: Tensor | None):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


def chunked_lm_head_ce(
    hidden: Tensor,
    lm_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    *,
    chunk: int = DEFAULT_CE_CHUNK,
    fused: bool = False,
) -> tuple[Tensor, Tensor]:
    """Weighted CE sum and per-row correctness without ever holding all [R, V] logits.

    hidden [R, H], lm_weight [V, H] (frozen), labels [R], weights [R]. With gradients, a custom autograd
    function computes d(loss)/d(hidden) during the forward (see ``_FrozenHeadCE``); it keeps no autograd
    state across threads, so it is also safe in threaded mode. ``fused``: compile the per-chunk softmax/CE
    terms into one kernel (``train.compile=full``).
    """
    if lm_weight.requires_grad:
        raise ValueError("chunked_lm_head_ce expects the target's LM head frozen (requires_grad=False).")
    if hidden.requires_grad and torch.is_grad_enabled():
        return _FrozenHeadCE.apply(hidden, lm_weight, labels, weights, chunk, fused)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        part, ok = _ce_chunk(hidden[sl], lm_weight, labels[sl], weights[sl])
        total = total + part
        correct.append(ok)
    ok_all = torch.cat(correct) if correct else labels.new_zeros((0,), dtype=torch.bool)
    return total, ok_all


def drafter_loss(
    hidden: Tensor,
    targets: BlockTargets,
    lm_weight: Tensor,
    *,
    chunk: int = DEFAULT_CE_CHUNK,
    num_anchors: int,
    fused: bool = False,
) -> DrafterOutput:
    """hidden [B, N, bs, H] (after the final norm) -> DrafterOutput over the scored slots only."""
    bsz, n, bs, width = hidden.shape
    flat_w = targets.weights.reshape(-1)  # [B*N*bs]
    rows = flat_w.nonzero().squeeze(1)  # scored rows only: the LM head never sees the rest
    slots = rows % bs
    loss_sum, correct = chunked_lm_head_ce(
        hidden.reshape(-1, width)[rows],
        lm_weight,
        targets.labels.reshape(-1)[rows],
        flat_w[rows],
        chunk=chunk,
        fused=fused,
    )
    if rows.numel() == 0:
        loss_sum = loss_sum + hidden.sum() * 0.0  # keep every parameter in the graph
    slot_correct = torch.zeros(bs, device=hidden.device).index_add_(0, slots, correct.float())
    slot_total = torch.zeros(bs, device=hidden.device).index_add_(0, slots, torch.ones_like(flat_w[rows]))
    return DrafterOutput(
        loss_sum=loss_sum,
        weight_sum=flat_w.sum().detach(),
        slot_correct=slot_correct,
        slot_total=slot_total,
        num_anchors=num_anchors,
    )
