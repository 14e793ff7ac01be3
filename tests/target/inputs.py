"""Sizes and inputs the target tests share (a module of its own: several test packages have a conftest,
so a test module importing ``conftest`` gets whichever was loaded last)."""

from __future__ import annotations

import torch

VOCAB = 97
NUM_LAYERS = 5


def packed_batch(lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Random packed input_ids [T] for samples of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (sum(lengths),), generator=g)
