"""The flex tiles the drafter asks for: only where they were measured faster (sm90, 128 < head_dim <= 256)."""

import pytest
import torch

from dflash_pipe.compute.compile import FLEX_SM90_WIDE_HEAD_TILES, flex_kernel_options


@pytest.mark.parametrize(
    ("capability", "head_dim", "expected"),
    [
        ((9, 0), 256, FLEX_SM90_WIDE_HEAD_TILES),
        ((9, 0), 192, FLEX_SM90_WIDE_HEAD_TILES),
        ((9, 0), 128, None),  # Inductor's own sm90 tiles at 128 are the fast ones (the 8B drafter)
        ((8, 0), 256, None),  # A100: not measured, Inductor decides
        ((10, 0), 256, None),  # Blackwell: not measured
    ],
)
def test_tiles_by_gpu_and_head_dim(monkeypatch, capability, head_dim, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert flex_kernel_options(head_dim, torch.device("cuda", 0)) == expected


def test_cpu_keeps_inductor_choice():
    assert flex_kernel_options(256, torch.device("cpu")) is None


def test_tiles_fit_the_mask_tiles():
    """Every block size divides flex's 128-row mask tile, the rule create_block_mask's tiles impose."""
    blocks = {k: v for k, v in FLEX_SM90_WIDE_HEAD_TILES.items() if "BLOCK" in k}
    assert blocks and all(128 % v == 0 for v in blocks.values())
    assert blocks["bwd_BLOCK_N1"] % blocks["bwd_BLOCK_M1"] == 0  # Inductor's backward requires these
    assert blocks["bwd_BLOCK_M2"] % blocks["bwd_BLOCK_N2"] == 0
