"""Simulated acceptance length (tau): greedy, teacher-forced, from counts that sum across batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import sample_anchors
from .model import DFlashDrafter

_ARGMAX_CHUNK = 4096  # LM-head rows at a time when drafting


@dataclass
class AcceptanceCounts:
    """Additive: sum them over batches and workers, then read tau."""

    anchors: int  # drafted blocks
    accepted_total: int  # accepted draft tokens over all blocks
    per_slot_accepted: Tensor  # [bs] int64: blocks whose slot k was accepted (slot 0 = the anchor: 0)

    @property
    def tau(self) -> float:
        """Mean accepted tokens per block, +1 for the token the target itself adds."""
        return (self.accepted_total + self.anchors) / max(self.anchors, 1)

    @property
    def per_slot_rate(self) -> Tensor:
        """[bs] float: fraction of blocks that got at least k tokens accepted."""
        return self.per_slot_accepted.double() / max(self.anchors, 1)

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            anchors=self.anchors + other.anchors,
            accepted_total=self.accepted_total + other.accepted_total,
            per_slot_accepted=self.per_slot_accepted
            + other.per_slot_accepted.to(self.per_slot_accepted.device),
        )

    @classmethod
    def zeros(cls, block_size: int) -> AcceptanceCounts:
        return cls(anchors=0, accepted_total=0, per_slot_accepted=torch.zeros(block_size, dtype=torch.long))


@torch.no_grad()
def draft_tokens(
    drafter: DFlashDrafter, input_ids: Tensor, features: Tensor, anchors: Tensor, valid: Tensor
) -> Tensor:
    """Greedy draft [B, N, bs-1] for slots 1..bs-1 of each block (LM head in chunks)."""
    hidden = drafter.block_hidden(input_ids, features, anchors, valid)[:, :, 1:]  # [B, N, bs-1, H]
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight = drafter.lm_head.weight
    out = [
        torch.nn.functional.linear(flat[i : i + _ARGMAX_CHUNK].to(weight.dtype), weight).argmax(-1)
        for i in range(0, flat.shape[0], _ARGMAX_CHUNK)
    ]
    return torch.cat(out).view(hidden.shape[:3])


@torch.no_grad()
def acceptance(
    drafter: DFlashDrafter,
    input_ids: Tensor,
    features: Tensor,
    loss_mask: Tensor,
    target_next: Tensor,
    *,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> AcceptanceCounts:
    """input_ids [B, S], features [B, S, k*H], loss_mask [B, S] bool, target_next [B, S] int64: the
    target's greedy prediction made at position p (for p+1); negative = padding (never matched).

    Anchors: positions a with loss_mask[a] and a+1 < S. Slot k is accepted iff every slot k' <= k drafted
    target_next[a+k'-1] and a+k' < S.
    """
    bs = drafter.cfg.block_size
    seq_len = input_ids.shape[1]
    anchors, valid = sample_anchors(loss_mask[:, :-1], num_anchors, generator=generator)  # [B, N]
    draft = draft_tokens(drafter, input_ids, features, anchors, valid)  # [B, N, bs-1]
    pos = anchors[:, :, None] + torch.arange(bs - 1, device=anchors.device)  # a+k-1 for k=1..bs-1
    in_range = (pos + 1) < seq_len
    want = target_next.gather(1, pos.clamp(max=seq_len - 1).flatten(1)).view_as(pos)
    match = (draft == want) & (want >= 0) & in_range & valid[:, :, None]
    run = match.long().cumprod(dim=2)  # [B, N, bs-1]: 1 while every earlier slot matched
    per_slot = torch.zeros(bs, dtype=torch.long)
    per_slot[1:] = run.sum(dim=(0, 1)).cpu()
    return AcceptanceCounts(
        anchors=int(valid.sum().item()), accepted_total=int(run.sum().item()), per_slot_accepted=per_slot
    )
