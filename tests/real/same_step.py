"""What both same-batch tests assert once each side has stepped: the same loss, every gradient alike."""

from __future__ import annotations

import torch


def assert_same_step(
    ours: torch.nn.Module,
    theirs: torch.nn.Module,
    loss: float,
    their_loss: float,
    frozen: list[torch.nn.Module],
) -> None:
    """Loss within 1e-5 relative; each of our parameters' gradients within 1e-4 relative of the one of the
    same name on ``theirs`` (which must be non-zero); the ``frozen`` target parts got no gradient."""
    assert abs(loss - their_loss) <= 1e-5 * abs(their_loss), (loss, their_loss)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        g, want = p.grad, theirs_params[name].grad
        assert want is not None and float(want.norm()) > 0, name
        rel = float((g - want).norm() / want.norm())
        assert rel <= 1e-4, (name, rel)
    assert all(part.weight.grad is None for part in frozen)  # the target's parts stay frozen
