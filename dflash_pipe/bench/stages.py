"""Each pipeline stage measured alone, on the run's own data: target, drafters, wire, and offline.

All stages count the same tokens (the real samples' lengths, batched by the run's own plans), so their
tokens/s compare directly with the pipeline's. Worker-side stages run in child processes started like the
launcher starts workers (``python -m dflash_pipe.bench.child``), so each drafter has its own process and
device, and the drafters train in lockstep through the real group (``DrafterGroup``) and training loop.
"""

from __future__ import annotations

import os
import queue
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_pipe.bench.procs import Children, start_children
from dflash_pipe.cpus import threads_per_process
from dflash_pipe.data import plan_batches, sample_lengths
from dflash_pipe.producer.scheduler import PlannedBatch, ReadyBatch
from dflash_pipe.producer.setup import RunContext, prepare_run
from dflash_pipe.producer.target_threads import TargetFailure, TargetThread, load_replicas, pack
from dflash_pipe.run.config import RunConfig
from dflash_pipe.telemetry import RateMeter
from dflash_pipe.wire import messages as m
from dflash_pipe.wire.slots import PrivateStaging

CHILD_TIMEOUT_S = 900.0
"""A child that has not finished this long after its stage's deadline is killed (its log is shown)."""


@dataclass(frozen=True, slots=True)
class StageRate:
    """Tokens a stage processed in its measured window, and that window."""

    stage: str
    tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class BenchWork:
    """The run's resolved inputs (target, samples, drafter shape) and its epoch-0 batch plans."""

    cfg: RunConfig
    ctx: RunContext
    plans: list[list[int]]
    work_dir: Path

    @property
    def feature_size(self) -> int:
        return self.ctx.drafter.feature_size

    @property
    def feature_dtype(self) -> torch.dtype:
        return self.ctx.target_dtype

    def lengths(self, plan: list[int]) -> list[int]:
        return [int(self.ctx.train_samples[i].input_ids.numel()) for i in plan]

    def mean_batch_tokens(self) -> float:
        return sum(sum(self.lengths(p)) for p in self.plans) / len(self.plans)

    def child_spec(self) -> dict[str, Any]:
        """What a drafter child needs to build the drafter as a launched worker would."""
        return {
            "drafter": self.ctx.drafter.to_dict(),
            "train": self.cfg.to_dict()["train"],
            "target_path": str(self.ctx.target_path),
            "num_samples": len(self.ctx.train_samples),
            "feature_size": self.feature_size,
            "feature_dtype": str(self.feature_dtype).removeprefix("torch."),
            "cache_dir": str(self.cfg.cache_dir),
            "credits": self.cfg.wire.worker_credits,
        }


def prepare_work(cfg: RunConfig) -> BenchWork:
    """Loads target config, tokenizer and data once (the demo target is built and cached if needed)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if cfg.layout.device == "cpu":  # the producer's thread budget in a CPU launch, for every stage here
        torch.set_num_threads(threads_per_process(cfg.layout.num_workers + 1))
    ctx = prepare_run(cfg, resume=False, progress=False)
    lengths = sample_lengths(ctx.train_samples)
    plans = plan_batches(lengths, cfg.data.token_budget, seed=cfg.train.seed, epoch=0, exclude=set())
    if not plans:
        raise ValueError(f"--data {cfg.data.path}: no training samples left to benchmark on.")
    return BenchWork(cfg=cfg, ctx=ctx, plans=plans, work_dir=cfg.run_dir)


# --- (a) the producer alone -----------------------------------------------------------------------------


def start_target_threads(work: BenchWork, plans: queue.Queue, ready: queue.Queue) -> list[TargetThread]:
    """One TargetCore per replica, placed as the producer places them, each fed by its own thread."""
    threads = []
    for core in load_replicas(work.ctx):
        thread = TargetThread(
            core,
            work.ctx.train_samples,
            plans,
            ready,
            RateMeter(),
            name=str(core.device),
            staging=PrivateStaging(),  # as the producer does without a ring: pinned private buffers
        )
        thread.start()
        threads.append(thread)
    return threads


def producer_alone(work: BenchWork, seconds: float) -> StageRate:
    """Target replicas compute features for the run's batches as fast as they can; results are dropped.
    Each replica's first batch is a warm-up, outside the window."""
    plans: queue.Queue = queue.Queue()
    ready: queue.Queue = queue.Queue()
    threads = start_target_threads(work, plans, ready)
    replicas = len(threads)
    next_plan = 0

    def feed(n: int) -> None:
        nonlocal next_plan
        for _ in range(n):
            ids = work.plans[next_plan % len(work.plans)]
            plans.put(PlannedBatch(batch_id=next_plan, epoch=0, sample_ids=ids))
            next_plan += 1

    try:
        feed(replicas)
        for _ in range(replicas):
            _take_ready(ready)
        feed(2 * replicas)
        t0, tokens, batches = time.perf_counter(), 0, 0
        while time.perf_counter() - t0 < seconds or batches == 0:
            tokens += _take_ready(ready).tokens
            batches += 1
            feed(1)
        elapsed = time.perf_counter() - t0
    finally:
        _stop(threads, plans)
    return StageRate("producer alone", tokens, elapsed, {"batches": batches, "replicas": replicas})


