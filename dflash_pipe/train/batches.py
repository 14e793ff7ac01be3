"""From a packed BATCH message (samples back to back) to the padded tensors the drafter trains on.

The wire tensors may view a shared-memory ring slot that the producer reuses after the ACK: everything
returned here is a device copy (or, on CPU, used only within the step that precedes the ACK).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_pipe.compute.precision import compute_dtype
from dflash_pipe.wire.fp8 import read_features


@dataclass(slots=True)
class DeviceBatch:
    input_ids: torch.Tensor  # [B, S] int64
    features: torch.Tensor  # [B, S, k*H]
    loss_mask: torch.Tensor  # [B, S] bool, False on padding
    target_next: torch.Tensor | None  # [B, S] int64, eval batches only
    tokens: int


def unpack(
    tensors: dict[str, torch.Tensor],
    lengths: list[int],
    device: torch.device,
    *,
    feature_size: int | None = None,
) -> DeviceBatch:
    """Copies the packed wire tensors to ``device`` once, then pads there (right padding).

    FP8 features ("feature_scales" present) are dequantised on ``device`` after the copy, to bf16 on CUDA
    and fp32 on CPU (the dtypes the worker builds its drafter in)."""
    total = sum(lengths)
    missing = sorted({"input_ids", "loss_mask", "features"} - set(tensors))
    if missing:
        raise ValueError(
            f"BATCH lacks tensors {missing}; producer and worker run different dflash-pipe versions?"
        )
    feats = tensors["features"]
    if feats.dim() != 2 or (feature_size is not None and feats.shape[1] != feature_size):
        raise ValueError(
            f"BATCH features have shape {tuple(feats.shape)}, but this drafter expects [T, {feature_size}] "
            "(layers x target hidden size from WELCOME)."
        )
    if feats.shape[0] != total or tensors["input_ids"].shape[0] != total:
        raise ValueError(f"BATCH tensors hold {feats.shape[0]} tokens but lengths sum to {total}.")
    non_blocking = device.type == "cuda"
    ids = tensors["input_ids"].to(device, torch.int64, non_blocking=non_blocking)
    mask = tensors["loss_mask"].to(device, non_blocking=non_blocking).bool()
    on_device = {
        k: tensors[k].to(device, non_blocking=non_blocking)
        for k in ("features", "feature_scales")
        if k in tensors
    }
    feats = read_features(on_device, compute_dtype(device))
    nxt = tensors.get("target_next")
    nxt = None if nxt is None else nxt.to(device, torch.int64, non_blocking=non_blocking)
    b, s = len(lengths), max(lengths)
    if b == 1:
        return DeviceBatch(
            ids[None], feats[None], mask[None], None if nxt is None else nxt[None], tokens=total
        )
    out_ids = torch.zeros(b, s, dtype=torch.int64, device=device)
    out_mask = torch.zeros(b, s, dtype=torch.bool, device=device)
    out_feats = torch.zeros(b, s, feats.shape[-1], dtype=feats.dtype, device=device)
    out_next = None if nxt is None else torch.full((b, s), -1, dtype=torch.int64, device=device)
    start = 0
    for row, n in enumerate(lengths):
        out_ids[row, :n] = ids[start : start + n]
        out_mask[row, :n] = mask[start : start + n]
        out_feats[row, :n] = feats[start : start + n]
        if out_next is not None:
            out_next[row, :n] = nxt[start : start + n]
        start += n
    return DeviceBatch(out_ids, out_feats, out_mask, out_next, tokens=total)
