"""The training loop of one drafter worker: the DFlash recipe, step by step, in lockstep with the group."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.drafter import acceptance
from dflash_pipe.train.batches import DeviceBatch, unpack
from dflash_pipe.train.checkpoint import save_checkpoint
from dflash_pipe.train.config import TrainConfig
from dflash_pipe.train.distributed import DrafterGroup
from dflash_pipe.train.ledger import Ledger
from dflash_pipe.train.link import ProducerLink
from dflash_pipe.train.optim import lr_at, set_lr
from dflash_pipe.wire import messages as m

_POLL_S = 0.05


class ProducerRefusedError(RuntimeError):
    """The producer answered with an error or a rejection instead of work."""


@dataclass(slots=True)
class WorkerSession:
    """Everything one worker's loop needs, built by the worker process before training starts."""

    link: ProducerLink
    group: DrafterGroup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ledger: Ledger
    train: TrainConfig
    drafter_config: dict[str, Any]
    run_dir: Path
    device: torch.device
    rank: int
    step: int = 0
    started_at: float = field(default_factory=time.time)
    eval_batches: list[DeviceBatch] = field(default_factory=list)
    block_size: int = 16
    feature_size: int | None = None
    """k*H: the width every BATCH's features must have."""

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


@dataclass(slots=True)
class LoopResult:
    steps: int
    stop_reason: str
    last_checkpoint: Path | None


def run_training(s: WorkerSession, stop_requested: Callable[[], bool]) -> LoopResult:
    pending: deque[m.Batch] = deque()
    done_reason: str | None = None
    last_checkpoint: Path | None = None
    first_step_done = False
    generator = torch.Generator(device=s.device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if s.device.type == "cuda" else contextlib.nullcontext()
    )
    while True:
        done_reason = _collect(s, pending, wait=not pending and done_reason is None) or done_reason
        stop_reason = done_reason or ("interrupted" if stop_requested() else None)
        if s.train.max_steps is not None and s.step >= s.train.max_steps:
            stop_reason = stop_reason or f"reached max_steps={s.train.max_steps}"
        batch = pending.popleft() if pending and stop_reason is None else None
        pairs = _id_pairs(batch)
        vote = s.group.vote(has_batch=batch is not None, stop=stop_reason is not None, num_ids=len(pairs))
        if vote.stop:
            if batch is not None:
                pending.appendleft(batch)
            return LoopResult(s.step, stop_reason or "stopped by another worker", last_checkpoint)
        if vote.active == 0:
            continue

        totals = torch.zeros(3 + 2 * s.block_size, dtype=torch.float64)
        if batch is not None:
            inputs = unpack(batch.tensors, batch.lengths, s.device, feature_size=s.feature_size)
            generator.manual_seed(_step_seed(s.train.seed, s.step, s.rank))
            with autocast:
                out = s.model(inputs.input_ids, inputs.features, inputs.loss_mask, generator=generator)
            out.loss_sum.backward()
            totals[0] = float(out.weight_sum)
            totals[1] = float(out.loss_sum.detach())
            totals[2] = inputs.tokens
            totals[3 : 3 + s.block_size] = out.slot_correct.detach().double().cpu()
            totals[3 + s.block_size :] = out.slot_total.detach().double().cpu()
        trained = s.group.gather_ids(pairs, vote.counts)
        totals = s.group.sum_vector(totals)
        s.group.sum_gradients(s.params)
        weight = float(totals[0])
        grad_norm = 0.0
        if weight > 0:
            for p in s.params:
                p.grad.div_(weight)
            if s.train.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(s.params, s.train.grad_clip))
            lr = lr_at(s.ledger.progress(), s.train)
            set_lr(s.optimizer, lr)
            s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=False)
        s.step += 1
        for epoch in trained[:, 0].unique().tolist():
            s.ledger.mark(int(epoch), trained[trained[:, 0] == epoch, 1].tolist())
        if batch is not None:
            s.link.send(m.Ack(batch_ids=[batch.batch_id], step=s.step))
            s.link.send(m.Ready(credits=1))
        if not first_step_done:
            first_step_done = True
            s.link.send(m.Metrics(step=s.step, values={"time_to_first_step_s": time.time() - s.started_at}))
        if s.rank == 0 and (s.step % s.train.log_every == 0 or s.step == 1):
            s.link.send(m.Metrics(step=s.step, values=_step_metrics(s, totals, weight, grad_norm)))
        if s.rank == 0 and s.train.eval_every and s.step % s.train.eval_every == 0:
            s.link.send(m.Metrics(step=s.step, values=evaluate(s)))
        if s.step % s.train.checkpoint_every == 0:
            last_checkpoint = checkpoint(s)


