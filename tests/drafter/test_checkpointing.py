"""Activation checkpointing changes memory, never the math: same loss and gradients for every choice."""

from __future__ import annotations

import pytest
import torch

from dflash_pipe.drafter.checkpointing import CheckpointPolicy
from dflash_pipe.train.build import apply_checkpointing

from .conftest import loss_and_grads, tiny_drafter


def _loss_and_grads(policy: CheckpointPolicy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return loss_and_grads(apply_checkpointing(tiny_drafter(seed=3), policy))


@pytest.mark.parametrize(
    "policy",
    [
        CheckpointPolicy("layers"),
        CheckpointPolicy("loss"),
        CheckpointPolicy("all"),
        CheckpointPolicy("all", reentrant=True),
        CheckpointPolicy("all", mode="threaded"),
    ],
    ids=["layers", "loss", "all", "all-reentrant", "all-threaded"],
)
def test_checkpointing_keeps_loss_and_gradients(policy: CheckpointPolicy):
    ref_loss, ref_grads = _loss_and_grads(CheckpointPolicy("none"))
    loss, grads = _loss_and_grads(policy)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert ref_grads[name].abs().sum() > 0, name  # every parameter really gets a gradient
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("what", "layer_runs", "norm_runs"), [("none", 2, 1), ("layers", 4, 1), ("loss", 2, 2), ("all", 4, 2)]
)
def test_checkpointing_recomputes_what_it_says(monkeypatch, what: str, layer_runs: int, norm_runs: int):
    """A checkpointed part runs twice: in the forward, then again in backward (2 layers, 1 final norm)."""
    model = tiny_drafter()
    apply_checkpointing(model, CheckpointPolicy(what))
    runs = {"layer": 0, "norm": 0}
    layer_forward, norm_forward = type(model.layers[0]).forward, type(model.norm).forward

    def counted_layer(self, *args):
        runs["layer"] += 1
        return layer_forward(self, *args)

    def counted_norm(self, x):
        runs["norm"] += self is model.norm
        return norm_forward(self, x)

    monkeypatch.setattr(type(model.layers[0]), "forward", counted_layer)
    monkeypatch.setattr(type(model.norm), "forward", counted_norm)
    ids = torch.randint(0, 49, (1, 16))
    out = model(ids, torch.randn(1, 16, model.cfg.feature_size), torch.ones(1, 16, dtype=torch.bool))
    out.loss_sum.backward()
    assert (runs["layer"], runs["norm"]) == (layer_runs, norm_runs)


def test_reentrant_is_refused_in_threaded_mode():
    with pytest.raises(ValueError, match="reentrant.*--drafter-mode threads"):
        CheckpointPolicy("layers", mode="threaded", reentrant=True)


def test_unknown_choice_names_the_valid_ones():
    with pytest.raises(ValueError, match="none, layers, loss, all"):
        CheckpointPolicy("everything")  # type: ignore[arg-type]
