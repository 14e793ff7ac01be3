"""The training loop of one drafter worker: the DFlash recipe, step by step, in lockstep with the group.

Just past 400 lines: the loop and the step-boundary helpers it calls (regroup, checkpoint, evaluation, the
``--min-workers`` wait) all read and write the one ``WorkerSession``, and read best beside the loop.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash_pipe.compute.precision import autocast
from dflash_pipe.config.train import TrainConfig
from dflash_pipe.diskspace import free_bytes
from dflash_pipe.drafter.acceptance import acceptance  # the function (the package's name is the module)
from dflash_pipe.drafter.evaluate import simulated_metrics
from dflash_pipe.run.checkpoint import checkpoint_bytes, save_checkpoint
from dflash_pipe.run.dir import RunDir
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.train.batches import DeviceBatch, unpack
from dflash_pipe.train.distributed import DrafterGroup, GroupBrokenError, StepVote
from dflash_pipe.train.handover import hand_over
from dflash_pipe.train.optim import lr_at, schedule_progress, set_lr
from dflash_pipe.train.real_eval import RealEval
from dflash_pipe.wire import messages as m
from dflash_pipe.worker.link import ProducerLink
from dflash_pipe.worker.step import forward_backward, zero_totals

_POLL_S = 0.05
_GATED_POLL_S = 0.25
"""Between the votes of a group waiting for ``train.min_workers``: no step to take, so vote less often."""


class ProducerRefusedError(RuntimeError):
    """The producer answered with an error or a rejection instead of work."""


class Replicas(Protocol):
    """The drafter replicas of one group member and how they run one step's forward/backward."""

    width: int
    """Batches this member trains per step (one per replica)."""

    def local_pass(self, s: WorkerSession, batches: list[m.Batch]) -> torch.Tensor:
        """Forward/backward of ``batches``; leaves their summed gradients on ``s.model``, returns the totals."""
        ...

    def sync(self) -> None:
        """After the weights of ``s.model`` changed: every other replica copies them."""
        ...

    def alone(self) -> contextlib.AbstractContextManager:
        """Context in which the caller may run the drafter while no replica does (evaluation)."""
        ...


