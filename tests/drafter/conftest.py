"""Tiny drafter fixtures shared by the drafter tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_pipe.drafter import DFlashDrafter, DrafterConfig


def pytest_configure(config: pytest.Config) -> None:
    # eager flex_attention warns that it is unfused: expected on CPU.
    config.addinivalue_line("filterwarnings", "ignore:.*flex_attention called without torch.compile.*")


def tiny_config(**overrides) -> DrafterConfig:
    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=50,
        rope_theta=10000.0,
        max_position_embeddings=512,
        block_size=4,
        mask_token_id=49,
        target_layer_ids=(0, 2),
        num_target_layers=4,
        max_anchors=6,
    )
    kwargs.update(overrides)
    return DrafterConfig(**kwargs)


def tiny_drafter(cfg: DrafterConfig | None = None, seed: int = 0) -> DFlashDrafter:
    cfg = cfg or tiny_config()
    torch.manual_seed(seed)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return DFlashDrafter(cfg, embed, head)


def loss_and_grads(model: DFlashDrafter) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One seeded batch of 2 (the second right-padded) forward and backward: the loss and every gradient."""
    torch.manual_seed(11)
    ids = torch.randint(0, 49, (2, 24))
    feats = torch.randn(2, 24, model.cfg.feature_size)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 18:] = False
    out = model(ids, feats, mask, generator=torch.Generator().manual_seed(5))
    out.loss_sum.backward()
    return out.loss_sum.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def drafter() -> DFlashDrafter:
    return tiny_drafter()


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny matmuls are much faster on one thread, and the CI box is shared by other test runs."""
