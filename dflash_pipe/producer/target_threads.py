"""Target threads: one per target replica, turning planned batches into BATCH messages ahead of demand.

Each thread owns one ``TargetCore`` on its own GPU, so every target GPU works in parallel (torch releases
the GIL inside kernels). The producer's main thread never computes; it only routes. With
``data.responses = "target"`` the same threads also take ``GenerateJob``s from the plan queue and regenerate
conversations on their replica (``dflash_pipe.producer.regen``), between feature batches.

Features leave the GPU without stalling it: each batch's ``[T, k*H]`` features are copied into a staging slot
(``PayloadStaging``: pinned host memory, or GPU memory of the CUDA IPC ring, device to device) on a side CUDA
stream, and the thread launches the NEXT batch's forward
before it waits for that copy (double buffering). The wire message's ``features`` tensor is a view of the
slot, which rides on the ``ReadyBatch`` until the scheduler releases it on the ACK. On CPU the same steps
run with a plain synchronous copy into the slot.

Past 400 lines since regeneration must stop between decode steps on a drain; issue 51 moves the
regenerated reply's forms to one owner, which takes the job half of this module away.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipe.compute.compile import apply_dynamo_settings
from dflash_pipe.compute.torch_threads import computes_torch
from dflash_pipe.data import Sample
from dflash_pipe.data.regenerated import Regenerated
from dflash_pipe.producer.regen import GenerateDone, GenerateJob
from dflash_pipe.producer.scheduler import PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import PendingRun, RunContext
from dflash_pipe.target import TargetCore
from dflash_pipe.target.decode import GenerationStopped
from dflash_pipe.telemetry import RateMeter
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.fp8 import wire_features
from dflash_pipe.wire.slots import PayloadSlot, PayloadStaging, slot_layout

_STOP_POLL_S = 0.2
"""How often a target thread waiting for a free staging slot checks whether the producer closes."""
EVAL_BATCH_SAMPLES = 4
"""Held-out samples per eval BATCH."""


class TargetStopped(Exception):
    """The producer closed while a target thread waited for a staging slot (the thread just ends)."""


@dataclass(slots=True)
class TargetFailure:
    """Sent through the ready queue when a target thread dies, so the main thread can report it."""

    replica: str
    error: BaseException


def load_replicas(ctx: RunContext | PendingRun) -> list[TargetCore]:
    """One TargetCore per replica: a GPU each when the target fits, else one split over the target GPUs.

    Needs no data, so a launch runs it while the data still tokenizes (``PendingRun``)."""
    from dflash_pipe.target.placement import cuda_memory, plan_replicas, weight_bytes

    groups = plan_replicas(
        ctx.cfg.layout.target_devices(),
        weights=weight_bytes(ctx.target_path, ctx.target_dtype),
        memory=cuda_memory,
        mode=ctx.cfg.layout.target_parallel,
    )
    return [TargetCore(ctx.target_path, ctx.drafter.target_layer_ids, g, ctx.target_dtype) for g in groups]


def pack(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    ids = torch.cat([s.input_ids for s in samples])  # [T]
    mask = torch.cat([s.loss_mask for s in samples])  # [T]
    return ids, mask, [int(s.input_ids.numel()) for s in samples]


def _message(
    plan: PlannedBatch, lengths: list[int], tensors: dict[str, torch.Tensor], eval_set: int = 0
) -> m.Batch:
    return m.Batch(
        batch_id=plan.batch_id,
        epoch=plan.epoch,
        sample_ids=list(plan.sample_ids),
        lengths=lengths,
        tensors=tensors,
        for_eval=eval_set > 0,
        eval_set=eval_set,
    )


def build_batch(
    core: TargetCore,
    plan: PlannedBatch,
    samples: Sequence[Sample],
    *,
    eval_set: int = 0,
    wire_dtype: str = "bf16",
) -> m.Batch:
    """One batch computed and copied synchronously into private memory (eval batches, kept for the whole
    run: they must not hold a staging slot). ``eval_set``: the batches of the held-out set this one belongs
    to (0: a training batch)."""
    ids, mask, lengths = pack(samples)
    wire = wire_features(core.features(ids, lengths), len(core.layer_ids), wire_dtype)
    tensors = {"input_ids": ids, "loss_mask": mask.to(torch.uint8), **{k: v.cpu() for k, v in wire.items()}}
    if eval_set:
        tensors["target_next"] = core.greedy_next(ids, lengths).cpu()
    return _message(plan, lengths, tensors, eval_set)


def build_eval_batches(
    core: TargetCore, samples: Sequence[Sample], wire_dtype: str = "bf16"
) -> list[m.Batch]:
    """The held-out samples as eval BATCHes of ``EVAL_BATCH_SAMPLES`` each (features and the target's
    greedy next tokens), every one naming how many the set has."""
    chunks = [samples[i : i + EVAL_BATCH_SAMPLES] for i in range(0, len(samples), EVAL_BATCH_SAMPLES)]
    return [
        build_batch(
            core,
            PlannedBatch(batch_id=n, epoch=0, sample_ids=[s.sample_id for s in chunk]),
            chunk,
            eval_set=len(chunks),
            wire_dtype=wire_dtype,
        )
        for n, chunk in enumerate(chunks)
    ]


@dataclass(slots=True)
class EvalJob:
    """The held-out samples, once regenerated, for a target thread to turn into the eval BATCHes (its
    replica computes them; the main thread must not run a forward on a replica a thread drives)."""

    samples: list[Sample]


@dataclass(slots=True)
class EvalDone:
    """The eval BATCHes of an ``EvalJob``, sent back through the ready queue."""

    batches: list[m.Batch]
    seconds: float


@dataclass(slots=True)
class InFlight:
    """A batch whose features are being copied into its host slot."""

    ready: ReadyBatch
    done: torch.cuda.Event | None
    """Recorded on the copy stream after the copy; None when the copy ran synchronously (CPU)."""
    source: list[torch.Tensor] | None
    """The device tensors, kept alive until the copy that reads them has finished."""

    def wait(self) -> ReadyBatch:
        if self.done is not None:
            self.done.synchronize()
        self.source = None
        return self.ready


class FeatureCopier:
    """Launches a batch's forward and the asynchronous copy of its features into a staging slot."""

    def __init__(
        self,
        core: TargetCore,
        staging: PayloadStaging,
        wire_dtype: str = "bf16",
        stopping: threading.Event | None = None,
    ) -> None:
        self.core = core
        self.staging = staging
        self.wire_dtype = wire_dtype
        self.stopping = stopping
        """Set when the producer closes: a wait for a free slot gives up (``TargetStopped``)."""
        cuda = core.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=core.device) if cuda else None

    def launch(self, plan: PlannedBatch, samples: Sequence[Sample], *, flush=None) -> InFlight:
        """Queues the forward and the device-to-host copy; returns without waiting for either (on CUDA).

        ``flush()`` is called before blocking on a full staging area, so a batch this thread still holds
        can free its way (a ring smaller than two slots per thread would otherwise deadlock)."""
        ids, mask, lengths = pack(samples)
        feats = self.core.features(ids, lengths)  # [T, k*H], queued on the current stream
        # fp8: quantised on the target device, before the copy (half the bytes to move)
        wire = wire_features(feats, len(self.core.layer_ids), self.wire_dtype)
        offsets, nbytes = slot_layout(wire)
        slot = self._acquire(nbytes, flush)
        host = slot.views(wire, offsets)
        done = None
        if self.stream is None:
            for name, t in wire.items():
                host[name].copy_(t)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(feats.device))
            with torch.cuda.stream(self.stream):
                for name, t in wire.items():
                    host[name].copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensors = {"input_ids": ids, "loss_mask": mask.to(torch.uint8), **host}
        batch = _message(plan, lengths, tensors)
        ready = ReadyBatch(plan=plan, payload=batch, tokens=sum(lengths), slot=slot)
        return InFlight(ready=ready, done=done, source=list(wire.values()) if done is not None else None)

    def _acquire(self, nbytes: int, flush) -> PayloadSlot:
        if flush is not None:
            try:
                return self.staging.acquire(nbytes, timeout_s=0.0)
            except TimeoutError:
                flush()
        if self.stopping is None:
            return self.staging.acquire(nbytes)
        while True:  # every slot is leased: wait, but not past the producer's close
            try:
                return self.staging.acquire(nbytes, timeout_s=_STOP_POLL_S)
            except TimeoutError:
                if self.stopping.is_set():
                    raise TargetStopped from None


