"""A batch that runs out of GPU memory is trained in parts of whole samples: the same gradient and totals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_pipe.config.train import TrainConfig
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.step import forward_backward
from tests.drafter.conftest import tiny_config, tiny_drafter

CPU = torch.device("cpu")


def _batch(lengths: list[int]) -> m.Batch:
    gen = torch.Generator().manual_seed(3)
    total = sum(lengths)
    mask = torch.ones(total, dtype=torch.bool)
    mask[::5] = False  # some positions not trained on, as prompts are
    tensors = {
        "input_ids": torch.randint(0, 49, (total,), generator=gen),
        "loss_mask": mask,
        "features": torch.randn(total, 2 * 32, generator=gen),
    }
    return m.Batch(
        batch_id=0, epoch=0, sample_ids=list(range(len(lengths))), lengths=lengths, tensors=tensors
    )


def _session() -> SimpleNamespace:
    """What forward_backward reads of a WorkerSession."""
    return SimpleNamespace(feature_size=64, train=TrainConfig(), step=3, block_size=4)


def _pass(model, batch: m.Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in model.parameters():  # as the loop leaves them between steps: zeros, not None
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    totals = forward_backward(_session(), model, batch, device=CPU, virtual_rank=0)
    return totals, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _OutOfMemoryAbove:
    """Wraps a drafter: any forward of more than ``rows`` samples runs out of memory, halfway through its
    backward (so the failed pass leaves partial gradients behind, as a real one can)."""

    def __init__(self, model, rows: int) -> None:
        self.model, self.rows, self.failures = model, rows, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, feats, mask, *, generator):
        out = self.model(ids, feats, mask, generator=generator)
        if ids.shape[0] > self.rows:
            self.failures += 1
            out.loss_sum.backward(retain_graph=True)  # partial gradients, then the failure
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out


def test_a_batch_out_of_memory_is_trained_in_parts_with_the_same_gradient() -> None:
    lengths = [23, 17, 30, 9, 14]
    cfg = tiny_config(max_anchors=64)  # more than any sample's eligible positions: every one is an anchor
    whole, whole_grads = _pass(tiny_drafter(cfg), _batch(lengths))
    wrapped = _OutOfMemoryAbove(tiny_drafter(cfg), rows=1)
    with pytest.warns(RuntimeWarning, match="ran out of GPU memory; training it in 2 parts"):
        parts, part_grads = _pass(wrapped, _batch(lengths))
    assert wrapped.failures == 3  # 5 rows; parts of 2 + 3; of 1, 1, 2, 1; then all of one row
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)  # loss, weight, tokens, slot counts
    assert parts[2] == sum(lengths)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(part_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_sample_that_does_not_fit_names_what_to_change() -> None:
    wrapped = _OutOfMemoryAbove(tiny_drafter(tiny_config()), rows=0)
    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError, match="--max-anchors"):
        _pass(wrapped, _batch([12, 8]))