def checkpoint(s: WorkerSession) -> Path | None:
    """Rank 0 writes; every rank holds the same ledger, so rank 0's view is the group's."""
    if s.rank != 0:
        return None
    path = save_checkpoint(
        s.run_dir,
        step=s.step,
        model=s.model,
        drafter_config=s.drafter_config,
        optimizer=s.optimizer,
        ledger=s.ledger.to_dict(),
        extra={"world_size": s.group.world_size},
    )
    s.link.send(m.Checkpoint(step=s.step, path=str(path)))
    return path


@torch.no_grad()
def evaluate(s: WorkerSession) -> dict[str, Any]:
    """Simulated acceptance length (tau) on the producer's held-out samples."""
    if not s.eval_batches:
        return {}
    was_training = s.model.training
    s.model.eval()
    generator = torch.Generator(device=s.device).manual_seed(s.train.seed + 17)
    counts = None
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if s.device.type == "cuda" else contextlib.nullcontext()
    )
    with autocast:
        for b in s.eval_batches:
            c = acceptance(
                s.model,
                b.input_ids,
                b.features,
                b.loss_mask,
                b.target_next,
                num_anchors=64,
                generator=generator,
            )
            counts = c if counts is None else counts + c
    s.model.train(was_training)
    return {"tau": float(counts.tau), "acceptance_per_slot": [float(x) for x in counts.per_slot_rate]}


def _collect(s: WorkerSession, pending: deque, *, wait: bool) -> str | None:
    """Moves everything the producer sent into ``pending``; returns DONE's reason if it came."""
    deadline = time.monotonic() + (_POLL_S if wait else 0.0)
    done = None
    while True:
        msg = s.link.get(timeout_s=max(deadline - time.monotonic(), 0.0))
        if msg is None:
            return done
        if isinstance(msg, m.Batch):
            pending.append(msg)
        elif isinstance(msg, m.Done):
            done = msg.reason or "producer finished"
        elif isinstance(msg, (m.Error, m.Reject)):
            raise ProducerRefusedError(
                f"the producer reported: {getattr(msg, 'message', None) or msg.reason}"
            )
        deadline = time.monotonic()


def _id_pairs(batch: m.Batch | None) -> torch.Tensor:
    if batch is None:
        return torch.zeros(0, 2, dtype=torch.int64)
    ids = torch.tensor(batch.sample_ids, dtype=torch.int64)
    return torch.stack([torch.full_like(ids, batch.epoch), ids], dim=1)


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**63 - 1)


def _step_metrics(s: WorkerSession, totals: torch.Tensor, weight: float, grad_norm: float) -> dict[str, Any]:
    bs = s.block_size
    correct = totals[3 : 3 + bs]
    seen = totals[3 + bs :]
    acc = (correct / seen.clamp_min(1)).tolist()
    return {
        "loss": float(totals[1]) / max(weight, 1e-12),
        "acc": acc[1:],
        "acc_mean": float(correct[1:].sum() / seen[1:].sum().clamp_min(1)),
        "lr": s.optimizer.param_groups[0]["lr"],
        "grad_norm": grad_norm,
        "tokens": float(totals[2]),
        "progress": s.ledger.progress(),
        "duplicates": s.ledger.duplicates,
        "world_size": s.group.world_size,
    }