def _take_ready(ready: queue.Queue) -> ReadyBatch:
    item = ready.get(timeout=CHILD_TIMEOUT_S)
    if isinstance(item, TargetFailure):
        raise RuntimeError(f"target replica {item.replica} failed: {item.error!r}") from item.error
    return item


def _stop(threads: list[TargetThread], plans: queue.Queue) -> None:
    """Ends the target threads and frees their replicas' memory before the next stage starts."""
    for _ in threads:
        plans.put(None)
    for thread in threads:
        thread.join(timeout=CHILD_TIMEOUT_S)
    threads.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- batch files: (b) synthetic features and (e) offline ------------------------------------------------


def write_batch_files(
    work: BenchWork,
    out_dir: Path,
    *,
    features: bool,
    max_tokens: int | None = None,
    min_batches: int = 1,
) -> dict[str, Any]:
    """One safetensors file per planned batch (input_ids, loss_mask, lengths, sample_ids; features if
    asked): every epoch-0 batch, or the plans (cycled) until ``max_tokens`` and ``min_batches`` are reached.

    With ``features`` this is the offline trainer's first half: the target replicas compute the batches
    (each replica's first forward is start-up, outside the time) and each batch's features are written to
    disk as they come."""
    from safetensors.torch import save_file

    chosen = list(work.plans)
    if max_tokens is not None:
        chosen, total = [], 0
        while total < max_tokens or len(chosen) < min_batches:
            chosen.append(work.plans[len(chosen) % len(work.plans)])
            total += sum(work.lengths(chosen[-1]))
    out_dir.mkdir(parents=True, exist_ok=True)
    plans_q: queue.Queue = queue.Queue()
    ready: queue.Queue = queue.Queue()
    threads = start_target_threads(work, plans_q, ready) if features else []
    for _ in threads:
        plans_q.put(PlannedBatch(batch_id=0, epoch=0, sample_ids=work.plans[0]))
    for _ in threads:
        _take_ready(ready)
    t0 = time.perf_counter()
    nbytes = 0
    try:
        if features:
            for i, plan in enumerate(chosen):
                plans_q.put(PlannedBatch(batch_id=i, epoch=0, sample_ids=plan))
        for k in range(len(chosen)):
            item = _take_ready(ready) if features else None  # replicas may finish out of order
            i = item.plan.batch_id if item is not None else k
            plan = chosen[i]
            ids, mask, lengths = pack([work.ctx.train_samples[j] for j in plan])
            tensors = {
                "input_ids": ids,
                "loss_mask": mask.to(torch.uint8),
                "lengths": torch.tensor(lengths, dtype=torch.int64),
                "sample_ids": torch.tensor(plan, dtype=torch.int64),
            }
            if item is not None:
                tensors["features"] = item.payload.tensors["features"].contiguous()
            path = out_dir / f"batch-{i:06d}.safetensors"
            save_file(tensors, str(path))
            nbytes += path.stat().st_size
        if features:
            os.sync()  # the offline write is done when the bytes are on disk, not in the page cache
    finally:
        _stop(threads, plans_q)
    seconds = time.perf_counter() - t0
    tokens = sum(sum(work.lengths(plan)) for plan in chosen)
    return {"batches": len(chosen), "tokens": tokens, "bytes": nbytes, "seconds": seconds}


def _start_store() -> tuple[torch.distributed.TCPStore, str]:
    """The drafters' rendezvous store, in this process as in the producer."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"tcp://127.0.0.1:{store.port}"


def drafters_on(work: BenchWork, batch_dir: Path, *, seconds: float | None, synthetic: bool) -> list[dict]:
    """One drafter child per worker device, training in lockstep on the batch files in ``batch_dir``."""
    store, rendezvous = _start_store()
    devices = work.cfg.layout.worker_devices()
    files = sorted(str(p) for p in batch_dir.glob("batch-*.safetensors"))
    base = {**work.child_spec(), "rendezvous": rendezvous, "run_id": uuid.uuid4().hex[:8]}
    specs = [
        {
            **base,
            "device": device,
            "files": files[i :: len(devices)] or files[:1],
            "seconds": seconds,
            "synthetic": synthetic,
            "run_dir": str(work.work_dir / f"drafter-{i}"),
        }
        for i, device in enumerate(devices)
    ]
    children = start_children(work.work_dir / "children", work.cfg.cache_dir, "drafter", specs)
    results = children.wait(timeout_s=CHILD_TIMEOUT_S + (seconds or 0))
    del store  # the children are gone; the rendezvous store can go too
    return results


def drafters_alone(work: BenchWork, seconds: float) -> StageRate:
    """The real training loop on synthetic features of the right shape (no target, no wire); each
    worker's first step (compile, warm-up) is outside the window."""
    batch_dir = work.work_dir / "synthetic-batches"
    write_batch_files(work, batch_dir, features=False)
    results = drafters_on(work, batch_dir, seconds=seconds, synthetic=True)
    return lockstep_rate("drafters alone", results)


