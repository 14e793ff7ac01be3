"""One replica's forward/backward of one batch: the anchors seeded per (step, rank), the totals a step sums,
and the retry in parts of a batch that runs out of GPU memory."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from dflash_pipe.compute.precision import autocast
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.train.batches import DeviceBatch, unpack
from dflash_pipe.wire import messages as m


class StepSession(Protocol):
    """What a step reads of the worker's session (``worker.loop.WorkerSession`` is one): typed here so the
    loop imports the step without the step importing the loop back."""

    @property
    def train(self) -> TrainConfig: ...

    @property
    def step(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def feature_size(self) -> int | None: ...


def forward_backward(
    s: StepSession,
    model: torch.nn.Module,
    batch: m.Batch,
    *,
    device: torch.device,
    virtual_rank: int,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> torch.Tensor:
    """One replica's share of a step: its gradients accumulate on ``model``; returns the step totals
    [weight, loss, tokens, correct per slot, seen per slot]. ``virtual_rank`` seeds the anchor sampling: a
    threaded member's replica i samples exactly like process rank ``rank * width + i`` would.

    A batch that runs out of GPU memory is trained again in 2, 4, ... parts of whole samples, the partial
    gradients dropped first: the loss is a sum over anchors, so the parts' gradients add up to the batch's
    (the anchors are drawn per part). Activation memory follows the anchors (up to ``max_anchors`` x block
    size per sample), so a batch of many short samples can need far more than one long one."""
    inputs = unpack(batch.tensors, batch.lengths, device, feature_size=s.feature_size)
    seed = step_seed(s.train.seed, s.step, virtual_rank)
    parts = 1
    while True:
        try:
            totals = _train_parts(model, inputs, batch.lengths, parts, seed, s.block_size, backward)
        except torch.OutOfMemoryError as exc:
            if parts >= len(batch.lengths):
                raise torch.OutOfMemoryError(
                    f"one sample of {max(batch.lengths)} tokens does not fit in GPU memory on {device} even "
                    f"alone ({exc}); lower --max-anchors (now {model.cfg.max_anchors}) or --max-length, or "
                    "set --activation-checkpointing layers."
                ) from exc
            for p in model.parameters():  # what the failed pass accumulated: zero again, as the step began
                if p.grad is not None:
                    p.grad.zero_()
            parts = min(parts * 2, len(batch.lengths))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            warnings.warn(
                f"a batch of {len(batch.lengths)} samples ({inputs.tokens} tokens) ran out of GPU memory; "
                f"training it in {parts} parts (the same gradient, more time).",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        totals[2] = inputs.tokens
        return totals


def _train_parts(
    model: torch.nn.Module,
    inputs: DeviceBatch,
    lengths: list[int],
    parts: int,
    seed: int,
    block_size: int,
    backward: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """Forward/backward of the batch's rows in ``parts`` runs of whole samples, each cut to its longest."""
    device = inputs.input_ids.device
    generator = torch.Generator(device=device).manual_seed(seed)
    totals = zero_totals(block_size)
    bounds = torch.linspace(0, len(lengths), parts + 1).round().long().tolist()
    for lo, hi in itertools.pairwise(bounds):
        width = max(lengths[lo:hi])
        with autocast(device):
            rows = (
                t[lo:hi, :width].contiguous() for t in (inputs.input_ids, inputs.features, inputs.loss_mask)
            )
            out = model(*rows, generator=generator)  # contiguous: the whole batch (one part) is not copied
        backward(out.loss_sum)
        totals[0] += float(out.weight_sum)
        totals[1] += float(out.loss_sum.detach())
        totals[3 : 3 + block_size] += out.slot_correct.detach().double().cpu()
        totals[3 + block_size :] += out.slot_total.detach().double().cpu()
    return totals


def zero_totals(block_size: int) -> torch.Tensor:
    return torch.zeros(3 + 2 * block_size, dtype=torch.float64)


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**63 - 1)
