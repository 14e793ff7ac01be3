"""AdamW and the recipe's warmup + cosine schedule, driven by training progress rather than step count.

Progress (samples trained / samples planned) is the same on every rank and does not depend on how many
workers there are, so the schedule survives workers joining or leaving. A run cut short by
``--max-steps`` follows its steps instead when they end it first (``schedule_progress``): it warms up over
``warmup_ratio`` of its steps and decays to its last one, rather than ending inside the warm-up of an
epoch plan it never reaches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dflash_pipe.config.train import TrainConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    params = list(params)
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None
    )


def schedule_progress(sample_progress: float, step: int, cfg: TrainConfig) -> float:
    """Where the schedule stands before optimizer step ``step`` (0-based): the share of planned samples
    trained, or of ``max_steps`` taken, whichever is further along (the same on every rank: every rank takes
    every step)."""
    if cfg.max_steps is None:
        return sample_progress
    return max(sample_progress, step / cfg.max_steps)


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_ratio`` of progress, then cosine down to ``min_lr_ratio * lr``."""
    progress = min(max(progress, 0.0), 1.0)
    if cfg.warmup_ratio > 0 and progress < cfg.warmup_ratio:
        return cfg.lr * max(progress / cfg.warmup_ratio, 0.01)
    span = 1.0 - cfg.warmup_ratio
    t = (progress - cfg.warmup_ratio) / span if span > 0 else 1.0
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