def lockstep_rate(stage: str, results: list[dict]) -> StageRate:
    """Sum of the workers' tokens after their first step, over the longest worker window."""
    tokens = sum(r["tokens_after_first"] for r in results)
    window = max(r["last_ack"] - r["first_ack"] for r in results)
    extra = {
        "steps": max(r["steps"] for r in results),
        "workers": len(results),
        # per worker: what a rate of 0 would come from (one ACK, or none after the first)
        "per_worker": [
            {k: r[k] for k in ("steps", "first_ack", "last_ack", "tokens_after_first")} for r in results
        ],
    }
    return StageRate(stage, tokens, window, extra)


def transport_alone(work: BenchWork, seconds: float) -> StageRate:
    """BATCH messages of the run's sizes (features [T, k*H] in the target dtype) from a ROUTER in this
    process to one receiving worker process per drafter device, with credits and ACKs as in a run; the
    receiver unpacks each batch onto its device as the worker does. The first ACK opens the window."""
    from dflash_pipe.wire.transport import ProducerEndpoint

    devices = work.cfg.layout.worker_devices()
    messages = []
    for i, plan in enumerate(work.plans[:8]):
        ids, mask, lengths = pack([work.ctx.train_samples[j] for j in plan])
        feats = torch.randn(ids.numel(), work.feature_size).to(work.feature_dtype)
        tensors = {"input_ids": ids, "loss_mask": mask.to(torch.uint8), "features": feats}
        messages.append(m.Batch(batch_id=i, epoch=0, sample_ids=plan, lengths=lengths, tensors=tensors))
    endpoint = ProducerEndpoint(work.cfg.wire.bind)
    children = start_children(
        work.work_dir / "children",
        work.cfg.cache_dir,
        "sink",
        [{"address": endpoint.address, "feature_size": work.feature_size, "device": d} for d in devices],
    )
    try:
        tokens, window, batches = _serve_batches(endpoint, messages, seconds, children)
        children.wait(timeout_s=CHILD_TIMEOUT_S)
    finally:
        children.kill()
        endpoint.close()
    payload = sum(t.numel() * t.element_size() for t in messages[0].tensors.values())
    extra = {"batches": batches, "bytes_per_batch": payload, "receivers": len(devices)}
    return StageRate("transport alone", tokens, window, extra)


def _serve_batches(
    endpoint: Any, messages: list[m.Batch], seconds: float, receivers: Children
) -> tuple[int, float, int]:
    """Sends batches against credits until ``seconds`` after the first ACK, then DONE; waits for every
    receiver's BYE. Returns (tokens acked after the first ACK, that window in seconds, batches acked)."""
    credits: dict[bytes, int] = {}
    tokens_of: dict[int, int] = {}
    left: set[bytes] = set()
    sent = acked = tokens = 0
    first = last = None
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while len(left) < len(receivers.procs):
        if receivers.failed():  # Children.wait reports which one and why
            return 0, 0.0, 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"transport bench: receivers did not finish within {CHILD_TIMEOUT_S:.0f} s")
        got = endpoint.recv(timeout_s=0.02)
        if got is not None:
            peer, msg = got
            if isinstance(msg, m.Ready):
                credits[peer] = credits.get(peer, 0) + msg.credits
            elif isinstance(msg, m.Ack):
                now = time.perf_counter()
                acked += len(msg.batch_ids)
                if first is None:
                    first = now
                else:
                    tokens += sum(tokens_of.pop(b) for b in msg.batch_ids)
                last = now
            elif isinstance(msg, m.Bye):
                left.add(peer)
        finished = first is not None and time.perf_counter() - first >= seconds
        for peer in credits:
            if finished:
                if credits[peer] >= 0:
                    endpoint.try_send(peer, m.Done(reason="transport bench finished"))
                    credits[peer] = -1
                continue
            while credits[peer] > 0:
                msg = messages[sent % len(messages)]
                msg.batch_id = sent
                tokens_of[sent] = sum(msg.lengths)
                endpoint.send(peer, msg)
                credits[peer] -= 1
                sent += 1
    return tokens, (last - first) if first is not None else 0.0, acked