class OneReplica:
    """Process mode: this process trains one drafter."""

    width = 1

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def local_pass(self, s: WorkerSession, batches: list[m.Batch]) -> torch.Tensor:
        return forward_backward(s, self.model, batches[0], device=s.device, virtual_rank=s.rank)

    def sync(self) -> None:
        return None

    def alone(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@dataclass(slots=True)
class WorkerSession:
    """Everything one worker's loop needs, built by the worker process before training starts."""

    link: ProducerLink
    group: DrafterGroup
    model: torch.nn.Module
    """The drafter the optimizer steps (in threaded mode, replica 0)."""
    optimizer: torch.optim.Optimizer
    ledger: Ledger
    train: TrainConfig
    drafter_config: dict[str, Any]
    run_dir: Path
    device: torch.device
    step: int = 0
    started_at: float = field(default_factory=time.time)
    eval_batches: list[DeviceBatch] = field(default_factory=list)
    block_size: int = 16
    feature_size: int | None = None
    """k*H: the width every BATCH's features must have."""
    replicas: Replicas | None = None
    """Who runs forward/backward: ``OneReplica`` (process mode, the default) or ``worker.threads``."""
    real_eval: RealEval | None = None
    """Real speculative decoding of the held-out prompts (``train.eval_generate``); None: simulated only."""
    saved_step: int | None = None
    """The step of the latest checkpoint this worker wrote or resumed from (never written twice)."""
    save_requested: bool = False
    """The producer asked for a checkpoint now (a preemption warning); rank 0 writes it at the next step
    boundary."""
    final_eval: bool = True
    """DONE's word on the final evaluation: False when a signal drains the run (checkpoint and leave)."""
    eval_pending: bool = False
    """The producer is still regenerating the held-out set: its BATCHes come during training."""
    target_path: str = ""
    """The target checkpoint (the real evaluation loads it), for an eval set that arrives late."""
    eval_incoming: list[DeviceBatch] = field(default_factory=list)
    """Eval BATCHes of a late held-out set received so far (evaluated only once all have come)."""
    waiting_for: int = 0
    """While the group is below ``train.min_workers`` before the first step: the drafter count last said."""

    def __post_init__(self) -> None:
        if self.replicas is None:
            self.replicas = OneReplica(self.model)

    @property
    def rank(self) -> int:
        """This worker's rank in the current group generation (rank 0 reports and checkpoints)."""
        return self.group.rank

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


@dataclass(slots=True)
class LoopResult:
    steps: int
    stop_reason: str
    last_checkpoint: Path | None
    left: bool = False
    """This worker left; the others train on (no final checkpoint from it)."""


def run_training(s: WorkerSession, leave_requested: Callable[[], bool]) -> LoopResult:
    """Trains in lockstep until the run stops, this worker leaves, or the producer is lost (raises).

    Membership changes happen only at a step boundary: a vote that shows a leaver or a waiting joiner, or
    a collective that failed because a member died, sends every member to the next group generation.
    Before this launch's first step the group waits (batches kept, unacknowledged) until it holds
    ``train.min_workers`` drafters."""
    pending: deque[m.Batch] = deque()
    done_reason: str | None = None
    last_checkpoint: Path | None = None
    first_step_done = False
    gated = False
    while True:
        wait_s = _GATED_POLL_S if gated else 0.0 if pending else _POLL_S
        done_reason = _collect(s, pending, wait_s=0.0 if done_reason else wait_s) or done_reason
        if s.save_requested:  # a preemption warning: checkpoint now, at this step boundary, and train on
            s.save_requested = False
            if s.saved_step != s.step:
                last_checkpoint = checkpoint(s) or last_checkpoint
        stop_reason = done_reason
        if s.train.max_steps is not None and s.step >= s.train.max_steps:
            stop_reason = stop_reason or f"reached max_steps={s.train.max_steps}"
        leave = leave_requested()
        batches = []
        while pending and stop_reason is None and not leave and len(batches) < s.replicas.width:
            batches.append(pending.popleft())
        pairs = _id_pairs(batches)
        try:
            vote = s.group.vote(
                has_batch=bool(batches),
                stop=stop_reason is not None,
                leave=leave,
                num_ids=len(pairs),
                drafters=s.replicas.width,
            )
            everyone_leaves = all(vote.leaving) and vote.waiting == 0
            if vote.stop or everyone_leaves or vote.regroup:
                pending.extendleft(reversed(batches))
            if vote.stop or everyone_leaves:
                reason = stop_reason or ("interrupted" if leave else "stopped by another worker")
                return LoopResult(s.step, reason, last_checkpoint)
            if vote.leaving[s.group.rank]:
                return LoopResult(s.step, "left the group (interrupted)", last_checkpoint, left=True)
            if vote.regroup:
                regroup(s, "a worker joins" if vote.waiting else "a worker leaves")
                continue
            gated = not vote.may_step(s.train.min_workers)
            if gated:
                pending.extendleft(reversed(batches))
                say_waiting(s, vote)
                continue
            s.group.mark_started()
            if vote.active == 0:
                continue
            totals, weight, grad_norm = _train_step(s, batches, pairs, vote)
        except GroupBrokenError as exc:
            pending.extendleft(reversed(batches))
            s.optimizer.zero_grad(set_to_none=False)
            regroup(s, str(exc))
            continue
        if batches:
            s.link.send(m.Ack(batch_ids=[b.batch_id for b in batches], step=s.step))
            s.link.send(m.Ready(credits=len(batches)))
        if not first_step_done:
            first_step_done = True
            s.link.send(m.Metrics(step=s.step, values={"time_to_first_step_s": time.time() - s.started_at}))
        if s.rank == 0 and (s.step % s.train.log_every == 0 or s.step == 1):
            s.link.send(m.Metrics(step=s.step, values=_step_metrics(s, totals, weight, grad_norm)))
        if s.rank == 0 and s.train.eval_every and s.step % s.train.eval_every == 0:
            s.link.send(m.Metrics(step=s.step, values=evaluate(s)))
        if s.step % s.train.checkpoint_every == 0:
            last_checkpoint = checkpoint(s)


def _train_step(
    s: WorkerSession, batches: list[m.Batch], pairs: torch.Tensor, vote: StepVote
) -> tuple[torch.Tensor, float, float]:
    """Forward/backward of this member's batches, the group's sums, one optimizer step. The weights move only
    after every collective of the step succeeded, so a failed step leaves them untouched."""
    totals = s.replicas.local_pass(s, batches) if batches else zero_totals(s.block_size)
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
        set_lr(s.optimizer, lr_at(schedule_progress(s.ledger.progress(), s.step, s.train), s.train))
        s.optimizer.step()
        s.replicas.sync()
    s.optimizer.zero_grad(set_to_none=False)
    s.step += 1
    for epoch in trained[:, 0].unique().tolist():
        s.ledger.mark(int(epoch), trained[trained[:, 0] == epoch, 1].tolist())
    return totals, weight, grad_norm


def regroup(s: WorkerSession, why: str) -> None:
    """Moves to the next group generation and takes the most advanced member's state (see handover)."""
    started = time.monotonic()
    while True:
        try:
            s.group.form()
            s.step, s.ledger, source = hand_over(
                s.group, params=s.params, optimizer=s.optimizer, step=s.step, ledger=s.ledger
            )
            s.replicas.sync()
            break
        except GroupBrokenError as exc:  # someone died during the hand-over itself: next round
            why = str(exc)
    if s.rank == 0:
        values = {
            "world_size": s.group.world_size,
            "generation": s.group.generation,
            "regroup_s": time.monotonic() - started,
            "state_from_rank": source,
        }
        s.link.send(m.Metrics(step=s.step, values=values))
    print(
        f"dflash-pipe worker: group generation {s.group.generation}: rank {s.rank} of {s.group.world_size} "
        f"at step {s.step} ({why}; {time.monotonic() - started:.1f} s)",
        file=sys.stderr,
        flush=True,
    )


def say_waiting(s: WorkerSession, vote: StepVote) -> None:
    """The group is below ``train.min_workers`` before its first step: said once in this worker's log, and
    by rank 0 to the producer whenever the count changes (its dashboard says what the run waits for)."""
    if s.waiting_for == vote.drafters:
        return
    need = s.train.min_workers
    if not s.waiting_for:
        print(
            f"dflash-pipe worker: waiting for {need} workers ({vote.drafters} in) before the first step "
            f"(--min-workers {need}); the batches received wait for it",
            file=sys.stderr,
            flush=True,
        )
    s.waiting_for = vote.drafters
    if s.rank == 0:
        values = {"group/min_workers": float(need), "group/drafters": float(vote.drafters)}
        s.link.send(m.Metrics(step=s.step, values=values))


def checkpoint(s: WorkerSession) -> Path | None:
    """Rank 0 writes; every rank holds the same ledger, so rank 0's view is the group's. At step 0 nothing is
    written: untrained weights are no checkpoint (a resume starts the same from scratch, and an export or a
    "complete" run of them would be a lie)."""
    s.saved_step = s.step
    if s.rank != 0 or s.step == 0:
        return None
    path = save_checkpoint(
        s.run_dir,
        step=s.step,
        model=s.model,
        drafter_config=s.drafter_config,
        optimizer=s.optimizer,
        ledger=s.ledger.to_dict(),
        extra={"world_size": s.group.world_size},
        warn=lambda note: _low_space(s, note),
    )
    s.link.send(m.Checkpoint(step=s.step, path=str(path)))
    return path


def _low_space(s: WorkerSession, note: str) -> None:
    """The checkpoint fits, the next may not: said in this worker's log and, as ``disk/...`` metrics, by the
    producer (its console and metrics.jsonl)."""
    root = RunDir(s.run_dir).checkpoints
    print(f"dflash-pipe worker: warning: {note}", file=sys.stderr, flush=True)
    free, needed = float(free_bytes(root)), float(checkpoint_bytes(root, s.model))
    values = {"disk/free_bytes": free, "disk/checkpoint_bytes": needed, "disk/low_space": 1.0}
    s.link.send(m.Metrics(step=s.step, values=values))


@torch.no_grad()
def evaluate(s: WorkerSession, *, final: bool = False) -> dict[str, Any]:
    """Simulated acceptance length (teacher-forced, ``simulated/...``) on the producer's held-out samples,
    and, when ``train.eval_generate`` asks for this evaluation, the real one (``real/...``)."""
    if not s.eval_batches:
        # Due before the held-out set exists: say so (the dashboard notes it) instead of a tau of nothing.
        return {"eval/skipped": 1.0} if s.eval_pending else {}
    was_training = s.model.training
    s.model.eval()
    generator = torch.Generator(device=s.device).manual_seed(s.train.seed + 17)
    counts = None
    with s.replicas.alone(), autocast(s.device):
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
        values = simulated_metrics(counts)
        if s.real_eval is not None and s.real_eval.due(final=final):
            values |= s.real_eval.run(s.model)
    s.model.train(was_training)
    return values


def _collect(s: WorkerSession, pending: deque, *, wait_s: float) -> str | None:
    """Moves everything the producer sent into ``pending`` (waiting up to ``wait_s`` for the first message);
    returns DONE's reason if it came."""
    deadline = time.monotonic() + wait_s
    done = None
    while True:
        msg = s.link.get(timeout_s=max(deadline - time.monotonic(), 0.0))
        if msg is None:
            return done
        if isinstance(msg, m.Batch) and msg.for_eval:
            take_eval_batch(s, msg)
        elif isinstance(msg, m.Batch):
            pending.append(msg)
        elif isinstance(msg, m.Done):
            done = msg.reason or "producer finished"
            s.final_eval = msg.evaluate
        elif isinstance(msg, m.Checkpoint):
            s.save_requested = True
        elif isinstance(msg, (m.Error, m.Reject)):
            raise ProducerRefusedError(
                f"the producer reported: {getattr(msg, 'message', None) or msg.reason}"
            )
        deadline = time.monotonic()


def take_eval_batch(s: WorkerSession, msg: m.Batch) -> None:
    """A BATCH of the held-out set sent during training (it was regenerated after this worker's WELCOME);
    the set is used once all its ``eval_set`` BATCHes have come, never a part of it."""
    s.eval_incoming.append(unpack(msg.tensors, msg.lengths, s.device, feature_size=s.feature_size))
    if len(s.eval_incoming) < msg.eval_set:
        return
    s.eval_batches, s.eval_incoming, s.eval_pending = s.eval_incoming, [], False
    if s.train.eval_generate != "off":
        s.real_eval = RealEval(s.target_path, s.eval_batches, s.train, s.device)


def _id_pairs(batches: list[m.Batch]) -> torch.Tensor:
    """[n, 2] int64 (epoch, sample id) of every sample in ``batches``."""
    rows = [(b.epoch, i) for b in batches for i in b.sample_ids]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


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
