"""What the target computes next and who trains on it: plans to the target threads, ready batches leased to
workers, plans leased to attached producers, the regeneration jobs and the held-out set.

``Leasing`` owns the scheduler, the two queues the target threads share with the main thread and the
counts that keep them full; nothing outside it writes its fields (a test reads the code to keep it so).
It sends nothing: the core hands what it leases to the peers.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from dflash_pipe.data import Sample, plan_batches, sample_lengths
from dflash_pipe.producer.errors import NothingToTrain, RunAborted
from dflash_pipe.producer.regen import GenerateDone, GenerateJob, Regeneration, first_open_epoch
from dflash_pipe.producer.scheduler import BatchScheduler, PlannedBatch, ReadyBatch
from dflash_pipe.producer.target_threads import EvalDone, EvalJob, TargetFailure, pack
from dflash_pipe.run.ledger import Ledger
from dflash_pipe.wire import messages as m


class Leasing:
    """The plan queue, the ready batches and their leases, regeneration's jobs and the eval set's state."""

    def __init__(
        self,
        samples: Sequence[Sample],
        ledger: Ledger,
        *,
        regen: Regeneration | None,
        epochs: int,
        token_budget: int,
        seed: int,
        ready_batches: int,
        note: Callable[[str], None],
        plans: Iterator[PlannedBatch | None] | None = None,
    ) -> None:
        """``samples``: the run's training samples (sample id = index), planned ``token_budget`` tokens a
        batch, shuffled by ``seed``, for ``epochs`` epochs from the first that ``ledger`` has open; with
        ``regen``, the regeneration that fills them. ``ready_batches``: batches kept computed ahead.
        ``plans``: plans made elsewhere (an attaching producer's, from the coordinator) instead of this
        run's own. ``note``: where a line for the dashboard goes."""
        self._samples, self._note = samples, note
        self._token_budget, self._seed, self._ready_batches = token_budget, seed, ready_batches
        self.regen = regen
        start_epoch = first_open_epoch(ledger, regen.voids if regen else set())
        self.scheduler = BatchScheduler(
            plan_epoch=self._plan_epoch,
            epochs=epochs,
            start_epoch=min(start_epoch, epochs),
            trained_in_start_epoch=ledger.trained(start_epoch) if start_epoch < ledger.epochs else set(),
            source=plans,
        )
        self.plans: queue.Queue[PlannedBatch | GenerateJob | EvalJob | None] = queue.Queue()
        """What the target threads take: feature plans, generation jobs, the eval set's job."""
        self.ready: queue.Queue[ReadyBatch | GenerateDone | EvalDone | TargetFailure] = queue.Queue()
        """What they give back."""
        self.target_threads = 0
        """Target threads taking from ``plans`` (``targets_started``)."""
        self.jobs_per_thread = 1
        """Generation jobs handed to each target thread at once: 2 where the slot engine decodes (a thread
        takes the second into its free slots while the first finishes), 1 on the plain path."""
        self.generate_seconds: Callable[[], float] = lambda: 0.0
        """The target threads' seconds spent generating so far."""
        self.in_target = 0
        """Feature plans handed to the target threads and not back yet."""
        self.generating = 0
        """Regeneration jobs handed to the target threads and not back yet."""
        self.done_sent = False
        """DONE went out: nothing more is planned or leased."""
        self.eval_batches: list[m.Batch] = []
        self.eval_pending = self.regen is not None
        """The held-out set is still being regenerated (or its BATCHes computed): workers welcomed
        meanwhile are told so, and get its BATCHes once they exist."""
        self._eval_queued = False
        self._waiting_note = False

    def _plan_epoch(self, epoch: int, exclude: set[int]) -> Iterable[list[int] | None]:
        if self.regen is not None:
            return self.regen.epoch0(exclude) if epoch == 0 else self.regen.later_epoch(epoch, exclude)
        lengths = sample_lengths(self._samples)
        return plan_batches(lengths, self._token_budget, seed=self._seed, epoch=epoch, exclude=exclude)

    # --- set-up ------------------------------------------------------------------------------------------

    def targets_started(
        self, threads: int, *, jobs_per_thread: int = 1, generate_seconds: Callable[[], float] | None = None
    ) -> None:
        """``threads`` target threads take from ``plans`` now (0 again while a target reloads)."""
        self.target_threads, self.jobs_per_thread = threads, jobs_per_thread
        if generate_seconds is not None:
            self.generate_seconds = generate_seconds

    def set_eval(self, batches: list[m.Batch]) -> None:
        """The held-out BATCHes of a run on dataset responses, built before serving."""
        self.eval_batches = batches

    def await_eval(self) -> None:
        """An attaching producer whose coordinator has a held-out set (or is still regenerating it)."""
        self.eval_pending = True

    def queue_eval(self, samples: list) -> None:
        """An attaching producer has the held-out set's PLANs: a target thread turns them into BATCHes."""
        self.eval_pending = True
        self.plans.put(EvalJob(samples=samples))

    # --- the target threads ------------------------------------------------------------------------------

    def take_ready(self) -> list[m.Batch] | None:
        """Moves what the target threads finished into the scheduler (regenerated replies to ``regen``);
        returns the eval set's BATCHes when they were just computed (the core sends them). The replies that
        came meanwhile are written together (one flush)."""
        replies: list[GenerateDone] = []
        installed = None
        while True:
            try:
                item = self.ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, TargetFailure):
                raise RunAborted(f"target replica {item.replica} failed: {item.error!r}") from item.error
            if isinstance(item, EvalDone):
                self.eval_batches, self.eval_pending = item.batches, False
                installed = item.batches
                continue
            if isinstance(item, GenerateDone):
                self.generating -= int(item.last)
                replies.append(item)
                continue
            self.in_target -= 1
            self.scheduler.add_ready(item)
        if replies and (note := self.regen.accept(*replies)):  # type: ignore[union-attr]
            self._note(note)
        if self.regen is not None and (why := self.regen.nothing_to_train()):  # also a reused file's
            raise NothingToTrain(why)
        return installed

    def refill(self) -> None:
        """Keeps ``ready_batches`` computed plus two plans per target thread in computation, so no replica
        waits on us: all threads take from one queue (an idle one takes the next plan), and each holds one
        batch whose copy drains while it computes the next (``TargetThread``)."""
        bound = self._ready_batches + 2 * self.target_threads
        while self.in_target + self.scheduler.ready_count() < bound:
            if self.done_sent:
                return
            plan = self.scheduler.next_plan()
            if plan is None:
                break
            self.plans.put(plan)
            self.in_target += 1
        self._refill_generation()
        self._refill_eval()

    def _refill_generation(self) -> None:
        """``jobs_per_thread`` regeneration jobs per target thread at most. On the plain path a replica
        alternates between a job and the feature batches queued meanwhile; on the slot engine it computes
        those batches at each decode check and moves the second job's conversations into the slots the
        first frees. Either way the workers train on the first replies while the rest are generated."""
        if self.regen is None or self.done_sent:
            return
        while self.generating < self.jobs_per_thread * self.target_threads:
            job = self.regen.next_job()
            if job is None:
                return
            self.plans.put(job)
            self.generating += 1

    def _refill_eval(self) -> None:
        """Once every held-out conversation is regenerated, its samples go to a target thread to become the
        eval BATCHes (an ``EvalJob``): the main thread never runs a forward itself."""
        if not self.eval_pending or self._eval_queued or self.regen is None or not self.regen.eval_ready:
            return
        self._eval_queued = True
        samples = self.regen.eval_samples()
        if not samples:
            self.eval_pending = False
            if len(self.regen.eval_indexes):
                self._note("warning: no held-out conversation has a regenerated turn to evaluate: no tau")
            return
        self.plans.put(EvalJob(samples=samples))

    # --- leases ------------------------------------------------------------------------------------------

    def lease_batch(self, peer_id: bytes) -> ReadyBatch | None:
        return None if self.done_sent else self.scheduler.lease_next(peer_id, time.monotonic())

    def lease_plan(self, peer_id: bytes) -> m.Plan | None:
        """The next plan for an attaching producer, as a PLAN carrying its samples' tokens; None when none
        waits. The coordinator's own replicas are served first (``refill`` runs before this), so a producer
        that attaches takes only what would otherwise wait."""
        if self.done_sent or (plan := self.scheduler.next_plan()) is None:
            return None
        ids, mask, lengths = pack([self._samples[i] for i in plan.sample_ids])
        self.scheduler.lease_plan(peer_id, plan, tokens=int(ids.numel()), now=time.monotonic())
        return m.Plan(
            batch_id=plan.batch_id,
            epoch=plan.epoch,
            sample_ids=plan.sample_ids,
            lengths=lengths,
            tensors={"input_ids": ids, "loss_mask": mask.to(torch.uint8)},
        )

    def ack(self, peer_id: bytes, batch_ids: list[int]) -> int:
        """Ends the leases of ``batch_ids``; returns the tokens they trained."""
        before = self.scheduler.stats.acked_tokens
        self.scheduler.ack(peer_id, batch_ids)
        return self.scheduler.stats.acked_tokens - before

    def release(self, peer_id: bytes) -> int:
        """A peer left or was lost: its open leases go back to the queue. Returns how many."""
        return self.scheduler.release(peer_id)

    def mark_done(self) -> None:
        self.done_sent = True

    def finished(self) -> bool:
        """Every epoch trained and, with regeneration, the eval set sent: DONE comes after the held-out
        BATCHes, so the workers' final evaluation has them."""
        if not self.scheduler.finished():
            return False
        if self.eval_pending and not self._waiting_note:
            self._waiting_note = True
            self._note("all epochs trained; waiting for the held-out set before DONE (the final evaluation)")
        return not self.eval_pending