class TargetThread(threading.Thread):
    """Computes planned batches on one replica, two at a time: batch k's copy drains while k+1 computes."""

    def __init__(
        self,
        core: TargetCore,
        samples: Sequence[Sample],
        plans: queue.Queue[PlannedBatch | GenerateJob | EvalJob | None],
        ready: queue.Queue[ReadyBatch | GenerateDone | EvalDone | TargetFailure],
        rate: RateMeter,
        name: str,
        staging: PayloadStaging,
        wire_dtype: str = "bf16",
        make_generator: Callable[[TargetCore], Any] | None = None,
    ) -> None:
        """``make_generator``: builds this replica's ``TurnGenerator`` for the ``GenerateJob``s that come
        through ``plans`` (runs with ``data.responses = "target"``)."""
        super().__init__(name=f"target-{name}", daemon=True)
        computes_torch(self)  # the command's exit must not finalize around it
        self.core = core
        self.samples = samples
        self.plans = plans
        self.ready = ready
        self.rate = rate
        self.replica = name
        self.staging = staging
        self.wire_dtype = wire_dtype
        self.busy_s = 0.0
        """Seconds spent launching forwards, waiting for their copies and generating (not waiting for
        plans)."""
        self.generate_s = 0.0
        """Of those, seconds spent regenerating conversations."""
        self._make_generator = make_generator
        self._generator: Any = None
        self._pending: InFlight | None = None
        self._copier: FeatureCopier | None = None
        self._stashed: list[PlannedBatch | GenerateJob | EvalJob | None] = []
        """A plan taken during a generation that the run loop must see next (the closing ``None``)."""
        self.stopping = threading.Event()
        """Set by ``stop()``: no new batch starts (the one computing finishes) and a generation job in
        progress stops at its next decode step."""
        self.no_generation = threading.Event()
        """Set by ``stop_generating()``: the generation in progress stops at its next decode step (or
        prefill call) and later jobs are skipped; feature batches are still computed."""

    def stop(self) -> None:
        """Asks the thread to end after the batch it computes; ``join()`` to wait for that. The producer
        must not exit (nor free the staging memory) while this thread is inside the target's forward: a
        daemon thread running torch code at interpreter exit aborts the process (SIGABRT)."""
        self.stopping.set()

    def stop_generating(self) -> None:
        """Asks the thread to stop regenerating now (a drain): the conversations finished so far are
        already in ``ready``, the others are generated again by the next launch on the run dir."""
        self.no_generation.set()

    def _should_stop(self) -> bool:
        return self.stopping.is_set() or self.no_generation.is_set()

    def run(self) -> None:
        try:
            if self.core.device.type == "cuda" and self.core.device.index is not None:
                torch.cuda.set_device(self.core.device)  # streams and events of this thread live there
            apply_dynamo_settings()  # per thread: the compiled target layers and flex functions
            self._copier = FeatureCopier(self.core, self.staging, self.wire_dtype, stopping=self.stopping)
            while not self.stopping.is_set() and (plan := self._next_plan()) is not None:
                if isinstance(plan, GenerateJob):
                    self._generate(plan)
                elif isinstance(plan, EvalJob):
                    self._build_eval(plan)
                else:
                    self._compute(plan)
            self._finish()
        except TargetStopped:
            pass  # the producer is closing; nothing waits for this batch
        except BaseException as exc:  # reported by the main thread, never swallowed
            self.ready.put(TargetFailure(replica=self.replica, error=exc))

    def _compute(self, plan: PlannedBatch) -> float:
        """Launches a feature batch (the previous one's copy drains meanwhile); returns the seconds spent."""
        t0 = time.perf_counter()
        assert self._copier is not None
        launched = self._copier.launch(plan, [self.samples[i] for i in plan.sample_ids], flush=self._finish)
        self._finish()  # the previous batch's copy drained while this one was queued
        self._pending = launched
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        return seconds

    def _build_eval(self, job: EvalJob) -> None:
        """The eval BATCHes of the held-out samples, in private memory (they live for the whole run)."""
        t0 = time.perf_counter()
        batches = build_eval_batches(self.core, job.samples, self.wire_dtype)
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        self.ready.put(EvalDone(batches=batches, seconds=seconds))

    def _generate(self, job: GenerateJob) -> None:
        """Hands over the pending batch first (its worker may wait for it), then regenerates the job. On the
        slot engine, the feature batches and the jobs queued meanwhile are taken at each of its checks:
        batches are computed at once (the drafters never wait for a whole job), and a new job's
        conversations take the slots the running ones free (``GenerateDone`` per job, once its last
        conversation is done)."""
        self._finish()
        if self.no_generation.is_set():
            return  # a drain: the job is generated by the next launch
        if self._generator is None:
            if self._make_generator is None:
                raise RuntimeError("a GenerateJob reached a target thread that was given no make_generator")
            self._generator = self._make_generator(self.core)
        jobs = _OpenJobs(self.ready, self.replica)
        jobs.open(job)

        mark = time.perf_counter()

        def between() -> list[tuple[int, list[dict[str, str]]]]:
            nonlocal mark
            now = time.perf_counter()
            self.generate_s += now - mark  # kept current: the dashboard reads it during the call
            self.busy_s += now - mark
            added: list[tuple[int, list[dict[str, str]]]] = []
            while not self._stashed:
                try:
                    plan = self.plans.get_nowait()
                except queue.Empty:
                    break
                if plan is None:  # closing: the run loop sees it once this generation is over
                    self._stashed.append(plan)
                elif isinstance(plan, GenerateJob):
                    jobs.open(plan)
                    added += plan.items
                elif isinstance(plan, EvalJob):
                    self._build_eval(plan)
                else:
                    self._compute(plan)
            mark = time.perf_counter()
            return added

        engine = self._generator.engine() is not None
        try:
            self._generator.regenerate(
                job.items,
                should_stop=self._should_stop,
                on_done=jobs.done,
                between=between if engine else None,
            )
        except GenerationStopped:
            return  # shutting down: the jobs' unfinished conversations are generated again on resume
        seconds = time.perf_counter() - mark
        self.busy_s += seconds
        self.generate_s += seconds

    def _next_plan(self) -> PlannedBatch | GenerateJob | EvalJob | None:
        """The next plan without waiting while a batch is pending; with none queued, hand that batch over
        first (its consumers may be waiting for it), then wait."""
        if self._stashed:
            return self._stashed.pop()
        if self._pending is not None:
            try:
                return self.plans.get_nowait()
            except queue.Empty:
                self._finish()
        return self.plans.get()

    def _finish(self) -> None:
        if self._pending is None:
            return
        ready = self._pending.wait()
        self._pending = None
        self.rate.add(ready.tokens)
        self.ready.put(ready)


class _OpenJobs:
    """The generation jobs a replica works on at once. Each conversation is answered as soon as it is done
    (``GenerateDone``; the main thread writes what came in one tick together), the job's last with
    ``last=True`` and the job's seconds."""

    def __init__(self, ready: queue.Queue, replica: str) -> None:
        self.ready, self.replica = ready, replica
        self._jobs: dict[int, tuple[GenerateJob, set[int], float]] = {}
        self._owner: dict[int, int] = {}

    def open(self, job: GenerateJob) -> None:
        self._jobs[job.job_id] = (job, {index for index, _ in job.items}, time.perf_counter())
        self._owner.update((index, job.job_id) for index, _ in job.items)

    def done(self, record: Regenerated) -> None:
        job_id = self._owner.pop(record.index)
        job, left, t0 = self._jobs[job_id]
        left.discard(record.index)
        last = not left
        if last:
            del self._jobs[job_id]
        seconds = time.perf_counter() - t0 if last else 0.0
        self.ready.put(
            GenerateDone(job=job, results=[record], seconds=seconds, replica=self.replica, last=last)
        )
